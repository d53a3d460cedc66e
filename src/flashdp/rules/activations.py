"""`nn.PReLU`: `y = max(0, x) + w * min(0, x)`, one slope per channel (dim 1) or one for all."""

from __future__ import annotations

from torch import Tensor, nn

from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import sum_over_positions


def prelu_grads(module: nn.PReLU, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]) -> dict:
    """`sum g * min(0, x)` per channel (or over everything, for one slope): `[B, num_parameters]`, normed
    directly.

    x, G `[B, C, *]` (or `[B]` with one slope)."""
    x = inputs[0]
    slope_grad = grad_output * x.clamp(max=0).to(grad_output.dtype)
    if module.num_parameters == 1:
        return {"weight": sum_over_positions(slope_grad.reshape(x.shape[0], -1, 1), 1)}
    return {"weight": sum_over_positions(slope_grad.movedim(1, -1), 1)}


def prelu_call_support(module: nn.PReLU, args: tuple, kwargs: dict) -> str | None:
    x = args[0] if args else next(iter(kwargs.values()))
    if module.num_parameters > 1 and x.dim() < 2:
        return f"an input of shape {tuple(x.shape)}; flashdp needs a batch with channels in dim 1 [B, C, ...]."
    return None


register_rule(nn.PReLU, prelu_grads, check_call=prelu_call_support)
