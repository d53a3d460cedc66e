"""`kernels="auto"` on CUDA tensors runs each Triton kernel only where it was measured faster than its PyTorch
reference on a GPU (docs/benchmarks.md): not the direct norm; without triton installed, none. "triton" runs every
kernel, "torch" none, and mixed or float64 inputs always go to the reference."""

from types import SimpleNamespace

import pytest
import torch

from flashdp import kernels
from flashdp.kernels.runtime import triton_importable


def _on_cuda(dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    """What the choice reads of a CUDA tensor (no GPU here)."""
    return SimpleNamespace(dtype=dtype, is_cuda=True)


AUTO_RUNS_KERNEL = {
    "outer_direct_norm_sq": False,  # a 16-bit bmm with float32 output was 1.2-2.8x faster on an H200
    "outer_ghost_norm_sq": True,
    "clipped_sum": True,  # the reference's float32 GEMM has no tensor cores: 4-5x slower
    "norm_affine_grads": True,
}


@pytest.mark.parametrize("op", sorted(AUTO_RUNS_KERNEL))
def test_auto_runs_the_kernels_measured_faster_on_a_gpu(op):
    chosen = getattr(kernels, op)
    with kernels.backend("auto"):
        assert chosen.runs_kernel(_on_cuda(), _on_cuda()) is (AUTO_RUNS_KERNEL[op] and triton_importable())
        assert not chosen.runs_kernel(_on_cuda(torch.float64), _on_cuda(torch.float64))
        assert not chosen.runs_kernel(_on_cuda(torch.float32), _on_cuda(torch.bfloat16))
        cpu = torch.zeros(1, dtype=torch.bfloat16, device="cpu")
        assert not chosen.runs_kernel(cpu, cpu)
    with kernels.backend("triton"):
        assert chosen.runs_kernel(_on_cuda(), _on_cuda())
    with kernels.backend("torch"):
        assert not chosen.runs_kernel(_on_cuda(), _on_cuda())
