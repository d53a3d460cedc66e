"""Triton kernel for the book-keeping clipped sum `sum_b c_b L_b^T R_b` per convolution group, with c applied
inside the GEMM; matches `reference.clipped_sum`.

L `[B * g, T, p]`, R `[B * g, T, d]` (rows `b * g + j` belong to sample b, group j); out `[g, p, d]` in float32.
Each sample's product accumulates in float32 registers and is scaled by its coefficient there: no scaled copy of L
is written, and none is rounded to 16 bits (that rounding let a clipped contribution exceed C by up to 2^-8, relative,
on an H200; the interpreter, which upcasts tiles, cannot show it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdp.kernels.outer_norm.kernel import direct_tiles
from flashdp.kernels.tiles import Launcher, load_tile, output_tile, upcast_tiles


@triton.jit
def _clipped_sum_kernel(
    L, R, C, out, B, G, T, P, D,
    sln, slt, slp, srn, srt, srd,
    BT: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    rp, rd = output_tile(BP, BD)
    acc = tl.zeros((BP, BD), dtype=tl.float32)
    for b in range(0, B):
        row = b * G + group
        sample = tl.zeros((BP, BD), dtype=tl.float32)
        for t0 in range(0, T, BT):
            rt = t0 + tl.arange(0, BT)
            left = load_tile(L, row, sln, slt, slp, rt, rp, T, P, UPCAST)
            right = load_tile(R, row, srn, srt, srd, rt, rd, T, D, UPCAST)
            sample = tl.dot(tl.trans(left), right, sample, input_precision="ieee")
        acc += tl.load(C + b) * sample  # c scales the float32 product: a 16-bit scaled copy would round it
    mask = (rp[:, None] < P) & (rd[None, :] < D)
    tl.store(out + (group * P + rp[:, None]) * D + rd[None, :], acc, mask=mask)


_CLIPPED_SUM = Launcher(_clipped_sum_kernel, "clipped_sum", key=["P", "D"])


def clipped_sum(left: Tensor, right: Tensor, coef: Tensor, conv_groups: int = 1, block: int | None = None) -> Tensor:
    """`[g, p, d]` float32. coef: `[B]` per-sample coefficients. block: the tile limit (default: the launch
    configuration's)."""
    rows, t, p = left.shape
    d = right.shape[2]
    config = _CLIPPED_SUM.config(left.dtype)
    tiles = direct_tiles(t, p, d, block or config.tile, block or config.t_tile)
    out = torch.full((conv_groups, p, d), float("nan"), device=left.device, dtype=torch.float32)
    coef = coef.to(device=left.device, dtype=torch.float32).contiguous()
    grid = (conv_groups, triton.cdiv(p, tiles["BP"]), triton.cdiv(d, tiles["BD"]))
    _CLIPPED_SUM(
        grid, left.dtype, left, right, coef, out, rows // conv_groups, conv_groups, t, p, d,
        *left.stride(), *right.stride(), **tiles, UPCAST=upcast_tiles(),
    )  # fmt: skip
    return out
