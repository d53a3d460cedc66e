"""Plain-PyTorch reference of the book-keeping clipped sum.

L `[B * g, T, p]`, R `[B * g, T, d]` (rows `b * g + j` belong to sample b, convolution group j), coef `[B]`.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from flashdp.per_sample import accumulation_dtype


def clipped_sum(left: Tensor, right: Tensor, coef: Tensor, conv_groups: int = 1) -> Tensor:
    """`[g, p, d]` `sum_b coef_b L_b^T R_b` per group: a scaled copy of L, then one GEMM per group."""
    dtype = accumulation_dtype(left, right)
    scaled = left.to(dtype) * coef.to(dtype).repeat_interleave(conv_groups)[:, None, None]
    by_group = "(b g) t k -> g (b t) k"
    return torch.bmm(
        rearrange(scaled, by_group, g=conv_groups).transpose(1, 2),
        rearrange(right.to(dtype), by_group, g=conv_groups),
    )
