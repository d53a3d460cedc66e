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
    rows = coef.to(dtype)
    rows = (rows if conv_groups == 1 else rows.repeat_interleave(conv_groups))[:, None, None]
    left, right = left.to(dtype), right.to(dtype)
    if right.shape[-1] < left.shape[-1]:
        right = right * rows
    else:
        left = left * rows
    if conv_groups == 1:  # (one GEMM of the rows; plain reshapes: this runs per parameter and call)
        if not (_rows_merge(left) and _rows_merge(right)):
            return _summed_by_sample(left, right)
        return (_as_rows(left).T @ _as_rows(right))[None]
    by_group = "(b g) t k -> g (b t) k"
    return torch.bmm(
        rearrange(left, by_group, g=conv_groups).transpose(1, 2), rearrange(right, by_group, g=conv_groups)
    )


def _as_rows(x: Tensor) -> Tensor:
    """`[N, T, k]` -> `[N * T, k]` (sizes given: k or N * T may be 0)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _rows_merge(x: Tensor) -> bool:
    """Whether `[N, T, k]`'s rows are `[N * T, k]` without a copy."""
    return x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1)


def _summed_by_sample(left: Tensor, right: Tensor) -> Tensor:
    """`[1, p, d]` `sum_n L_n^T R_n`, one GEMM per sample accumulated: for factors whose rows would be copied to
    be one matrix (an output gradient of transposed layout, such as a language model's logits read by its loss
    through `.transpose(1, 2)`: 64 MB copied for a GPT-2 LM head at B=16, T=256)."""
    out = left.new_zeros(left.shape[2], right.shape[2])
    for left_n, right_n in zip(left.unbind(), right.unbind(), strict=True):
        out.addmm_(left_n.T, right_n)
    return out[None]
