"""The clipped-sum kernel against its reference and float64."""

import pytest

pytest.importorskip("triton")  # these tests run the kernels themselves

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashdp.kernels.clipped_sum import kernel, reference
from tests.kernels.accuracy import DEVICE, SHAPES, assert_as_accurate_as_torch, factors


@given(batch=st.integers(0, 3), conv_groups=st.integers(1, 3), **{k: v for k, v in SHAPES.items() if k != "n"})
def test_clipped_sum_kernel(batch, conv_groups, t, p, d, dtype, transposed):
    left, right = factors(batch * conv_groups, t, p, d, dtype, transposed)
    coef = torch.rand(batch, device=DEVICE)
    exact = reference.clipped_sum(left.double(), right.double(), coef.double(), conv_groups)
    got = kernel.clipped_sum(left, right, coef, conv_groups, block=16)
    assert_as_accurate_as_torch(got, reference.clipped_sum(left, right, coef, conv_groups), exact)
