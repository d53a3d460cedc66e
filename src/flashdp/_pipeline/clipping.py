"""Per-sample clipping coefficients for each style, from the squared norms of each clipping group."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

Clipping = Literal["flat", "per_layer", "automatic"]
CLIPPING_STYLES: tuple[str, ...] = ("flat", "per_layer", "automatic")

#: Added to the norm in the flat and per-layer coefficients `min(1, C / (norm + eps))`.
FLAT_EPS = 1e-6
#: The stability constant gamma of automatic clipping `C / (norm + gamma)` (Bu et al. 2022).
AUTOMATIC_GAMMA = 0.01


def clip_coefficients(style: Clipping, group_norms_sq: Tensor, max_grad_norm: float) -> Tensor:
    """`[L, B]` coefficients from `[L, B]` squared norms of the L clipping groups.

    flat: `min(1, C / (||g_i|| + 1e-6))` on the norm over all groups. per_layer: group l clipped to
    `C_l = C / sqrt(L)` (so `sum_l C_l^2 = C^2`). automatic: `C / (||g_i|| + 0.01)`.
    """
    if style == "per_layer":
        budget = max_grad_norm / group_norms_sq.shape[0] ** 0.5
        return (budget / (group_norms_sq.sqrt() + FLAT_EPS)).clamp(max=1.0)
    total = group_norms_sq.sum(0).sqrt()
    if style == "flat":
        coef = (max_grad_norm / (total + FLAT_EPS)).clamp(max=1.0)
    else:
        coef = max_grad_norm / (total + AUTOMATIC_GAMMA)
    return coef.expand_as(group_norms_sq)
