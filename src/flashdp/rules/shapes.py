"""Shape helpers shared by the rules."""

from __future__ import annotations

import math

from torch import Tensor

from flashdp.errors import FlashDPError
from flashdp.per_sample import accumulation_dtype


def positions(x: Tensor, what: str) -> Tensor:
    """`[B, *, k]` -> `[B, T, k]`: every leading dim but the batch becomes a position."""
    if x.dim() < 2:
        raise FlashDPError(
            f"Wrong shape: expected the {what} batched as [B, ..., features]. Received a {x.dim()}-dim tensor of "
            f"shape {tuple(x.shape)}. Call the layer with a leading batch dimension."
        )
    if x.dim() == 3:
        return x
    # (the positions counted, not -1: a layer of no features has no elements to infer them from)
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


def sum_over_positions(x: Tensor, param_dims: int) -> Tensor:
    """`[B, *positions, *param]` -> `[B, *param]`, summed in float32 (float64 stays float64)."""
    dims = tuple(range(1, x.dim() - param_dims))
    return x.sum(dim=dims, dtype=accumulation_dtype(x)) if dims else x.to(accumulation_dtype(x))
