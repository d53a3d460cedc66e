"""Normalisation layers: `y = x_hat * w (+ b)` with x_hat computed per sample, so `dw_i = sum_t x_hat_t * g_t`.

LayerNorm, RMSNorm, GroupNorm, InstanceNorm1d/2d/3d, and HF's RMS norms (LlamaRMSNorm, T5LayerNorm, ...: a
`weight` and a `variance_epsilon`, no bias). BatchNorm mixes samples and is refused elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashdp import kernels
from flashdp.per_sample import accumulation_dtype
from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import sum_over_positions


def _affine_grads(x_hat: Tensor, grad_output: Tensor, param_dims: int, trainable: frozenset[str]) -> dict:
    """weight `[B, *param]` = sum over positions of `x_hat * g`; bias = sum of g."""
    out = {}
    if "weight" in trainable:
        out["weight"] = sum_over_positions(x_hat * grad_output.to(x_hat.dtype), param_dims)
    if "bias" in trainable:
        out["bias"] = sum_over_positions(grad_output, param_dims)
    return out


def _last_dims_grads(
    x: Tensor, grad_output: Tensor, shape: tuple[int, ...], eps: float, rms: bool, trainable: frozenset[str]
) -> dict:
    """x, g `[B, ..., *shape]` normalised over `shape` -> weight and bias `[B, *shape]` (kernel or torch)."""
    batch, size = x.shape[0], math.prod(shape)
    flat = x.dim() == 3 and len(shape) == 1  # already [B, T, D]: no reshapes (this runs at every layer call)
    weight, bias = kernels.norm_affine_grads(
        x if flat else x.reshape(batch, -1, size),
        grad_output if flat else grad_output.reshape(batch, -1, size),
        eps,
        rms,
        "bias" in trainable,
    )
    out = {"weight": weight if flat else weight.view(batch, *shape)} if "weight" in trainable else {}
    if bias is not None:
        out["bias"] = bias if flat else bias.view(batch, *shape)
    return out


def layer_norm_grads(module: nn.LayerNorm, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """`sum x_hat * g` and `sum g` over positions: per-sample tensors, normed directly (one fused pass).

    x `[B, ..., *normalized_shape]` -> weight and bias `[B, *normalized_shape]`."""
    return _last_dims_grads(inputs[0], grad_output, module.normalized_shape, module.eps, False, trainable)


def rms_norm_grads(module: nn.RMSNorm, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """`sum x_hat * g` over positions: a per-sample tensor, normed directly (one fused pass).

    x `[B, ..., *normalized_shape]` -> weight `[B, *normalized_shape]`."""
    x = inputs[0]
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    return _last_dims_grads(x, grad_output, module.normalized_shape, eps, True, trainable)


def group_norm_grads(module: nn.GroupNorm, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """`sum x_hat * g` and `sum g` per channel: per-sample tensors, normed directly.

    x `[B, C, *]` -> weight and bias `[B, C]`."""
    x = inputs[0]
    x_hat = F.group_norm(x.to(accumulation_dtype(x)), module.num_groups, eps=module.eps)
    return _affine_grads(x_hat.movedim(1, -1), grad_output.movedim(1, -1), 1, trainable)


def instance_norm_grads(
    module: nn.modules.instancenorm._InstanceNorm, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
):
    """`sum x_hat * g` and `sum g` per channel, x_hat by instance statistics (or running ones in eval mode):
    per-sample tensors, normed directly; running statistics refused in training.

    x `[B, C, *S]` -> weight and bias `[B, C]`."""
    x = inputs[0]
    use_input_stats = module.training or not module.track_running_stats
    x_hat = F.instance_norm(
        x.to(accumulation_dtype(x)),
        None if use_input_stats else module.running_mean,
        None if use_input_stats else module.running_var,
        use_input_stats=use_input_stats,
        eps=module.eps,
    )
    return _affine_grads(x_hat.movedim(1, -1), grad_output.movedim(1, -1), 1, trainable)


def instance_norm_call_support(module: nn.modules.instancenorm._InstanceNorm, args: tuple, kwargs: dict):
    x = args[0] if args else next(iter(kwargs.values()))
    if x.dim() == module._get_no_batch_dim():
        return f"an unbatched input of shape {tuple(x.shape)}; flashdp needs a batch [B, C, ...]."
    if module.training and module.track_running_stats:
        return RUNNING_STATS_LEAK
    return None


#: why running statistics are refused in training
RUNNING_STATS_LEAK = (
    "track_running_stats=True in training mode: its running mean and variance average private samples with no "
    "noise, and would leak them with the model. Set track_running_stats=False, or eval() the layer."
)


def _hf_rms_x_hat(module: nn.Module, x: Tensor) -> Tensor:
    x = x.to(accumulation_dtype(x))
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + module.variance_epsilon)


def hf_rms_norm_grads(module: nn.Module, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """`sum x_hat * g` over positions: a per-sample tensor, normed directly (one fused pass).

    x `[B, ..., d]` -> weight `[B, d]`."""
    x = inputs[0]
    return _last_dims_grads(x, grad_output, (x.shape[-1],), module.variance_epsilon, True, trainable)


def is_hf_rms_norm(module: nn.Module) -> bool:
    """LlamaRMSNorm / T5LayerNorm style: a 1-D `weight`, a `variance_epsilon`, no bias.

    The weight may be a plain tensor view: FSDP1 (use_orig_params=False) unregisters the original parameters.
    """
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and getattr(module, "bias", None) is None
        and set(dict(module.named_parameters(recurse=False))) <= {"weight"}
    )


def hf_rms_norm_forward(module: nn.Module, inputs: tuple) -> Tensor:
    x = inputs[0]
    return module.weight * _hf_rms_x_hat(module, x).to(x.dtype)


register_rule(nn.LayerNorm, layer_norm_grads, position_wise=True)
register_rule(nn.RMSNorm, rms_norm_grads, position_wise=True)
register_rule(nn.GroupNorm, group_norm_grads)
for _instance_norm in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
    register_rule(_instance_norm, instance_norm_grads, check_call=instance_norm_call_support)
register_rule(is_hf_rms_norm, hf_rms_norm_grads, reference_forward=hf_rms_norm_forward, position_wise=True)
