"""Convolutions of any spatial rank: `nn.Conv1d/2d/3d` (stride, padding of any mode, dilation, groups) and
`nn.ConvTranspose1d/2d/3d` (also output_padding).

A convolution is a Linear per group over unfolded input windows: weight `[o, c/g, *k]` gets `G^T U` per sample,
with U the windows `[P, c/g * prod(k)]` and G the output gradient `[P, o/g]` at the P output positions. A
transposed convolution is the adjoint of a convolution with the same weight, so its weight gradient is that
convolution's, with the roles swapped: the windows are unfolded from its output gradient and the "output
gradient" is its input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.per_sample import OuterGrad, PerSampleGrad
from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import sum_over_positions

Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d
ConvTranspose = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d


def conv_grads(module: Conv, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]) -> dict[str, PerSampleGrad]:
    """A Linear per group on the input's windows U: weight `G_i^T U_i`, bias `sum G_i`; ghost or direct norm.

    x `[B, c, *S]`, G `[B, o, *S_out]` -> weight (OuterGrad) and bias `[B, o]`."""
    x = _batched(module, inputs[0])
    out = _bias(grad_output, trainable)
    if "weight" in trainable:
        windows = _unfold(_padded(module, x), module)
        out["weight"] = _grouped(grad_output, windows, module.groups)
    return out


def conv_transpose_grads(
    module: ConvTranspose, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, PerSampleGrad]:
    """The adjoint convolution's: windows U unfolded from the output gradient, weight `x_i^T U_i` per group, bias
    `sum G_i`; ghost or direct norm.

    x `[B, c, *S]`, G `[B, o, *S_out]` -> weight `[c, o/g, *k]` (OuterGrad) and bias `[B, o]`: the weight gradient
    of the convolution from G (zero-padded by `padding`) to x."""
    x = _batched(module, inputs[0])
    out = _bias(grad_output, trainable)
    if "weight" in trainable:
        padding = [p for size in reversed(module.padding) for p in (size, size)]
        windows = _unfold(F.pad(grad_output, padding) if any(padding) else grad_output, module, x.shape[2:])
        out["weight"] = _grouped(x, windows, module.groups)
    return out


def _batched(module: Conv | ConvTranspose, x: Tensor) -> Tensor:
    spatial = len(module.kernel_size)
    if x.dim() != spatial + 2:
        raise FlashDPError(
            f"Wrong shape: {type(module).__name__} expects a batched input [B, C, ...] with {spatial + 2} dims. "
            f"Received {x.dim()} dims {tuple(x.shape)}. Add the batch dimension."
        )
    return x


def _bias(grad_output: Tensor, trainable: frozenset[str]) -> dict[str, PerSampleGrad]:
    return {"bias": sum_over_positions(grad_output.movedim(1, -1), 1)} if "bias" in trainable else {}


def _padded(module: Conv, x: Tensor) -> Tensor:
    """The input as the convolution sees it: explicitly padded ('same', 'valid', ints, any padding_mode)."""
    pad = module._reversed_padding_repeated_twice
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pad, mode=mode) if any(pad) else x


def _unfold(x: Tensor, module: Conv | ConvTranspose, positions: Sequence[int] | None = None) -> Tensor:
    """`[B, c, *S]` -> the convolution's windows `[B, c * prod(k), P]` (channel-major, as the weight is laid out);
    only the first `positions` windows per spatial dim, where given (a transposed convolution's output_padding
    can leave windows past its input)."""
    spatial = len(module.kernel_size)
    for i, (k, d, s) in enumerate(zip(module.kernel_size, module.dilation, module.stride, strict=True)):
        x = x.unfold(2 + i, (k - 1) * d + 1, s)[..., ::d]  # appends this dim's window
        if positions is not None:
            x = x.narrow(2 + i, 0, positions[i])
    batch, channels, positions = x.shape[0], x.shape[1], math.prod(x.shape[2 : 2 + spatial])
    order = [0, 1, *range(2 + spatial, 2 + 2 * spatial), *range(2, 2 + spatial)]
    return x.permute(order).reshape(batch, channels * math.prod(module.kernel_size), positions)


def _grouped(grad: Tensor, windows: Tensor, groups: int) -> OuterGrad:
    """The output-side factor `[B, o, *S]` and the windows `[B, c * k, P]` as one Linear per group."""
    left = rearrange(grad.flatten(2), "b (g o) p -> (b g) p o", g=groups)
    right = rearrange(windows, "b (g k) p -> (b g) p k", g=groups)
    return OuterGrad(left, right, conv_groups=groups)


for _conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_conv, conv_grads)
for _transposed in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    register_rule(_transposed, conv_transpose_grads)
