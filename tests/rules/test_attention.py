"""nn.MultiheadAttention and the torch Transformer layers built on it: exact against the oracle in both layouts, with
every projection variant, mask and output the layer has; time-major layers with T == B included."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flashdp
from tests.conftest import MODES
from tests.oracle import check_against_oracle, seeded
from tests.strategies import batches, modes, norm_strategies

E, HEADS = 6, 2


class Attention(nn.Module):
    """Batch-first data `[B, L, E]` through an MHA in its own layout; the loss may read the attention weights."""

    def __init__(self, mha: nn.MultiheadAttention, call: dict, weights_in_loss: bool):
        super().__init__()
        self.mha, self.call, self.weights_in_loss = mha, call, weights_in_loss

    def forward(self, query, memory, key_padding_mask):
        layout = (lambda x: x) if self.mha.batch_first else (lambda x: x.transpose(0, 1))
        out, weights = self.mha(
            layout(query), layout(memory), layout(memory * 0.5 + 1), key_padding_mask=key_padding_mask, **self.call
        )
        loss = layout(out).tanh().square().sum((1, 2))
        if self.weights_in_loss:
            loss = loss + (weights * weights.roll(1, -1)).flatten(1).sum(1)
        return loss


@st.composite
def attention_cases(draw):
    batch_first = draw(st.booleans())
    separate = draw(st.booleans())  # kdim / vdim other than E: q, k, v projections are separate parameters
    config = {
        "bias": draw(st.booleans()),
        "add_bias_kv": draw(st.booleans()),
        "add_zero_attn": draw(st.booleans()),
        "kdim": 5 if separate else None,
        "vdim": 5 if separate else None,
        "batch_first": batch_first,
    }
    length = draw(st.integers(1, 4))
    source = draw(st.integers(1, 4))
    masks = draw(st.sampled_from(["none", "padding", "bool", "float", "causal"]))
    if masks == "causal":
        source = length
    need_weights = draw(st.booleans())
    call = {"need_weights": need_weights, "average_attn_weights": draw(st.booleans())}
    return config, call, length, source, masks, need_weights and draw(st.booleans())


def _masks(kind: str, batch: int, length: int, source: int):
    generator = seeded(1)
    padding = None
    call = {}
    if kind == "padding" and source > 1 and batch:  # (torch's forward fails on an empty batch with a padding mask)
        padding = torch.rand(batch, source, generator=generator) < 0.3
        padding[:, 0] = False  # every query sees at least one key
    elif kind == "bool":
        mask = torch.rand(length, source, generator=generator) < 0.3
        mask[:, 0] = False
        call["attn_mask"] = mask
    elif kind == "float":
        call["attn_mask"] = torch.randn(length, source, generator=generator, dtype=torch.float64)
    elif kind == "causal":
        call["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
        call["is_causal"] = True
    return padding, call


@given(batch=batches, case=attention_cases(), mode=modes, strategy=norm_strategies)
def test_multihead_attention_matches_oracle(batch, case, mode, strategy):
    config, call, length, source, masks, weights_in_loss = case
    padding, mask_call = _masks(masks, batch, length, source)
    mha = nn.MultiheadAttention(E, HEADS, **config, dtype=torch.float64)
    model = Attention(mha, call | mask_call, weights_in_loss)
    query = torch.randn(batch, length, E, dtype=torch.float64)
    memory = torch.randn(batch, source, config["kdim"] or E, dtype=torch.float64)

    def loss(s):
        return model(query[s], memory[s], None if padding is None else padding[s])

    check_against_oracle(model, loss, batch, mode=mode, norm_strategy=strategy)


@given(batch=batches, mode=modes)
def test_separate_q_k_v_projections_match_oracle(batch, mode):
    """kdim, vdim other than E: q_proj_weight, k_proj_weight, v_proj_weight."""
    mha = nn.MultiheadAttention(E, HEADS, kdim=5, vdim=3, batch_first=True, dtype=torch.float64)
    query = torch.randn(batch, 3, E, dtype=torch.float64)
    key, value = torch.randn(batch, 4, 5, dtype=torch.float64), torch.randn(batch, 4, 3, dtype=torch.float64)
    check_against_oracle(mha, lambda s: mha(query[s], key[s], value[s])[0].tanh().sum((1, 2)), batch, mode=mode)


class Seq2Seq(nn.Module):
    """An encoder and a decoder layer in one layout; data and loss batch-first."""

    def __init__(self, batch_first: bool, norm_first: bool):
        super().__init__()
        common = {"d_model": E, "nhead": HEADS, "dim_feedforward": 5, "dropout": 0.0, "batch_first": batch_first}
        self.encoder = nn.TransformerEncoderLayer(**common, norm_first=norm_first, activation="gelu")
        self.decoder = nn.TransformerDecoderLayer(**common, norm_first=norm_first)
        self.batch_first = batch_first

    def forward(self, source, target, padding):
        padding = padding if padding.shape[0] else None  # (torch's forward fails on an empty batch with a mask)
        layout = (lambda x: x) if self.batch_first else (lambda x: x.transpose(0, 1))
        causal = nn.Transformer.generate_square_subsequent_mask(target.shape[1], dtype=target.dtype)
        memory = self.encoder(layout(source), src_key_padding_mask=padding)
        out = self.decoder(layout(target), memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=padding)
        return layout(out).tanh().square().sum((1, 2))


@given(
    batch=batches,
    source=st.integers(1, 4),
    target=st.integers(1, 4),
    batch_first=st.booleans(),
    norm_first=st.booleans(),
    mode=modes,
)
def test_transformer_layers_match_oracle(batch, source, target, batch_first, norm_first, mode):
    """Time-major layers included, with T == B too: their Linears and LayerNorms see [T, B, d]."""
    model = Seq2Seq(batch_first, norm_first).double()
    src = torch.randn(batch, source, E, dtype=torch.float64)
    tgt = torch.randn(batch, target, E, dtype=torch.float64)
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[:, 1:] = torch.rand(batch, source - 1) < 0.3
    check_against_oracle(model, lambda s: model(src[s], tgt[s], padding[s]), batch, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_layers_in_every_mode(mode, batch_first):
    model = Seq2Seq(batch_first, norm_first=False).double()
    src, tgt = torch.randn(3, 4, E, dtype=torch.float64), torch.randn(3, 3, E, dtype=torch.float64)
    padding = torch.zeros(3, 4, dtype=torch.bool)
    check_against_oracle(model, lambda s: model(src[s], tgt[s], padding[s]), 3, mode=mode)
    model.zero_grad()
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(model(src, tgt, padding))
        assert "generic" not in engine.strategies.values()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_dropout_in_training_replays_the_forward_masks(mode):
    """The oracle that runs samples one by one would draw other dropout masks: compare with autograd's per-sample
    gradients of the same forward instead."""
    model = Seq2Seq(batch_first=True, norm_first=False).double().train()
    for layer in model.modules():
        if isinstance(layer, nn.MultiheadAttention):
            layer.dropout = 0.5
    src, tgt = torch.randn(4, 5, E, dtype=torch.float64), torch.randn(4, 3, E, dtype=torch.float64)
    padding = torch.zeros(4, 5, dtype=torch.bool)
    params = [p for p in model.parameters() if p.requires_grad]
    c = 1e-2
    with flashdp.make_private(model, mode=mode, max_grad_norm=c, noise_multiplier=1.0) as engine:
        loss = model(src, tgt, padding)
        per_sample = [torch.autograd.grad(loss[i], params, retain_graph=True) for i in range(4)]
        norms = engine.backward(loss)
        assert "generic" not in engine.strategies.values()
    expected_norms = torch.stack([torch.cat([g.flatten() for g in grads]).norm() for grads in per_sample])
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-6, atol=0)
    coefficients = (c / (expected_norms + 1e-6)).clamp(max=1)
    for k, p in enumerate(params):
        expected = sum(coefficients[i] * per_sample[i][k] for i in range(4))
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12)
