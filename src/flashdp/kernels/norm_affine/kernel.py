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
    X, G, W, Bias, T, D, eps, PER,
    sxn, sxt, sxd, sgn, sgt, sgd,
    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Program (n, s) sums positions [s * PER, (s + 1) * PER) of row n into W[n, s] (and Bias[n, s]) `[N, S, D]`."""
    n, s = tl.program_id(0), tl.program_id(1)
    rd = tl.arange(0, BD)
    dmask = rd < D
    w_acc = tl.zeros((BD,), dtype=tl.float32)
    b_acc = tl.zeros((BD,), dtype=tl.float32)
    end = tl.minimum(T, (s + 1) * PER)
    for t0 in range(s * PER, end, BT):
        rt = t0 + tl.arange(0, BT)
        mask = (rt[:, None] < end) & dmask[None, :]
        x = load_tile(X, n, sxn, sxt, sxd, rt, rd, end, D, True)
        g = load_tile(G, n, sgn, sgt, sgd, rt, rd, end, D, True)
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
    out = (n * tl.num_programs(1) + s) * D + rd
    tl.store(W + out, w_acc, mask=dmask)
    if HAS_BIAS:
        tl.store(Bias + out, b_acc, mask=dmask)


_NORM_AFFINE = Launcher(_norm_affine_kernel, "norm_affine", key=["D"])


def norm_affine_tiles(t: int, d: int, elements: int) -> dict[str, int]:
    """A whole row of D features, and as many positions as fit in a tile of `elements`."""
    bd = triton.next_power_of_2(max(d, 1))
    return {"BT": max(1, min(triton.next_power_of_2(max(t, 1)), elements // bd)), "BD": bd}


def position_splits(n: int, t: int, bt: int, device: torch.device) -> int:
    """Programs per row: on CUDA enough that N rows fill the GPU about four programs per multiprocessor (one
    program per row left most of an H100 idle: 16 rows of 1024 x 2048 took 0.54 ms, 13x their bytes' time), never
    fewer than BT positions each; one under the interpreter."""
    if device.type != "cuda":
        return 1
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-programs // max(n, 1)), -(-t // bt)))


def norm_affine_grads(
    x: Tensor, g: Tensor, eps: float, rms: bool, bias: bool, splits: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """(weight `[N, D]`, bias `[N, D]` or None), float32: each row's positions summed in `splits` parts (default
    `position_splits`), whose partial sums are then added in a fixed order (the same result on every run)."""
    n, t, d = x.shape
    tiles = norm_affine_tiles(t, d, _NORM_AFFINE.config(x.dtype).tile)
    splits = splits or position_splits(n, t, tiles["BT"], x.device)
    per = -(-t // (splits * tiles["BT"])) * tiles["BT"]  # positions per program, whole tiles
    splits = -(-t // per)
    weight = torch.full((n, splits, d), float("nan"), device=x.device, dtype=torch.float32)
    bias_out = torch.full((n, splits, d), float("nan"), device=x.device, dtype=torch.float32) if bias else weight
    if n:
        _NORM_AFFINE(
            (n, splits), x.dtype, x, g, weight, bias_out, t, d, float(eps), per, *x.stride(), *g.stride(),
            RMS=rms, HAS_BIAS=bias, **tiles,
        )  # fmt: skip
    return weight.sum(1), (bias_out.sum(1) if bias else None)
