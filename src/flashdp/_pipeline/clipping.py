"""Per-sample clipping coefficients for each style, from the squared norms of each clipping group."""

from __future__ import annotations

import functools
from typing import Literal

import torch
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


def coefficients_in(coef: Tensor, dtype: torch.dtype) -> Tensor:
    """Non-negative `coef` cast to `dtype`, rounded toward zero: a coefficient rounded up scales a sample's gradient
    past its bound (a breaker's norm of 1.2e39 at C = 1e-6 had a float32 subnormal coefficient rounded up: 1.86 C)."""
    if coef.dtype == dtype:
        return coef
    cast = coef.to(dtype)
    return torch.where(cast.to(coef.dtype) > coef, torch.nextafter(cast, torch.zeros_like(cast)), cast)


def least_bound(style: Clipping, max_grad_norm: float, groups: int) -> float:
    """The smallest norm any of `groups` clipping groups is clipped to: `C / sqrt(L)` per layer, else C."""
    return max_grad_norm / groups**0.5 if style == "per_layer" else max_grad_norm


def group_norms_sq(norms_sq: list[Tensor], clip_groups: tuple[int, ...], groups: int, batch: int) -> Tensor:
    """`[L, B]` float64 squared norms of the L clipping groups from each parameter's `[B]` squared norms and its
    group: the norms stacked once, placed in an `[L, K, B]` grid (K: the most parameters of one group, in their
    order) and summed over K. A fixed number of ops however many groups there are (a step of many tiny layers is
    host-bound), and the same sums in the same order on every run (no atomic adds)."""
    stacked = torch.stack(norms_sq).to(torch.float64)
    slots, width = _grid_slots(clip_groups, stacked.device)
    grid = stacked.new_zeros(groups * width, batch)
    grid[slots] = stacked
    return grid.view(groups, width, batch).sum(1)


@functools.lru_cache(maxsize=16)
def _grid_slots(clip_groups: tuple[int, ...], device: torch.device) -> tuple[Tensor, int]:
    """Each parameter's row `group * K + (its rank among its group's parameters)` of the grid, and K."""
    ranks: list[int] = []
    seen: dict[int, int] = {}
    for group in clip_groups:
        ranks.append(seen.get(group, 0))
        seen[group] = ranks[-1] + 1
    width = max(seen.values())
    slots = [group * width + rank for group, rank in zip(clip_groups, ranks, strict=True)]
    return torch.tensor(slots, device=device), width
