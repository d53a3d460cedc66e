"""`sum_of_squares`, the per-sample squared norm of every materialised per-sample gradient, against float64."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdp.kernels.outer_norm.reference import sum_of_squares
from tests.oracle import seeded


@settings(max_examples=8, deadline=None)
@given(length=st.sampled_from([1, 4095, 4096, 4097, 12_288, 2_000_003]), scale=st.sampled_from([1.0, 1e-15, 1e15]))
def test_sum_of_squares_of_long_float32_rows_is_within_float32_rounding(length, scale):
    """A clipped sample contributes C only if its norm is not underestimated: on CPU torch's float32 vector_norm
    over a 2M-entry row drifted 1e-5 to 1e-3 low (a 512 x 512 x 3 x 3 convolution's per-sample gradient)."""
    x = torch.randn(3, length, generator=seeded(length)) * scale
    exact = x.double().square().sum(1)
    got = sum_of_squares(x)
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= 4e-7 * exact).all(), ((got.double() - exact) / exact).tolist()
