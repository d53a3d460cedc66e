"""Plain-PyTorch reference of the book-keeping clipped sum.

L `[B * g, T, p]`, R `[B * g, T, d]` (rows `b * g + j` belong to sample b, convolution group j), coef `[B]`.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from flashdp.per_sample import accumulation_dtype


def clipped_sum(left: Tensor, right: Tensor, coef: Tensor, conv_groups: int = 1) -> Tensor:
    """`[g, p, d]` `sum_b coef_b L_b^T R_b` per group: a scaled copy of the narrower factor (`sum_b L_b^T (coef_b
    R_b)` where d < p: an MLP's up-projection scales its input, not its 4x wider output gradient), then one GEMM per
    group."""
    dtype = accumulation_dtype(left, right)
    rows = coef.to(dtype).repeat_interleave(conv_groups)[:, None, None]
    left, right = left.to(dtype), right.to(dtype)
    if right.shape[-1] < left.shape[-1]:
        right = right * rows
    else:
        left = left * rows
    by_group = "(b g) t k -> g (b t) k"
    return torch.bmm(
        rearrange(left, by_group, g=conv_groups).transpose(1, 2), rearrange(right, by_group, g=conv_groups)
    )
