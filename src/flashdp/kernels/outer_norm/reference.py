"""Plain-PyTorch reference of the norm kernels, and the tiled Gram products the pipeline builds on.

`g_n = L_n^T R_n` with L `[N, T, p]` (or `TokenRows`: one-hot rows, p = the table's rows) and R `[N, T, d]`.
Everything accumulates in `accumulation_dtype` (float32; float64 stays float64). The references take the kernels'
arguments and are more general: their left factor may be `TokenRows`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from flashdp.per_sample import OuterGrad, TokenRows, accumulation_dtype, bmm_in

#: Positions per tile of the ghost norm: no Gram matrix larger than GHOST_TILE x GHOST_TILE is built per row.
GHOST_TILE = 512

Left = Tensor | TokenRows


#: elements per chunk of a row whose squared norm `sum_of_squares` takes alone before summing the chunks
SQUARES_CHUNK = 4096


def sum_of_squares(x: Tensor) -> Tensor:
    """`[N, ...]` -> `[N]` squared norms, accumulated in float32 at least. vector_norm reads x once and builds no
    squared copy (7x faster than `x.square().sum()` on CPU), but on CPU its float32 sum over a long row drifts low
    (-6e-4 relative over 9.4M entries: a sample clipped to C would contribute more than C), so rows are taken in
    chunks of `SQUARES_CHUNK` and the chunks' squares summed pairwise (about 1e-7, as fast)."""
    rows = x if x.dim() == 2 else x.reshape(x.shape[0], math.prod(x.shape[1:]))
    dtype, length = accumulation_dtype(rows), rows.shape[1]
    whole = length - length % SQUARES_CHUNK
    if whole <= SQUARES_CHUNK:
        return torch.linalg.vector_norm(rows, dim=1, dtype=dtype).square()
    chunks = rows[:, :whole].unflatten(1, (-1, SQUARES_CHUNK))
    total = torch.linalg.vector_norm(chunks, dim=2, dtype=dtype).square().sum(1)
    if whole < length:
        total += torch.linalg.vector_norm(rows[:, whole:], dim=1, dtype=dtype).square()
    return total


def per_sample(left: Tensor, right: Tensor, dtype: torch.dtype) -> Tensor:
    """`[N, p, d]` per-sample gradients `L_n^T R_n`, materialised in `dtype`."""
    return bmm_in(left.transpose(1, 2), right, dtype)


def direct_norm_sq(left: Tensor, right: Tensor) -> Tensor:
    """`[N]` `||L_n^T R_n||^2`, by materialising each `L_n^T R_n`."""
    return sum_of_squares(per_sample(left, right, accumulation_dtype(left, right)))


def gram(x: Left, y: Left, dtype: torch.dtype) -> Tensor:
    """`[N, Tx, Ty]` inner products `<x_t, y_s>` between the positions of two tiles."""
    if isinstance(x, TokenRows) and isinstance(y, TokenRows):
        return (x.ids[:, :, None] == y.ids[:, None, :]).to(dtype)
    if isinstance(x, TokenRows):
        return gram(y, x, dtype).transpose(1, 2)
    if isinstance(y, TokenRows):
        return x.to(dtype).gather(2, y.ids[:, None, :].expand(-1, x.shape[1], -1))
    return bmm_in(x, y.transpose(1, 2), dtype)


def _tiles(block: OuterGrad, tile: int) -> Iterator[OuterGrad]:
    left = block.left
    for start in range(0, block.right.shape[1], tile):
        part = (
            TokenRows(left.ids[:, start : start + tile], left.num_rows)
            if isinstance(left, TokenRows)
            else left[:, start : start + tile]
        )
        yield OuterGrad(part, block.right[:, start : start + tile])


def _tile_inner(a: OuterGrad, b: OuterGrad, dtype: torch.dtype) -> Tensor:
    """`[N]` inner products of the gradients two tiles contribute: `<L_a L_b^T, R_a R_b^T>`."""
    return (gram(a.left, b.left, dtype) * gram(a.right, b.right, dtype)).sum((1, 2))


def ghost_inner(a: OuterGrad, b: OuterGrad, tile: int | None = None) -> Tensor:
    """`[N]` inner products `<g_a, g_b>` of two blocks' per-sample gradients, by Gram matrices tiled along T."""
    dtype = accumulation_dtype(a.right, b.right)
    tiles_b = list(_tiles(b, tile or GHOST_TILE))
    total = a.right.new_zeros(a.right.shape[0], dtype=dtype)
    for tile_a in _tiles(a, tile or GHOST_TILE):
        for tile_b in tiles_b:
            total += _tile_inner(tile_a, tile_b, dtype)
    return total


def ghost_norm_sq(left: Left, right: Tensor, tile: int | None = None) -> Tensor:
    """`[N]` `||L_n^T R_n||^2` from Gram matrices of T tiles (pairs j <= k, the others by symmetry)."""
    dtype = accumulation_dtype(right)
    tiles = list(_tiles(OuterGrad(left, right), tile or GHOST_TILE))
    total = right.new_zeros(right.shape[0], dtype=dtype)
    for j, a in enumerate(tiles):
        total += _tile_inner(a, a, dtype)
        for b in tiles[j + 1 :]:
            total += 2 * _tile_inner(a, b, dtype)
    return total
