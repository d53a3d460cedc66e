"""The LayerNorm / RMSNorm affine-gradient kernel against its reference and float64."""

import pytest

pytest.importorskip("triton")  # these tests run the kernels themselves

from hypothesis import given
from hypothesis import strategies as st

from flashdp.kernels.norm_affine import kernel, reference
from tests.kernels.accuracy import DTYPES, assert_as_accurate_as_torch, factors


@given(
    n=st.integers(0, 3),
    t=st.integers(1, 20),
    d=st.integers(1, 70),
    dtype=DTYPES,
    rms=st.booleans(),
    bias=st.booleans(),
    transposed=st.booleans(),
    splits=st.sampled_from([None, 2, 3, 7]),
)
def test_norm_affine_kernel(n, t, d, dtype, rms, bias, transposed, splits):
    """`splits`: each row's positions summed by that many programs (None: the launcher's choice)."""
    x, g = factors(n, t, d, d, dtype, transposed)
    x = x * 3 + 1  # a mean and a scale the normalisation must remove
    exact = reference.norm_affine_grads(x.double(), g.double(), 1e-5, rms, bias)
    at_dtype = reference.norm_affine_grads(x, g, 1e-5, rms, bias)
    got = kernel.norm_affine_grads(x, g, 1e-5, rms, bias, splits)
    for kernel_out, torch_out, exact_out in zip(got, at_dtype, exact, strict=True):
        if exact_out is None:
            assert kernel_out is None
        else:
            assert_as_accurate_as_torch(kernel_out, torch_out, exact_out)
