"""Triton kernels for the hot paths, each beside the plain-PyTorch reference it must match.

Each op lives in a folder: `<op>/kernel.py` (the Triton kernel and its launcher) and `<op>/reference.py` (the
reference, same function name, same arguments); the tests hold the two together. The table below is the one
place that chooses between them: the kernel when the engine's backend asks for it and the inputs suit it
(`runtime.use_triton`), else the reference. `kernel.py` modules are imported on first use, so flashdp imports
and trains on machines without Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import Tensor

from flashdp.kernels.clipped_sum import reference as clipped_sum_reference
from flashdp.kernels.norm_affine import reference as norm_affine_reference
from flashdp.kernels.outer_norm import reference as outer_norm_reference
from flashdp.kernels.runtime import BACKENDS, Backend, backend, triton_unavailable_reason, use_triton

__all__ = [
    "BACKENDS",
    "Backend",
    "KernelOp",
    "backend",
    "clipped_sum",
    "norm_affine_grads",
    "outer_direct_norm_sq",
    "outer_ghost_norm_sq",
    "triton_unavailable_reason",
]


class KernelOp:
    """A reference function and the Triton kernel of the same name in the sibling `kernel` module. `auto`: whether
    `kernels="auto"` runs the kernel on CUDA tensors (it does where the kernel was measured faster on a GPU,
    docs/benchmarks.md)."""

    def __init__(self, reference: Callable[..., object], auto: bool = True) -> None:
        self.reference = reference
        self.auto = auto
        self.kernel_module = reference.__module__.rpartition(".")[0] + ".kernel"
        self.__doc__ = reference.__doc__

    def kernel(self) -> Callable[..., object]:
        return getattr(importlib.import_module(self.kernel_module), self.reference.__name__)

    def runs_kernel(self, first: Tensor, second: Tensor) -> bool:
        """Whether the current backend sends these inputs to the kernel."""
        return use_triton(first, second, auto=self.auto)

    def __call__(self, first: Tensor, second: Tensor, *rest: object) -> object:
        """The kernel when the backend sends these inputs to Triton, else the reference."""
        return (self.kernel() if self.runs_kernel(first, second) else self.reference)(first, second, *rest)


#: `[N]` `||L_n^T R_n||^2` (L `[N, T, p]`, R `[N, T, d]`) accumulated over T in registers. Not under "auto": on an
#: H200 the reference (per-sample gradients by a 16-bit bmm with float32 output, then their norms) was 1.2-2.8x
#: faster at every Llama-8B layer shape measured.
outer_direct_norm_sq = KernelOp(outer_norm_reference.direct_norm_sq, auto=False)
#: `[N]` `||L_n^T R_n||^2` from Gram matrices tiled along T.
outer_ghost_norm_sq = KernelOp(outer_norm_reference.ghost_norm_sq)
#: `[g, p, d]` `sum_b c_b L_b^T R_b` per convolution group (c `[B]`), c applied inside the GEMM.
clipped_sum = KernelOp(clipped_sum_reference.clipped_sum)
#: per-sample LayerNorm / RMSNorm affine gradients `([N, D], [N, D] or None)` from x, g `[N, T, D]`.
norm_affine_grads = KernelOp(norm_affine_reference.norm_affine_grads)
