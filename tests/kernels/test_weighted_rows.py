"""`weighted_rows`: a clipped sum `sum_b c_b g_b` of kept per-sample gradients. bfloat16 rows on CUDA are read as
they are: the float32 coefficients split exactly into three bfloat16 parts, so no coefficient is rounded to 16 bits
(which could scale a sample's gradient past the clipping bound C)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashdp.per_sample import bfloat16_parts, split_weighted_rows, weighted_rows
from tests.kernels.accuracy import DEVICE

FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(values=st.lists(FLOAT32, min_size=1, max_size=40))
def test_bfloat16_parts_sum_to_the_float32_value_exactly_above_2_to_the_minus_109(values):
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE).double()
    parts = bfloat16_parts(x.float())
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, len(values))
    total = parts.double().sum(0)
    exact = x.abs() >= 2.0**-109
    assert torch.equal(total[exact], x[exact])
    # below: truncated towards zero, by less than bfloat16's smallest subnormal
    assert (total.abs() <= x.abs()).all() and ((x - total).abs() < 2.0**-133).all()
    assert ((total == 0) | (total.sign() == x.sign())).all()


@given(
    batch=st.integers(1, 12),
    width=st.integers(1, 300),
    low=st.integers(-30, 0),
    seed=st.integers(0, 2**16),
)
def test_split_weighted_rows_are_the_float32_sum_of_exact_products(batch, width, low, seed):
    """Coefficients across exponents (min(1, C / norm) spans many): the split sum is as close to the float64 sum
    as the float32 product of float32 copies (coefficients rounded to bfloat16, off by up to 2^-9, fail the bound)."""
    generator = torch.Generator().manual_seed(seed)  # (drawn on the CPU, also where CUDA is the default device)
    rows = torch.randn(batch, width, generator=generator, device="cpu").to(device=DEVICE, dtype=torch.bfloat16)
    exponents = torch.randint(low, 1, (batch,), generator=generator, device="cpu")
    coef = (torch.rand(batch, generator=generator, device="cpu") * 2.0**exponents).to(DEVICE)
    exact = coef.double() @ rows.double()
    scale = coef.double().abs() @ rows.double().abs() + 1e-300
    split = split_weighted_rows(coef, rows)
    wide = coef @ rows.float()
    assert split.dtype == torch.float32
    bound = 4 * batch * 2.0**-24 * scale
    assert ((split.double() - exact).abs() <= bound).all()
    assert ((wide.double() - exact).abs() <= bound).all()


def test_weighted_rows_keeps_float64_and_widens_16_bit_rows_elsewhere():
    rows = torch.randn(5, 7, dtype=torch.float64, device=DEVICE)
    coef = torch.rand(5, dtype=torch.float64, device=DEVICE)
    assert weighted_rows(coef, rows).dtype == torch.float64
    half = rows.to(torch.bfloat16)
    got = weighted_rows(coef.float(), half)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), coef @ half.double(), rtol=1e-6, atol=1e-6)
