"""Activation checkpointing: non-reentrant checkpointing is exact; reentrant checkpointing is refused with the
way out."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import flashdp
from flashdp import FlashDPError
from tests.conftest import MODES, requires_triton
from tests.oracle import check_against_oracle
from tests.strategies import per_sample_loss
from tests.test_hf_models import VOCAB, gpt2, llama, lm_loss, positions

REENTRANT = r"activation checkpointing with use_reentrant=True.*use_reentrant=False"


class OwnForwardLinear(nn.Linear):
    """A Linear subclass with its own forward: checked against the Linear rule on its first call."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(OwnForwardLinear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant).tanh())


@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpointing_is_exact(mode):
    model = Checkpointed().double() if mode != "flash" else Checkpointed()
    x = torch.randn(5, 3, 4, dtype=next(model.parameters()).dtype)
    rtol = 2e-4 if mode == "flash" else 1e-9
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 5, mode=mode, rtol=rtol)
    model.zero_grad()  # a second step: nothing recorded during the first one's recomputation lingers
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 5, mode=mode, rtol=rtol)


class CheckpointedGeneric(nn.Module):
    """A parameter no dedicated rule knows (the generic rule), used inside a non-reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return checkpoint(lambda t: torch.sin(t * self.w), x, use_reentrant=False)


class SharedWeight(nn.Module):
    """Its Linear's weight also used outside the Linear: the whole module becomes a generic rule site on the first
    backward, after the forward recorded the Linear under the plan before."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, z):
        return self.out(torch.tanh(F.linear(z, self.lin.weight, self.lin.bias)) + self.lin(z))


class CheckpointedSharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub, self.head = SharedWeight(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(checkpoint(self.sub, x, use_reentrant=False))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_checkpointed_module_that_becomes_a_generic_site_is_exact(mode):
    """Ghost's second pass recomputes the region after the backward committed the new plan: it must save what the
    forward saved (it saved one tensor fewer: CheckpointError)."""
    model = CheckpointedSharedWeight().double()
    x = torch.randn(4, 3, 4, dtype=torch.float64)
    for _ in range(2):
        check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4, mode=mode)
        model.zero_grad()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_pass_of_the_users_own_through_the_region_after_the_plan_changed(mode):
    """The forward after a backward that committed the new plan is recorded under it: a pass of the user's own
    (adversarial inputs from the gradient at the input) recomputes the region as that forward saved it."""
    model = CheckpointedSharedWeight().double()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    for _ in range(3):
        x = torch.randn(4, 3, 4, dtype=torch.float64, requires_grad=True)
        (at_input,) = torch.autograd.grad(per_sample_loss(model(x)).sum(), x)
        engine.backward(per_sample_loss(model((x + 0.01 * at_input.sign()).detach())))
        model.zero_grad()
    engine.detach()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_checkpointing_inside_a_generic_rules_module_is_counted_one_sample_at_a_time(mode):
    """(Refused before: vmap cannot run the checkpoint's saved-tensor hooks.) Plain autograd runs them, a sample at a
    time, warned."""
    model = nn.Sequential(CheckpointedGeneric(), nn.Linear(3, 2)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.warns(flashdp.FlashDPWarning, match="one sample at a time"):
        check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4, mode=mode)


def test_reentrant_checkpointing_is_refused():
    """(Without an input that requires grad, torch's reentrant checkpoint gives the segment no gradient at all,
    private or not, and warns: nothing then reaches its parameters for flashdp to miss.)"""
    model = Checkpointed(reentrant=True)
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        out = model(torch.randn(3, 4, requires_grad=True))
        with pytest.raises(FlashDPError, match=REENTRANT):
            engine.backward(per_sample_loss(out))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return BertForSequenceClassification(config)


def _loss_of(name, model):
    ids = torch.randint(1, VOCAB, (3, 6))
    if name == "bert":
        labels = torch.tensor([0, 2, 1])
        return lambda s: F.cross_entropy(
            model(input_ids=ids[s], position_ids=positions(ids[s])).logits, labels[s], reduction="none"
        )
    return lambda s: lm_loss(model(ids[s], position_ids=positions(ids[s])).logits, ids[s])


MODELS = {"llama": lambda: llama(False), "gpt2": gpt2, "bert": _bert}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}], ids=["default", "non-reentrant"])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_hf_gradient_checkpointing_is_exact(name, kwargs, mode):
    model = MODELS[name]().double().train()  # checkpointing runs in training mode; the configs have no dropout
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    check_against_oracle(model, _loss_of(name, model), 3, mode=mode, rtol=1e-7)


@pytest.mark.slow
@requires_triton
def test_hf_gradient_checkpointing_in_flash_mode_is_exact():
    model = llama(True).train()
    model.gradient_checkpointing_enable()
    check_against_oracle(model, _loss_of("llama", model), 3, mode="flash", rtol=2e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_reentrant_gradient_checkpointing_is_refused(name):
    model = MODELS[name]().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        loss = _loss_of(name, model)(slice(None))
        with pytest.raises(FlashDPError, match=REENTRANT):
            engine.backward(loss)


class CheckpointedBlocks(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_inputs_recorded_inside_a_checkpointed_region_are_recomputed_not_held(mode):
    """Between the forward and the backward, the engine holds no activation that checkpointing dropped: the inner
    layers' inputs are packed like autograd's saved tensors, and recomputed in the norm pass. Exact on the held
    (first) and the streamed (second) backward."""
    model = CheckpointedBlocks().double()
    x = torch.randn(5, 4, 8, dtype=torch.float64)
    inner = [block[2] for block in model.blocks]  # its input, tanh(linear(x)), exists only inside the region
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1e-2, noise_multiplier=1.0, self_check=None)
    seen: list[weakref.ref] = []
    handles = [m.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0]))) for m in inner]
    results = []
    for _ in range(2):
        seen.clear()
        loss = per_sample_loss(model(x))
        gc.collect()
        assert len(seen) == len(inner)
        assert all(ref() is None for ref in seen)
        model.zero_grad()
        norms = engine.backward(loss)
        results.append((norms, {n: p.grad.clone() for n, p in model.named_parameters()}))
    for handle in handles:
        handle.remove()
    (held_norms, held), (streamed_norms, streamed) = results
    assert torch.equal(held_norms, streamed_norms)
    assert all(torch.equal(held[n], streamed[n]) for n in held)
    engine.detach()
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 5, mode=mode)


class RelativeBiasInside(nn.Module):
    """T5's pattern inside a checkpointed block: a relative bias `[1, H, T, T]` looked up from integer buckets in
    the checkpointed function, added to the attention scores."""

    def __init__(self) -> None:
        super().__init__()
        self.rel, self.qkv, self.out = nn.Embedding(5, 2), nn.Linear(4, 12), nn.Linear(4, 3)

    def block(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 2).permute(2, 0, 3, 1, 4)  # [B, H, T, 2]
        positions = torch.arange(t)
        bias = self.rel((positions[None] - positions[:, None]).clamp(-2, 2) + 2).permute(2, 0, 1)[None]
        return self.out((torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v).transpose(1, 2).reshape(b, t, 4))

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_relative_bias_looked_up_inside_a_checkpointed_region_is_exact(mode):
    """(Found by a breaker.) Ghost fingerprints a recomputed call's inputs to check that both passes recomputed
    the same: the bias table's integer buckets crashed it (`vector_norm` of a Long tensor)."""
    model = RelativeBiasInside().double()
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3, mode=mode)


class TableTimesBatchInside(nn.Module):
    """A position table multiplied into the batch inside a checkpointed function."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.lin = nn.Embedding(8, 4), nn.Linear(4, 3)

    def scaled(self, x):
        return torch.tanh(x * self.pos(torch.arange(x.shape[1])))

    def forward(self, x):
        return self.lin(checkpoint(self.scaled, x, use_reentrant=False))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_table_multiplied_into_the_batch_inside_a_checkpointed_region_is_refused(mode):
    """(Found by a breaker.) Each sample's gradient of a shared table meeting the batch through a product is the
    product's backward run once per sample, which unpacks the checkpoint's recomputed tensors again: a raw
    CheckpointError before. Refused with the way out, nothing added to `.grad`."""
    model = TableTimesBatchInside().double()
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(FlashDPError, match=r"inside an activation-checkpointed region.*add it instead"):
        engine.backward(per_sample_loss(model(x)))
    engine.detach()
    assert all(p.grad is None for p in model.parameters())
