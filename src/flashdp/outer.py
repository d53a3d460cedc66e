"""Exact norms and clipped sums of per-sample gradients held as outer-product factors (`OuterGrad`).

Plain PyTorch: the reference every Triton kernel must match. All sums accumulate in float32 (float64 stays
float64), whatever the input dtype. Shapes: N rows (samples x groups), T positions, p = left width,
d = right width.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

from flashdp.rules.grads import OuterGrad, TokenRows

Strategy = Literal["ghost", "direct"]

#: Positions per tile of the ghost norm: no Gram matrix larger than GHOST_TILE x GHOST_TILE is built per row.
GHOST_TILE = 512

Left = Tensor | TokenRows


def norm_strategy(t: int, p: int, d: int) -> Strategy:
    """The cheaper exact norm for a `[p, d]` gradient summed over t positions.

    ghost costs t^2 (p + d) per sample and holds t (p + d) numbers; direct costs t p d and holds p d. Ghost wins
    when t (p + d) < p d; otherwise direct, whose per-sample gradient is then no larger than the factors it
    comes from (so book-keeping may keep it and skip the second GEMM).
    """
    return "ghost" if t * (p + d) < p * d else "direct"


def sum_of_squares(x: Tensor) -> Tensor:
    """`[N, ...]` -> `[N]` squared norms. vector_norm reads x once and builds no squared copy (7x faster than
    `x.square().sum()` on CPU)."""
    return torch.linalg.vector_norm(x.flatten(1), dim=1).square()


def _slice(left: Left, start: int, stop: int) -> Left:
    if isinstance(left, TokenRows):
        return TokenRows(left.ids[:, start:stop], left.num_rows)
    return left[:, start:stop]


def gram(x: Left, y: Left, dtype: torch.dtype) -> Tensor:
    """`[N, Tx, Ty]` inner products `<x_t, y_s>` between the positions of two tiles."""
    if isinstance(x, TokenRows) and isinstance(y, TokenRows):
        return (x.ids[:, :, None] == y.ids[:, None, :]).to(dtype)
    if isinstance(x, TokenRows):
        return gram(y, x, dtype).transpose(1, 2)
    if isinstance(y, TokenRows):
        return x.to(dtype).gather(2, y.ids[:, None, :].expand(-1, x.shape[1], -1))
    return torch.bmm(x.to(dtype), y.to(dtype).transpose(1, 2))


def _tiles(blocks: Sequence[OuterGrad], tile: int) -> Iterator[tuple[Left, Tensor]]:
    for block in blocks:
        t = block.right.shape[1]
        for start in range(0, t, tile):
            yield _slice(block.left, start, start + tile), block.right[:, start : start + tile]


def _tile_inner(a: tuple[Left, Tensor], b: tuple[Left, Tensor], dtype: torch.dtype) -> Tensor:
    """`[N]` inner products of the gradients two tiles contribute: `<L_a L_b^T, R_a R_b^T>`."""
    return (gram(a[0], b[0], dtype) * gram(a[1], b[1], dtype)).sum((1, 2))


def ghost_norm_sq(blocks: Sequence[OuterGrad], dtype: torch.dtype, tile: int | None = None) -> Tensor:
    """`[N]` squared norms of `sum_blocks left^T right`, by Gram matrices tiled along T (pairs j <= k)."""
    tiles = list(_tiles(blocks, tile or GHOST_TILE))
    total = blocks[0].right.new_zeros(blocks[0].right.shape[0], dtype=dtype)
    for j, a in enumerate(tiles):
        total += _tile_inner(a, a, dtype)
        for b in tiles[j + 1 :]:
            total += 2 * _tile_inner(a, b, dtype)
    return total


def ghost_inner(
    blocks_a: Sequence[OuterGrad], blocks_b: Sequence[OuterGrad], dtype: torch.dtype, tile: int | None = None
) -> Tensor:
    """`[N]` inner products `<sum_a g_a, sum_b g_b>` of two sets of blocks, tiled along T."""
    tiles_b = list(_tiles(blocks_b, tile or GHOST_TILE))
    total = blocks_a[0].right.new_zeros(blocks_a[0].right.shape[0], dtype=dtype)
    for a in _tiles(blocks_a, tile or GHOST_TILE):
        for b in tiles_b:
            total += _tile_inner(a, b, dtype)
    return total


def per_sample_blocks(blocks: Sequence[OuterGrad], dtype: torch.dtype) -> Tensor:
    """`[N, p, d]` per-sample gradients `sum_blocks left^T right` of dense-left blocks, materialised."""
    out = None
    for block in blocks:
        g = torch.bmm(block.left.to(dtype).transpose(1, 2), block.right.to(dtype))
        out = g if out is None else out.add_(g)
    return out


def merge_tokens(blocks: Sequence[OuterGrad]) -> OuterGrad:
    """One token block from several (the same table used by several calls), concatenated along T."""
    if len(blocks) == 1:
        return blocks[0]
    ids = torch.cat([b.left.ids for b in blocks], dim=1)
    right = torch.cat([b.right for b in blocks], dim=1)
    return OuterGrad(TokenRows(ids, blocks[0].left.num_rows), right)


def token_norm_sq(block: OuterGrad, dtype: torch.dtype) -> Tensor:
    """`[N]` squared norms of a token block: `sum_v ||sum_{t: id_t = v} right_t||^2` by segment sums.

    O(N T d) memory, never `[N, num_rows, d]`.
    """
    ids, num_rows = block.left.ids, block.left.num_rows
    n, _, d = block.right.shape
    rows = torch.arange(n, device=ids.device)[:, None]
    keys = (rows * num_rows + ids).flatten()
    unique, inverse = torch.unique(keys, return_inverse=True)
    sums = block.right.new_zeros(unique.numel(), d, dtype=dtype)
    sums.index_add_(0, inverse, block.right.reshape(-1, d).to(dtype))
    out = block.right.new_zeros(n, dtype=dtype)
    return out.index_add_(0, unique // num_rows, sum_of_squares(sums))


def token_inner_with_dense(per_sample: Tensor, block: OuterGrad, dtype: torch.dtype) -> Tensor:
    """`[N]` inner products of materialised per-sample gradients `[N, V, d]` with a token block."""
    ids = block.left.ids
    rows = per_sample.gather(1, ids[:, :, None].expand(-1, -1, per_sample.shape[2]))
    return (rows * block.right.to(dtype)).sum((1, 2))


def _grouped(x: Tensor, groups: int) -> Tensor:
    """`[B * g, T, k]` -> `[g, B * T, k]`."""
    n, t, k = x.shape
    return x.view(n // groups, groups, t, k).transpose(0, 1).reshape(groups, -1, k)


def clipped_sum_factors(blocks: Sequence[OuterGrad], coef: Tensor, dtype: torch.dtype) -> Tensor:
    """`[g, p, d]` = `sum_b coef_b g_b` per group, from the factors (one GEMM per block, no per-sample grads).

    coef: `[B]` per-sample coefficients.
    """
    out = None
    for block in blocks:
        rows_coef = coef.to(dtype).repeat_interleave(block.groups)
        if block.is_tokens:
            term = _token_clipped_sum(block, rows_coef, dtype)[None]
        else:
            left = block.left.to(dtype) * rows_coef[:, None, None]
            term = torch.bmm(
                _grouped(left, block.groups).transpose(1, 2), _grouped(block.right.to(dtype), block.groups)
            )
        out = term if out is None else out.add_(term)
    return out


def _token_clipped_sum(block: OuterGrad, coef: Tensor, dtype: torch.dtype) -> Tensor:
    ids, num_rows = block.left.ids, block.left.num_rows
    d = block.right.shape[2]
    scaled = block.right.to(dtype) * coef[:, None, None]
    out = block.right.new_zeros(num_rows, d, dtype=dtype)
    return out.index_add_(0, ids.flatten(), scaled.reshape(-1, d))


def clipped_sum_per_sample(per_sample: Tensor, coef: Tensor, groups: int) -> Tensor:
    """`[g, p, d]` = `sum_b coef_b g_b` from materialised per-sample gradients `[B * g, p, d]`."""
    n, p, d = per_sample.shape
    batch = n // groups
    return (coef.to(per_sample.dtype) @ per_sample.reshape(batch, groups * p * d)).view(groups, p, d)  # GEMV, not bmm
