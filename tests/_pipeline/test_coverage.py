"""Coverage: a trainable parameter that reaches the loss other than through the forward of a layer whose rule
counts it is counted exactly by the generic rule at the smallest module whose forward encloses every use; what
no module encloses is refused, naming the parameter and the op that used it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.oracle import check_against_oracle, per_sample_grads
from tests.strategies import per_sample_loss

MISSED = "flashdp would miss part of these parameters' per-sample gradients"


class FunctionalUse(nn.Module):
    """1e-3 * lin(x) + x @ lin.weight.T: the second use of lin.weight is invisible to lin's hooks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return 1e-3 * self.lin(x) + x @ self.lin.weight.T


class TiedMatmulHead(nn.Module):
    """A tied output head written as h @ emb.weight.T instead of a Linear sharing the weight."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(11, 6), nn.Linear(6, 6)

    def forward(self, ids):
        return self.mix(self.emb(ids)) @ self.emb.weight.T


class CallsForward(nn.Module):
    """layer.forward(x) skips the layer's hooks."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.inner.forward(x).tanh())


class SlicedWeight(nn.Module):
    """BLOOM's slow_but_exact: F.linear on slices of a child's weight, the child never called."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 3)

    def forward(self, x):
        w = self.dense.weight
        return F.linear(x[..., :2], w[:, :2]) + F.linear(x[..., 2:], w[:, 2:]) + self.dense.bias


class BorrowsWeight(nn.Linear):
    """A Linear whose forward also reads a sibling's weight."""

    def __init__(self, sibling: nn.Linear):
        super().__init__(4, 4)
        self.sibling = [sibling]  # not a submodule

    def forward(self, x):
        return F.linear(x, self.weight + self.sibling[0].weight, self.bias)


class HoldsChildsBias(nn.Module):
    """BERT's LM head: the decoder's bias is also the head's own parameter (used, or not, by the head itself)."""

    def __init__(self, uses_it_too: bool):
        super().__init__()
        self.uses_it_too = uses_it_too
        self.decoder = nn.Linear(4, 3)
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(x) + self.bias if self.uses_it_too else self.decoder(x)


def _borrows():
    sibling = nn.Linear(4, 4)
    return nn.Sequential(sibling, nn.Tanh(), BorrowsWeight(sibling))


CASES = {
    "functional": (FunctionalUse, lambda: torch.randn(3, 5, 4), "lin.weight"),
    "tied-matmul-head": (TiedMatmulHead, lambda: torch.randint(0, 11, (3, 5)), "emb.weight"),
    "layer.forward": (CallsForward, lambda: torch.randn(3, 4), "inner.weight"),
    "sliced-weight": (SlicedWeight, lambda: torch.randn(3, 4), "dense.weight"),
    "borrowed-weight": (_borrows, lambda: torch.randn(3, 4), "0.weight"),
    "child's-bias-used-by-the-parent-too": (lambda: HoldsChildsBias(True), lambda: torch.randn(3, 4), "bias"),
}


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_parameter_also_held_by_a_child_is_counted_once_by_the_child(mode):
    model = HoldsChildsBias(uses_it_too=False).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3, mode=mode)
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        model.zero_grad()
        engine.backward(per_sample_loss(model(x)))
        assert set(engine.strategies) == {"decoder.weight", "decoder.bias"}  # on the Linear's rule
        assert "generic" not in engine.strategies.values()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_use_outside_the_owning_layer_is_counted_exactly(case, mode):
    build, data, param = CASES[case]
    model = build().double()
    x = data()
    x = x.double() if x.is_floating_point() else x
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3, mode=mode)
    model.zero_grad()
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(per_sample_loss(model(x)))
        assert engine.strategies[param] == "generic"


def test_the_sensitivity_bound_holds_where_the_old_engine_reached_287_c():
    """1e-3 * lin(x) + x @ lin.weight.T once let one sample's clipped contribution reach 287 C."""
    model = FunctionalUse()
    x = torch.randn(6, 5, 4) * torch.logspace(-1, 2, 6)[:, None, None]
    c = 0.1
    with flashdp.make_private(model, max_grad_norm=c, noise_multiplier=1.0) as engine:
        total = _clipped_sum(model, engine, x)
        for i in range(len(x)):
            without_i = _clipped_sum(model, engine, torch.cat([x[:i], x[i + 1 :]]))
            assert (total - without_i).norm() <= c * (1 + 1e-4)


def _clipped_sum(model, engine, x):
    model.zero_grad()
    engine.backward(per_sample_loss(model(x)))
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_multihead_attention_out_proj_trainable_with_in_proj_frozen_is_exact():
    """F.multi_head_attention_forward reads out_proj.weight; out_proj itself is never called."""
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    mha.in_proj_weight.requires_grad_(False)
    mha.in_proj_bias.requires_grad_(False)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    check_against_oracle(mha, lambda s: mha(x[s], x[s], x[s])[0].square().sum((1, 2)), 3)


def test_hf_mamba_functional_uses_are_exact():
    """Mamba's slow path calls F.conv1d with conv1d.weight and multiplies by dt_proj.weight directly; A_log and D
    are raw parameters of the mixer."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=29, hidden_size=8, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3)
    model = MambaForCausalLM(config).double()
    ids = torch.randint(0, 29, (3, 5))
    check_against_oracle(model, lambda s: model(ids[s]).logits.square().mean((1, 2)), 3, rtol=1e-7)


def test_deberta_v2_relative_embeddings_read_directly_are_exact():
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=29, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        max_position_embeddings=16, relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = DebertaV2Model(config).double().eval()
    for name, p in model.named_parameters():
        p.requires_grad_("rel_embeddings" in name)
    ids = torch.randint(0, 29, (3, 5))
    target = torch.randn(8, dtype=torch.float64)  # the final LayerNorm makes a squared-mean loss constant
    check_against_oracle(model, lambda s: (model(ids[s]).last_hidden_state @ target).sin().sum(1), 3, rtol=1e-7)


def test_hf_bloom_slow_but_exact_is_refused_clearly():
    """BLOOM folds the batch into its alibi tensor ([batch * heads, 1, T]): no module enclosing the sliced uses
    of `dense.weight` takes the batch as dim 0 of every input, so the generic rule cannot run it per sample."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=29, hidden_size=8, n_layer=1, n_head=2, pretraining_tp=2, slow_but_exact=True)
    model = BloomForCausalLM(config)
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        out = model(torch.randint(0, 29, (2, 5)))
        with pytest.raises(FlashDPError, match=r"generic rule cannot compute per-sample gradients for "):
            engine.backward(out.logits.square().mean((1, 2)))


def test_a_parameter_used_outside_the_model_is_refused():
    """A regulariser computed from a weight outside the model's forward: no module's call encloses that use."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        loss = per_sample_loss(model(torch.randn(3, 4))) + model[0].weight.square().sum()
        with pytest.raises(FlashDPError, match=rf"(?s){MISSED}.*'0.weight' reaches the loss through \w+ outside"):
            engine.backward(loss)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_tied_weights_through_layers_stay_on_their_fast_rules(mode):
    """The supported way to tie: two layers sharing one Parameter. Both uses are inside their own calls."""

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(11, 6), nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    model = TiedLM().double()
    ids = torch.randint(0, 11, (4, 5))
    check_against_oracle(model, lambda s: per_sample_loss(model(ids[s])), 4, mode=mode)
    model.zero_grad()
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(per_sample_loss(model(ids)))
        assert engine.strategies["emb.weight"] != "generic"


class ReturnsItsHidden(nn.Module):
    """A layer without a rule returning (output, hidden), the output computed from the hidden (HF attention
    returning its weights): autograd's gradient at the hidden also counts the path through the output."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        hidden = (x @ self.w1).tanh()
        return hidden @ self.w2, hidden


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("hidden_in_loss", [False, True])
def test_an_output_computed_from_another_output_is_counted_once(hidden_in_loss, mode):
    model = ReturnsItsHidden().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)

    def loss(s):
        out, hidden = model(x[s])
        return per_sample_loss(out) + (per_sample_loss(hidden) if hidden_in_loss else 0)

    check_against_oracle(model, loss, 3, mode=mode)


class SometimesOutside(nn.Module):
    """lin.weight also used outside lin on some steps only, with the same layers called in the same order."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.outside = False

    def forward(self, x):
        y = self.lin(x)
        return y + x @ self.lin.weight.T if self.outside else y


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_use_outside_the_layer_from_a_later_step_on_is_counted_on_a_self_checked_step(mode):
    """A use that appears on a later step with the same structure is counted (the coverage walk runs on every
    backward; tests/_pipeline/test_coverage_every_backward.py checks it without the self-check)."""
    model = SometimesOutside().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    loss_of = lambda s: per_sample_loss(model(x[s]))  # noqa: E731
    with flashdp.make_private(model, mode=mode, max_grad_norm=1e6, noise_multiplier=1.0, self_check=1) as engine:
        engine.backward(loss_of(slice(None)))
        model.zero_grad()
        model.outside = True
        norms = engine.backward(loss_of(slice(None)))
        assert engine.strategies["lin.weight"] == "generic"
        counted = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = per_sample_grads(model, loss_of, 3)
    flat = torch.cat([g.flatten(1) for g in expected.values()], dim=1)
    torch.testing.assert_close(norms.double(), flat.norm(dim=1), rtol=1e-6, atol=0)
    for name, g in expected.items():  # C far above every norm: the clipped sum is the plain sum
        torch.testing.assert_close(counted[name], g.sum(0), rtol=1e-9, atol=1e-12)
