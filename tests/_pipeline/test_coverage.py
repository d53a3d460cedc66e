"""Coverage: a trainable parameter that reaches the loss other than through the forward of a layer whose rule
counts it is refused, naming the parameter and the op that used it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.oracle import check_against_oracle
from tests.strategies import per_sample_loss

MISSED = "flashdp would miss part of these parameters' per-sample gradients"


def _backward(model, *inputs, mode="bk", loss=per_sample_loss):
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        return engine.backward(loss(model(*inputs)))


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


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize(
    ("build", "inputs", "param"),
    [
        (FunctionalUse, lambda: (torch.randn(3, 5, 4),), "lin.weight"),
        (TiedMatmulHead, lambda: (torch.randint(0, 11, (3, 5)),), "emb.weight"),
        (CallsForward, lambda: (torch.randn(3, 4),), "inner.weight"),
        (SlicedWeight, lambda: (torch.randn(3, 4),), "dense.weight"),
    ],
    ids=["functional", "tied-matmul-head", "layer.forward", "sliced-weight"],
)
def test_a_use_outside_the_recorded_forward_is_refused(build, inputs, param, mode):
    with pytest.raises(FlashDPError, match=rf"(?s){MISSED}.*'{param}' reaches the loss through \w+"):
        _backward(build(), *inputs(), mode=mode)


def test_multihead_attention_out_proj_trainable_with_in_proj_frozen_is_refused():
    """F.multi_head_attention_forward reads out_proj.weight; out_proj itself is never called."""
    mha = nn.MultiheadAttention(8, 2)
    mha.in_proj_weight.requires_grad_(False)
    mha.in_proj_bias.requires_grad_(False)
    x = torch.randn(5, 3, 8)
    with flashdp.make_private(mha, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        out, _ = mha(x, x, x)
        with pytest.raises(FlashDPError, match=rf"(?s){MISSED}.*'out_proj.weight'.*'out_proj.bias'"):
            engine.backward(out.square().sum((0, 2)))


def test_hf_bloom_slow_but_exact_is_refused():
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(vocab_size=29, hidden_size=8, n_layer=1, n_head=2, pretraining_tp=2, slow_but_exact=True)
    model = BloomForCausalLM(config)
    ids = torch.randint(0, 29, (2, 5))
    with pytest.raises(FlashDPError, match=rf"(?s){MISSED}.*'transformer.h.0.self_attention.dense.weight'"):
        _backward(model, ids, loss=lambda out: out.logits.square().mean((1, 2)))


def test_hf_mamba_functional_uses_are_refused():
    """Mamba's slow path calls F.conv1d with conv1d.weight and multiplies by dt_proj.weight directly."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=29, hidden_size=8, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3)
    model = MambaForCausalLM(config)
    for name, p in model.named_parameters():  # raw parameters (A_log, D) need the generic rule: frozen here
        p.requires_grad_(name.endswith(("conv1d.weight", "dt_proj.weight")))
    ids = torch.randint(0, 29, (2, 5))
    with pytest.raises(FlashDPError, match=rf"(?s){MISSED}.*'backbone.layers.0.mixer.(conv1d|dt_proj).weight'"):
        _backward(model, ids, loss=lambda out: out.logits.square().mean((1, 2)))


def test_deberta_v2_relative_embeddings_read_directly_are_refused():
    from transformers import DebertaV2Config, DebertaV2Model

    config = DebertaV2Config(
        vocab_size=29, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        max_position_embeddings=16, relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = DebertaV2Model(config).eval()
    for name, p in model.named_parameters():
        p.requires_grad_("rel_embeddings" in name)
    ids = torch.randint(0, 29, (2, 5))
    with pytest.raises(FlashDPError, match=rf"(?s){MISSED}.*'encoder.rel_embeddings.weight'"):
        _backward(model, ids, loss=lambda out: out.last_hidden_state.square().mean((1, 2)))


def test_a_layer_whose_forward_uses_another_layers_parameter_names_that_layer():
    from flashdp.rules.linear import linear_grads

    class BorrowsWeight(nn.Linear):
        """A Linear whose forward also reads a sibling's weight: its rule counts only its own parameters."""

        def __init__(self, sibling: nn.Linear):
            super().__init__(4, 4)
            self.sibling = [sibling]  # not a submodule

        def forward(self, x):
            return F.linear(x, self.weight + self.sibling[0].weight, self.bias)

    flashdp.register_rule(BorrowsWeight, linear_grads)
    sibling = nn.Linear(4, 4)
    model = nn.Sequential(sibling, BorrowsWeight(sibling))
    with pytest.raises(
        FlashDPError, match=r"'0.weight' reaches the loss through \w+ inside the forward of '1' \(BorrowsWeight\)"
    ):
        _backward(model, torch.randn(3, 4))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_tied_weights_through_layers_stay_exact(mode):
    """The supported way to tie: two layers sharing one Parameter. Both uses are inside recorded calls."""

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
