"""`nn.Conv1d` / `nn.Conv2d` (stride, padding of any mode, dilation, groups): unfold, then a Linear per group."""

from __future__ import annotations

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.per_sample import OuterGrad, PerSampleGrad
from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import sum_over_positions


def _padded(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """The input as the convolution sees it: explicitly padded ('same', 'valid', ints, any padding_mode)."""
    pad = module._reversed_padding_repeated_twice
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pad, mode=mode) if any(pad) else x


def conv_grads(
    module: nn.Conv1d | nn.Conv2d, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, PerSampleGrad]:
    """Weight `[o, c/g, *k]`: per convolution group, `G^T U` with U the unfolded input `[B*g, P, c/g * prod(k)]`
    and G the output gradient `[B*g, P, o/g]` over the P output positions. Bias `[o]`: `sum_P G`."""
    spatial = len(module.kernel_size)
    x = inputs[0]
    if x.dim() != spatial + 2:
        raise FlashDPError(
            f"Wrong shape: {type(module).__name__} expects a batched input [B, C, ...] with {spatial + 2} dims. "
            f"Received {x.dim()} dims {tuple(x.shape)}. Add the batch dimension."
        )
    out: dict[str, PerSampleGrad] = {}
    if "bias" in trainable:
        out["bias"] = sum_over_positions(grad_output.movedim(1, -1), 1)
    if "weight" in trainable:
        out["weight"] = _weight_grad(module, x, grad_output)
    return out


def _weight_grad(module: nn.Conv1d | nn.Conv2d, x: Tensor, grad_output: Tensor) -> OuterGrad:
    x = _padded(module, x)
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    if len(kernel) == 1:
        x, grad_output = x.unsqueeze(2), grad_output.unsqueeze(2)
        kernel, stride, dilation = (1, *kernel), (1, *stride), (1, *dilation)
    conv_groups = module.groups
    cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # [B, c * prod(k), P]
    cols = rearrange(cols, "b (g k) p -> (b g) p k", g=conv_groups)
    g = rearrange(grad_output.flatten(2), "b (g o) p -> (b g) p o", g=conv_groups)
    return OuterGrad(g, cols, conv_groups=conv_groups)


register_rule(nn.Conv1d, conv_grads)
register_rule(nn.Conv2d, conv_grads)
