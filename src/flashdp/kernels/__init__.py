"""Triton kernels for the hot paths, each beside the torch reference it must match.

The functions here dispatch: a Triton kernel when the engine's backend asks for one and the inputs suit it
(`runtime.use_triton`), else the torch reference. Triton is imported only when a kernel runs, so flashdp imports
on machines without it.
"""

from __future__ import annotations

from torch import Tensor

from flashdp.kernels.runtime import BACKENDS, Backend, backend, triton_unavailable_reason, use_triton

__all__ = [
    "BACKENDS",
    "Backend",
    "backend",
    "clipped_sum",
    "norm_affine_grads",
    "outer_direct_norm_sq",
    "outer_ghost_norm_sq",
    "triton_unavailable_reason",
    "use_triton",
]


def outer_direct_norm_sq(left: Tensor, right: Tensor) -> Tensor:
    """`[N]` `||L_n^T R_n||^2` with L `[N, T, p]`, R `[N, T, d]`, never materialised by the kernel."""
    from flashdp.kernels import outer_norm

    if use_triton(left, right):
        return outer_norm.outer_direct_norm_sq_triton(left, right)
    return outer_norm.outer_direct_norm_sq_torch(left, right)


def outer_ghost_norm_sq(left: Tensor, right: Tensor) -> Tensor:
    """`[N]` `||L_n^T R_n||^2` from Gram matrices tiled along T."""
    from flashdp.kernels import outer_norm

    if use_triton(left, right):
        return outer_norm.outer_ghost_norm_sq_triton(left, right)
    return outer_norm.outer_ghost_norm_sq_torch(left, right)


def clipped_sum(left: Tensor, right: Tensor, coef: Tensor, groups: int) -> Tensor:
    """`[g, p, d]` `sum_b coef_b L_b^T R_b` per group (coef `[B]`)."""
    from flashdp.kernels import bk_sum

    if use_triton(left, right):
        return bk_sum.clipped_sum_triton(left, right, coef, groups)
    return bk_sum.clipped_sum_torch(left, right, coef, groups)


def norm_affine_grads(x: Tensor, g: Tensor, eps: float, rms: bool, bias: bool) -> tuple[Tensor, Tensor | None]:
    """Per-sample LayerNorm / RMSNorm affine gradients `([N, D], [N, D] or None)` from x, g `[N, T, D]`."""
    from flashdp.kernels import norm_affine

    if use_triton(x, g):
        return norm_affine.norm_affine_grads_triton(x, g, eps, rms, bias)
    return norm_affine.norm_affine_grads_torch(x, g, eps, rms, bias)
