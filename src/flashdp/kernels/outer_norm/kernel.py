"""Triton kernels for per-sample squared norms of `g_n = L_n^T R_n` (L `[N, T, p]`, R `[N, T, d]`), never
materialising g_n; each matches the function of the same name in `reference.py`.

- `direct_norm_sq`: tiles of `L^T R` accumulated over T in registers (float32), squared, reduced.
- `ghost_norm_sq`: `sum_{j <= k} w_jk <L_j L_k^T, R_j R_k^T>` over pairs of T tiles (w = 2 off the diagonal);
  no T x T matrix beyond one tile pair.
Both write per-program partials that torch sums in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdp.kernels.tiles import Launcher, load_tile, output_tile, tile_size, upcast_tiles


@triton.jit
def _direct_norm_kernel(
    L, R, partial, T, P, D,
    sln, slt, slp, srn, srt, srd,
    BT: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    rp, rd = output_tile(BP, BD)
    acc = tl.zeros((BP, BD), dtype=tl.float32)
    for t0 in range(0, T, BT):
        rt = t0 + tl.arange(0, BT)
        left = load_tile(L, n, sln, slt, slp, rt, rp, T, P, UPCAST)
        right = load_tile(R, n, srn, srt, srd, rt, rd, T, D, UPCAST)
        acc += tl.dot(tl.trans(left), right, input_precision="ieee")
    total = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
    tl.store(partial + (n * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2), total)


_DIRECT = Launcher(_direct_norm_kernel, "direct_norm", key=["P", "D"])


def direct_tiles(t: int, p: int, d: int, tile: int, t_tile: int | None = None) -> dict[str, int]:
    """The direct norm kernel's tiles for `[N, T, p]` and `[N, T, d]` factors (`t_tile`: the limit along T, default
    `tile`)."""
    return {"BT": tile_size(t, t_tile or tile), "BP": tile_size(p, tile), "BD": tile_size(d, tile)}


def direct_norm_sq(left: Tensor, right: Tensor, block: int | None = None) -> Tensor:
    """`[N]` float32 `||L_n^T R_n||_F^2`. left `[N, T, p]`, right `[N, T, d]` (any strides). block: the tile limit
    (default: the launch configuration's)."""
    n, t, p = left.shape
    d = right.shape[2]
    tiles = direct_tiles(t, p, d, block or _DIRECT.config(left.dtype).tile)
    grid = (n, triton.cdiv(p, tiles["BP"]), triton.cdiv(d, tiles["BD"]))
    partial = torch.full(grid, float("nan"), device=left.device, dtype=torch.float32)
    if n:
        _DIRECT(
            grid, left.dtype, left, right, partial, t, p, d, *left.stride(), *right.stride(),
            **tiles, UPCAST=upcast_tiles(),
        )  # fmt: skip
    return partial.sum((1, 2))


@triton.jit
def _gram_tile(X, n, sxn, sxt, sxk, rj, rk, T, K, BT: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    """`[BT, BT]` Gram matrix `X_j X_k^T` of two T tiles of one row, accumulated over K in chunks of BK."""
    gram = tl.zeros((BT, BT), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rc = k0 + tl.arange(0, BK)
        xj = load_tile(X, n, sxn, sxt, sxk, rj, rc, T, K, UPCAST)
        xk = load_tile(X, n, sxn, sxt, sxk, rk, rc, T, K, UPCAST)
        gram += tl.dot(xj, tl.trans(xk), input_precision="ieee")
    return gram


@triton.jit
def _ghost_norm_kernel(
    L, R, pairs, partial, T, P, D,
    sln, slt, slp, srn, srt, srd,
    BT: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    pair = tl.program_id(1)
    j = tl.load(pairs + 2 * pair)
    k = tl.load(pairs + 2 * pair + 1)
    rj = j * BT + tl.arange(0, BT)
    rk = k * BT + tl.arange(0, BT)
    gram_left = _gram_tile(L, n, sln, slt, slp, rj, rk, T, P, BT, BK, UPCAST)
    gram_right = _gram_tile(R, n, srn, srt, srd, rj, rk, T, D, BT, BK, UPCAST)
    weight = tl.where(j == k, 1.0, 2.0)
    total = tl.sum(tl.sum(gram_left * gram_right, axis=1), axis=0) * weight
    tl.store(partial + n * tl.num_programs(1) + pair, total)


_GHOST = Launcher(_ghost_norm_kernel, "ghost_norm", key=["P", "D"])


def ghost_tiles(t: int, p: int, d: int, tile: int, chunk: int) -> dict[str, int]:
    """The ghost norm kernel's T tile and feature chunk for `[N, T, p]` and `[N, T, d]` factors."""
    return {"BT": tile_size(t, tile), "BK": tile_size(max(p, d), chunk)}


def ghost_norm_sq(left: Tensor, right: Tensor, tile: int | None = None, chunk: int | None = None) -> Tensor:
    """`[N]` float32 `||L_n^T R_n||_F^2` from Gram matrices of T tiles (pairs j <= k). tile, chunk: the limits of
    the T tile and the feature chunk (default: the launch configuration's)."""
    n, t, p = left.shape
    d = right.shape[2]
    limit = _GHOST.config(left.dtype).tile
    tiles = ghost_tiles(t, p, d, tile or limit, chunk or limit)
    count = triton.cdiv(t, tiles["BT"])
    pairs = torch.triu_indices(count, count, device=left.device).T.contiguous().to(torch.int32)
    partial = torch.full((n, len(pairs)), float("nan"), device=left.device, dtype=torch.float32)
    if n:
        _GHOST(
            (n, len(pairs)), left.dtype, left, right, pairs, partial, t, p, d, *left.stride(), *right.stride(),
            **tiles, UPCAST=upcast_tiles(),
        )  # fmt: skip
    return partial.sum(1)
