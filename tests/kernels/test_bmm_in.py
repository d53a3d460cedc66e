"""`bmm_in`: a batched product accumulated and returned in float32, whatever the inputs' 16-bit dtype and layout
(on CUDA, 16-bit operands stay on the tensor cores with a float32 output; it must not round to 16 bits)."""

import torch
from hypothesis import given

from flashdp.per_sample import bmm_in
from tests.kernels.accuracy import DEVICE, SHAPES, factors


@given(**SHAPES)
def test_bmm_in_float32_is_the_float32_product_of_the_inputs(n, t, p, d, dtype, transposed):
    left, right = factors(n, t, p, d, dtype, transposed)
    got = bmm_in(left.transpose(1, 2), right, torch.float32)
    exact = torch.bmm(left.double().transpose(1, 2), right.double())
    assert got.dtype == torch.float32 and got.device.type == DEVICE
    # float32 accumulation of exact products: far below a 16-bit rounding of the output (2^-9 relative)
    scale = left.double().abs().transpose(1, 2) @ right.double().abs()
    assert ((got.double() - exact).abs() <= 1e-6 * (scale + 1e-30) * max(t, 1)).all()
