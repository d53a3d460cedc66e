"""Every Triton kernel against its torch reference and against float64, over odd shapes, dtypes and strides.

Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py), on the GPU when there is one. Launchers poison their
outputs with NaN, so an element a kernel fails to write fails these tests.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashdp.kernels import bk_sum, norm_affine, outer_norm

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, t, p, d, dtype, transposed):
    """L [N, T, p], R [N, T, d] at `dtype`; optionally non-contiguous (a transposed view)."""
    shapes = ((p, t), (d, t)) if transposed else ((t, p), (t, d))
    left, right = (torch.randn(n, *s, device=DEVICE).to(dtype) for s in shapes)
    if transposed:
        left, right = left.transpose(1, 2), right.transpose(1, 2)
    return left, right


def _assert_as_accurate_as_torch(got, torch_at_dtype, exact):
    """Error vs float64 at most 2x that of plain PyTorch on the same inputs (plus float32 rounding)."""
    assert got.shape == exact.shape
    assert not torch.isnan(got).any(), "a kernel left an output element unwritten"
    if exact.numel():
        slack = 1e-5 * (1 + exact.abs().max().item())
        torch_error = (torch_at_dtype.double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 2 * torch_error + slack


shapes = {
    "n": st.integers(0, 3),
    "t": st.integers(1, 40),
    "p": st.integers(1, 40),
    "d": st.integers(1, 40),
    "dtype": DTYPES,
    "transposed": st.booleans(),
}


@given(**shapes)
def test_direct_norm_kernel(n, t, p, d, dtype, transposed):
    left, right = _inputs(n, t, p, d, dtype, transposed)
    exact = outer_norm.outer_direct_norm_sq_torch(left.double(), right.double())
    got = outer_norm.outer_direct_norm_sq_triton(left, right, block=16)
    _assert_as_accurate_as_torch(got, outer_norm.outer_direct_norm_sq_torch(left, right), exact)


@given(**shapes)
def test_ghost_norm_kernel_over_several_tiles(n, t, p, d, dtype, transposed):
    left, right = _inputs(n, t, p, d, dtype, transposed)
    exact = outer_norm.outer_direct_norm_sq_torch(left.double(), right.double())
    got = outer_norm.outer_ghost_norm_sq_triton(left, right, tile=16, chunk=16)
    _assert_as_accurate_as_torch(got, outer_norm.outer_ghost_norm_sq_torch(left, right), exact)


@given(batch=st.integers(0, 3), groups=st.integers(1, 3), **{k: v for k, v in shapes.items() if k != "n"})
def test_clipped_sum_kernel(batch, groups, t, p, d, dtype, transposed):
    left, right = _inputs(batch * groups, t, p, d, dtype, transposed)
    coef = torch.rand(batch, device=DEVICE)
    exact = bk_sum.clipped_sum_torch(left.double(), right.double(), coef.double(), groups)
    got = bk_sum.clipped_sum_triton(left, right, coef, groups, block=16)
    _assert_as_accurate_as_torch(got, bk_sum.clipped_sum_torch(left, right, coef, groups), exact)


@given(
    n=st.integers(0, 3),
    t=st.integers(1, 20),
    d=st.integers(1, 70),
    dtype=DTYPES,
    rms=st.booleans(),
    bias=st.booleans(),
    transposed=st.booleans(),
)
def test_norm_affine_kernel(n, t, d, dtype, rms, bias, transposed):
    x, g = _inputs(n, t, d, d, dtype, transposed)
    x = x * 3 + 1  # a mean and a scale the normalisation must remove
    exact = norm_affine.norm_affine_grads_torch(x.double(), g.double(), 1e-5, rms, bias)
    at_dtype = norm_affine.norm_affine_grads_torch(x, g, 1e-5, rms, bias)
    got = norm_affine.norm_affine_grads_triton(x, g, 1e-5, rms, bias)
    for kernel_out, torch_out, exact_out in zip(got, at_dtype, exact, strict=True):
        if exact_out is None:
            assert kernel_out is None
        else:
            _assert_as_accurate_as_torch(kernel_out, torch_out, exact_out)
