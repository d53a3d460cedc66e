"""What the kernel tests share: inputs of any layout and dtype, and the accuracy bar every kernel must meet.

Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py), on the GPU when there is one. Launchers poison their
outputs with NaN, so an element a kernel fails to write fails these tests.
"""

import torch
from hypothesis import strategies as st

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: hypothesis arguments for L `[n, t, p]`, R `[n, t, d]`: odd and ragged sizes, every dtype, either layout
SHAPES = {
    "n": st.integers(0, 3),
    "t": st.integers(1, 40),
    "p": st.integers(1, 40),
    "d": st.integers(1, 40),
    "dtype": DTYPES,
    "transposed": st.booleans(),
}


def factors(n, t, p, d, dtype, transposed):
    """L [N, T, p], R [N, T, d] at `dtype`; optionally non-contiguous (a transposed view)."""
    shapes = ((p, t), (d, t)) if transposed else ((t, p), (t, d))
    left, right = (torch.randn(n, *s, device=DEVICE).to(dtype) for s in shapes)
    if transposed:
        left, right = left.transpose(1, 2), right.transpose(1, 2)
    return left, right


def assert_as_accurate_as_torch(got, torch_at_dtype, exact):
    """Error vs float64 at most 2x that of plain PyTorch on the same inputs (plus float32 rounding)."""
    assert got.shape == exact.shape
    assert not torch.isnan(got).any(), "a kernel left an output element unwritten"
    if exact.numel():
        slack = 1e-5 * (1 + exact.abs().max().item())
        torch_error = (torch_at_dtype.double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 2 * torch_error + slack
