"""The outer-product math against per-sample gradients materialised explicitly."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashdp import outer
from flashdp.param_grad import ParamGradient
from flashdp.rules.grads import OuterGrad, TokenRows
from tests.strategies import odd


def _dense(block: OuterGrad) -> torch.Tensor:
    """[N, p, d] explicitly, one-hot rows built for token blocks."""
    left = block.left
    if isinstance(left, TokenRows):
        left = torch.nn.functional.one_hot(left.ids, left.num_rows).double()
    return torch.einsum("ntp,ntd->npd", left.double(), block.right.double())


@st.composite
def blocks(draw):
    """1-3 blocks of one [p, d] layout, dense or token-left, with their own T."""
    n, p, d = draw(st.integers(0, 4)), draw(odd), draw(odd)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        t = draw(st.integers(1, 7))
        if draw(st.booleans()):
            out.append(OuterGrad(torch.randn(n, t, p, dtype=torch.float64), torch.randn(n, t, d, dtype=torch.float64)))
        else:
            ids = torch.randint(0, p, (n, t))
            out.append(OuterGrad(TokenRows(ids, p), torch.randn(n, t, d, dtype=torch.float64)))
    return out


@given(bs=blocks(), tile=st.integers(1, 8))
def test_ghost_norm_of_any_blocks_equals_materialised(bs, tile):
    expected = sum(_dense(b) for b in bs).flatten(1).square().sum(1)
    torch.testing.assert_close(outer.ghost_norm_sq(bs, torch.float64, tile), expected)


@given(bs=blocks(), tile=st.integers(1, 8))
def test_ghost_inner_equals_materialised(bs, tile):
    a, b = bs[: len(bs) // 2 + 1], bs[len(bs) // 2 :]
    expected = (sum(_dense(x) for x in a) * sum(_dense(x) for x in b)).flatten(1).sum(1)
    torch.testing.assert_close(outer.ghost_inner(a, b, torch.float64, tile), expected)


@given(bs=blocks(), strategy=st.sampled_from(["auto", "ghost", "direct"]), data=st.data())
def test_param_gradient_norm_and_clipped_sum_equal_materialised(bs, strategy, data):
    n = bs[0].right.shape[0]
    p, d = bs[0].block_shape
    coef = torch.rand(n, dtype=torch.float64)
    dense = sum(_dense(b) for b in bs)
    slot = ParamGradient("w", (p, d), n, strategy)
    for b in data.draw(st.permutations(bs)):
        slot.add(b, "test")
    torch.testing.assert_close(slot.norm_sq(), dense.flatten(1).square().sum(1))
    torch.testing.assert_close(slot.clipped_sum(coef), torch.einsum("n,npd->pd", coef, dense))


@given(batch=st.integers(0, 3), groups=st.integers(1, 3), t=st.integers(1, 5), p=odd, d=odd)
def test_grouped_blocks_stack_per_sample(batch, groups, t, p, d):
    """groups > 1: sample b owns rows b*g .. b*g+g-1, stacked into a [g*p, d] gradient."""
    block = OuterGrad(
        torch.randn(batch * groups, t, p, dtype=torch.float64),
        torch.randn(batch * groups, t, d, dtype=torch.float64),
        groups=groups,
    )
    per_sample = _dense(block).view(batch, groups * p, d)
    coef = torch.rand(batch, dtype=torch.float64)
    for strategy in ("ghost", "direct"):
        slot = ParamGradient("w", (groups * p, d), batch, strategy)
        slot.add(block, "test")
        torch.testing.assert_close(slot.norm_sq(), per_sample.flatten(1).square().sum(1))
        torch.testing.assert_close(slot.clipped_sum(coef), torch.einsum("b,bpd->pd", coef, per_sample))


def test_token_norm_never_builds_a_vocabulary_sized_tensor():
    """Segment sums: memory O(N T d), not O(N V d), even for a huge table."""
    ids = torch.tensor([[3, 999_999_999, 3]])
    right = torch.tensor([[[1.0, 2.0], [5.0, 0.0], [1.0, 0.0]]])
    block = OuterGrad(TokenRows(ids, 1_000_000_000), right)
    # row 3 gets [1, 2] + [1, 0] = [2, 2]; the other row [5, 0]
    assert outer.token_norm_sq(block, torch.float32).tolist() == [8.0 + 25.0]


def test_cost_model_picks_ghost_for_short_sequences_and_direct_for_long():
    assert outer.norm_strategy(t=16, p=4096, d=4096) == "ghost"
    assert outer.norm_strategy(t=8192, p=4096, d=4096) == "direct"
    # the boundary t (p + d) = p d goes to direct (its per-sample gradient is then no larger than A and G)
    assert outer.norm_strategy(t=2, p=4, d=4) == "direct"


def test_half_precision_factors_accumulate_in_float32():
    left = torch.randn(2, 300, 5).bfloat16()
    right = torch.randn(2, 300, 3).bfloat16()
    block = OuterGrad(left, right)
    exact = _dense(block).flatten(1).square().sum(1)
    for strategy in ("ghost", "direct"):
        slot = ParamGradient("w", (5, 3), 2, strategy)
        slot.add(block, "test")
        got = slot.norm_sq()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
