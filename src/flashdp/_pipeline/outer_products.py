"""Math on a parameter's outer-product blocks beyond one `(L, R)` pair: the blocks of several calls concatenated
along T, embedding token blocks by segment sums, cross terms between a tied table's token and dense blocks, and
the cost model that picks a norm per parameter and batch shape.

Shapes: N rows (samples x convolution groups), T positions, p = left width, d = right width. Sums accumulate in
`accumulation_dtype` (float32; float64 stays float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from flashdp.per_sample import OuterGrad, TokenRows, accumulation_dtype, bmm_in

Strategy = Literal["ghost", "direct"]


def norm_strategy(t: int, p: int, d: int) -> Strategy:
    """The cheaper exact norm for a `[p, d]` gradient summed over t positions.

    ghost costs t^2 (p + d) per sample and holds t (p + d) numbers; direct costs t p d and holds p d. Ghost wins
    when t (p + d) < p d; otherwise direct, whose per-sample gradient is then no larger than the factors it
    comes from (so book-keeping may keep it and skip the second GEMM).
    """
    return "ghost" if t * (p + d) < p * d else "direct"


def concat_positions(blocks: Sequence[OuterGrad]) -> OuterGrad:
    """One block for the blocks of a parameter used by several calls: their positions concatenated along T."""
    if len(blocks) == 1:
        return blocks[0]
    left = blocks[0].left
    if isinstance(left, TokenRows):
        left = TokenRows(torch.cat([b.left.ids for b in blocks], dim=1), left.num_rows)
    else:
        left = torch.cat([b.left for b in blocks], dim=1)
    return OuterGrad(left, torch.cat([b.right for b in blocks], dim=1), blocks[0].conv_groups)


def token_norm_sq(block: OuterGrad) -> Tensor:
    """`[N]` squared norms of a token block: `sum_v ||sum_{t: id_t = v} right_t||^2` by segment sums.

    O(N T d) memory, never `[N, num_rows, d]`. No device sync: the (sample, row) keys are sorted and each run of
    equal keys summed into its own slot of `N T` (slots past the last run stay zero), so no size depends on data.
    """
    ids, num_rows = block.left.ids, block.left.num_rows
    n, t, d = block.right.shape
    dtype = accumulation_dtype(block.right)
    rows = torch.arange(n, device=ids.device)[:, None]
    keys, order = (rows * num_rows + ids).flatten().sort()
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    run = starts.cumsum(0) - 1  # [N T] the run of equal keys each sorted position belongs to
    sums = block.right.new_zeros(n * t, d, dtype=dtype)
    sums.index_add_(0, run, block.right.reshape(-1, d)[order].to(dtype))
    sample = torch.zeros(n * t, dtype=torch.long, device=ids.device).scatter_(0, run, keys // num_rows)
    out = block.right.new_zeros(n, dtype=dtype)
    return out.index_add_(0, sample, torch.linalg.vector_norm(sums, dim=1).square())


def token_inner_with_per_sample(per_sample: Tensor, block: OuterGrad) -> Tensor:
    """`[N]` inner products of materialised per-sample gradients `[N, V, d]` with a token block's."""
    ids = block.left.ids
    rows = per_sample.gather(1, ids[:, :, None].expand(-1, -1, per_sample.shape[2]))
    return (rows * block.right.to(per_sample.dtype)).sum((1, 2))


def token_clipped_sum(block: OuterGrad, coef: Tensor) -> Tensor:
    """`[1, num_rows, d]` `sum_b coef_b g_b` of a token block (coef `[B]`), by index_add."""
    ids, num_rows = block.left.ids, block.left.num_rows
    d = block.right.shape[2]
    dtype = accumulation_dtype(block.right)
    scaled = block.right.to(dtype) * coef.to(dtype)[:, None, None]
    out = block.right.new_zeros(num_rows, d, dtype=dtype)
    return out.index_add_(0, ids.flatten(), scaled.reshape(-1, d))[None]


def clipped_sum_per_sample(per_sample: Tensor, coef: Tensor, conv_groups: int) -> Tensor:
    """`[g, p, d]` `sum_b coef_b g_b` from materialised per-sample gradients `[B * g, p, d]` (one GEMV)."""
    n, p, d = per_sample.shape
    batch = n // conv_groups
    return (coef.to(per_sample.dtype) @ per_sample.reshape(batch, conv_groups * p * d)).view(conv_groups, p, d)


def materialise(block: OuterGrad, batch: int) -> Tensor:
    """`[B, groups * p, d]` per-sample gradients of a block, explicitly (for a sum with a materialised one)."""
    dtype = accumulation_dtype(block.right)
    n, _, d = block.right.shape
    if isinstance(block.left, TokenRows):
        ids, rows = block.left.ids, block.left.num_rows
        flat = (torch.arange(n, device=ids.device)[:, None] * rows + ids).flatten()
        out = block.right.new_zeros(n * rows, d, dtype=dtype)
        out.index_add_(0, flat, block.right.reshape(-1, d).to(dtype))
        return out.view(batch, -1, d)
    grads = bmm_in(block.left.transpose(1, 2), block.right, dtype)  # [B * g, p, d]
    return grads.reshape(batch, -1, d)
