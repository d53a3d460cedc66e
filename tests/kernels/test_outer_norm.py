"""The norm kernels against their reference and float64; the reference against materialised gradients."""

import pytest

pytest.importorskip("triton")  # these tests run the kernels themselves

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashdp.kernels.outer_norm import kernel, reference
from flashdp.per_sample import OuterGrad, TokenRows
from tests.kernels.accuracy import SHAPES, assert_as_accurate_as_torch, factors
from tests.oracle import materialised
from tests.strategies import odd


@given(**SHAPES)
def test_direct_norm_kernel(n, t, p, d, dtype, transposed):
    left, right = factors(n, t, p, d, dtype, transposed)
    exact = reference.direct_norm_sq(left.double(), right.double())
    got = kernel.direct_norm_sq(left, right, block=16)
    assert_as_accurate_as_torch(got, reference.direct_norm_sq(left, right), exact)


@given(**SHAPES)
def test_ghost_norm_kernel_over_several_tiles(n, t, p, d, dtype, transposed):
    left, right = factors(n, t, p, d, dtype, transposed)
    exact = reference.direct_norm_sq(left.double(), right.double())
    got = kernel.ghost_norm_sq(left, right, tile=16, chunk=16)
    assert_as_accurate_as_torch(got, reference.ghost_norm_sq(left, right), exact)


@st.composite
def blocks(draw, n: int, p: int, d: int):
    """A block with dense or token-left factors over a [p, d] layout and its own T."""
    t = draw(st.integers(1, 7))
    right = torch.randn(n, t, d, dtype=torch.float64)
    if draw(st.booleans()):
        return OuterGrad(torch.randn(n, t, p, dtype=torch.float64), right)
    return OuterGrad(TokenRows(torch.randint(0, p, (n, t)), p), right)


layouts = {"n": st.integers(0, 4), "p": odd, "d": odd, "tile": st.integers(1, 8)}


@given(data=st.data(), **layouts)
def test_reference_ghost_norm_of_dense_or_token_factors_equalsmaterialised(data, n, p, d, tile):
    block = data.draw(blocks(n, p, d))
    expected = materialised(block).flatten(1).square().sum(1)
    torch.testing.assert_close(reference.ghost_norm_sq(block.left, block.right, tile), expected)


@given(data=st.data(), **layouts)
def test_reference_ghost_inner_equalsmaterialised(data, n, p, d, tile):
    a, b = data.draw(blocks(n, p, d)), data.draw(blocks(n, p, d))
    expected = (materialised(a) * materialised(b)).flatten(1).sum(1)
    torch.testing.assert_close(reference.ghost_inner(a, b, tile), expected)
