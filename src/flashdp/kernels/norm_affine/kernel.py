"""Triton kernel for the per-sample gradients of a LayerNorm / RMSNorm's affine parameters, in one pass over x
and g; matches `reference.norm_affine_grads`.

x, g `[N, T, D]` (normalised over the last dim D): `dw_n = sum_t x_hat_t * g_t`, `db_n = sum_t g_t`, with
x_hat = (x - mean) / sqrt(var + eps) (LayerNorm) or x / sqrt(mean(x^2) + eps) (RMS). Statistics in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdp.kernels.tiles import Launcher, load_tile


@triton.jit
def _norm_affine_kernel(
    X, G, W, Bias, T, D, eps,
    sxn, sxt, sxd, sgn, sgt, sgd,
    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    rd = tl.arange(0, BD)
    dmask = rd < D
    w_acc = tl.zeros((BD,), dtype=tl.float32)
    b_acc = tl.zeros((BD,), dtype=tl.float32)
    for t0 in range(0, T, BT):
        rt = t0 + tl.arange(0, BT)
        mask = (rt[:, None] < T) & dmask[None, :]
        x = load_tile(X, n, sxn, sxt, sxd, rt, rd, T, D, True)
        g = load_tile(G, n, sgn, sgt, sgd, rt, rd, T, D, True)
        if RMS:
            centred = x
        else:
            mean = tl.sum(x, axis=1) / D
            centred = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(centred * centred, axis=1) / D
        x_hat = centred * tl.rsqrt(var + eps)[:, None]
        w_acc += tl.sum(x_hat * g, axis=0)
        if HAS_BIAS:
            b_acc += tl.sum(g, axis=0)
    tl.store(W + n * D + rd, w_acc, mask=dmask)
    if HAS_BIAS:
        tl.store(Bias + n * D + rd, b_acc, mask=dmask)


_NORM_AFFINE = Launcher(_norm_affine_kernel, "norm_affine", key=["D"])


def norm_affine_tiles(t: int, d: int, elements: int) -> dict[str, int]:
    """A whole row of D features, and as many positions as fit in a tile of `elements`."""
    bd = triton.next_power_of_2(max(d, 1))
    return {"BT": max(1, min(triton.next_power_of_2(max(t, 1)), elements // bd)), "BD": bd}


def norm_affine_grads(x: Tensor, g: Tensor, eps: float, rms: bool, bias: bool) -> tuple[Tensor, Tensor | None]:
    """(weight `[N, D]`, bias `[N, D]` or None), float32."""
    n, t, d = x.shape
    tiles = norm_affine_tiles(t, d, _NORM_AFFINE.config(x.dtype).tile)
    weight = torch.full((n, d), float("nan"), device=x.device, dtype=torch.float32)
    bias_out = torch.full((n, d), float("nan"), device=x.device, dtype=torch.float32) if bias else weight
    if n:
        _NORM_AFFINE(
            (n,), x.dtype, x, g, weight, bias_out, t, d, float(eps), *x.stride(), *g.stride(),
            RMS=rms, HAS_BIAS=bias, **tiles,
        )  # fmt: skip
    return weight, (bias_out if bias else None)
