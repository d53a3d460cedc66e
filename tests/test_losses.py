import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flashdp
from flashdp import FlashDPError


def _reference(logits, labels, valid, reduction):
    """One sequence at a time, one token at a time."""
    out = []
    for b in range(logits.shape[0]):
        terms = [
            -torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]]
            for t in range(logits.shape[1] - 1)
            if valid[b, t + 1]
        ]
        total = torch.stack(terms).sum() if terms else torch.zeros((), dtype=logits.dtype)
        out.append(total / max(len(terms), 1) if reduction == "mean" else total)
    return torch.stack(out) if out else torch.zeros(0, dtype=logits.dtype)


@given(
    batch=st.integers(0, 4),
    t=st.integers(1, 6),
    reduction=st.sampled_from(["mean", "sum"]),
    use_mask=st.booleans(),
)
def test_per_sample_lm_loss_counts_only_valid_tokens(batch, t, reduction, use_mask):
    logits = torch.randn(batch, t, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (batch, t))
    labels[torch.rand(batch, t) < 0.3] = -100
    mask = (torch.rand(batch, t) < 0.7).long() if use_mask else None
    valid = (labels != -100) & (mask.bool() if use_mask else True)
    got = flashdp.per_sample_lm_loss(logits, labels, attention_mask=mask, reduction=reduction)
    assert got.shape == (batch,)
    assert got.dtype == torch.float64  # (it was computed in float32: a float64 model's norms 1e-7 off)
    torch.testing.assert_close(got, _reference(logits, labels, valid, reduction), rtol=1e-12, atol=1e-12)


def test_per_sample_lm_loss_of_16_bit_logits_is_taken_in_float32():
    logits = torch.randn(3, 4, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (3, 4))
    got = flashdp.per_sample_lm_loss(logits.bfloat16(), labels)
    assert got.dtype == torch.float32
    expected = _reference(logits.bfloat16().double(), labels, torch.ones(3, 4, dtype=torch.bool), "mean")
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


def test_custom_ignore_index_and_no_shift():
    logits = torch.randn(1, 3, 4)
    labels = torch.tensor([[1, 0, 2]])
    got = flashdp.per_sample_lm_loss(logits, labels, ignore_index=0, shift=False)
    expected = torch.nn.functional.cross_entropy(logits[0, [0, 2]], labels[0, [0, 2]])
    torch.testing.assert_close(got, expected[None])


def test_bad_shapes_and_reduction():
    with pytest.raises(FlashDPError, match=r"expected logits \[B, T, V\] and labels \[B, T\]"):
        flashdp.per_sample_lm_loss(torch.randn(2, 3), torch.zeros(2, 3).long())
    with pytest.raises(FlashDPError, match="reduction must be"):
        flashdp.per_sample_lm_loss(torch.randn(2, 3, 4), torch.zeros(2, 3).long(), reduction="none")
