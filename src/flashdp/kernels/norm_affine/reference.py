"""Plain-PyTorch reference of the per-sample affine gradients of LayerNorm / RMSNorm.

x, g `[N, T, D]`, normalised over D: `dw_n = sum_t x_hat_t * g_t`, `db_n = sum_t g_t`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from flashdp.per_sample import accumulation_dtype, cast


def norm_affine_grads(x: Tensor, g: Tensor, eps: float, rms: bool, bias: bool) -> tuple[Tensor, Tensor | None]:
    """(weight `[N, D]`, bias `[N, D]` or None) in float32 (float64 stays float64)."""
    dtype = accumulation_dtype(x)
    x = cast(x, dtype)
    x_hat = F.rms_norm(x, x.shape[-1:], eps=eps) if rms else F.layer_norm(x, x.shape[-1:], eps=eps)
    g = cast(g, dtype)
    return (x_hat * g).sum(1), (g.sum(1) if bias else None)
