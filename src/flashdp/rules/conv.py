"""Convolutions of any spatial rank: `nn.Conv1d/2d/3d` (stride, padding of any mode, dilation, groups) and
`nn.ConvTranspose1d/2d/3d` (also output_padding).

A convolution is a Linear per group over unfolded input windows: weight `[o, c/g, *k]` gets `G^T U` per sample,
with U the windows `[P, c/g * prod(k)]` and G the output gradient `[P, o/g]` at the P output positions. A
transposed convolution is the adjoint of a convolution with the same weight, so its weight gradient is that
convolution's, with the roles swapped: the windows are unfolded from its output gradient and the "output
gradient" is its input.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.per_sample import (
    DeferredOuterGrad,
    OuterGrad,
    PerSampleGrad,
    accumulation_dtype,
    cast,
    ieee_float32_convolutions,
)
from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import sum_over_positions

Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d
ConvTranspose = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d


def conv_grads(module: Conv, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]) -> dict[str, PerSampleGrad]:
    """A Linear per group on the input's windows U: weight `G_i^T U_i`, bias `sum G_i`; ghost norm from the
    unfolded windows, or direct norm from per-sample gradients computed as ONE convolution weight gradient with the
    batch folded into the groups (no windows unfolded).

    x `[B, c, *S]`, G `[B, o, *S_out]` -> weight (`DeferredOuterGrad`) and bias `[B, o]`. Also `[B, k, c, *S]`:
    k rows per sample (frames folded into the batch), whose positions add up."""
    x = _batched(module, inputs[0])
    out = _bias(module, grad_output, trainable)
    if "weight" in trainable:

        def factors() -> OuterGrad:
            windows = _unfold(_padded(module, _rows(module, x)), module, module.groups)
            return _per_sample_blocks(_grouped(_rows(module, grad_output), windows, module.groups), x.shape[0])

        def parts_norm(dtype: torch.dtype) -> Tensor:
            pad = functools.partial(_padded, module)  # (of the squares: their channels summed, a copy far smaller)
            return _parts_norm(module, _rows(module, grad_output), _rows(module, x), x.shape[0], dtype, pad)

        out["weight"] = _deferred(module, x, grad_output, factors, parts_norm)
    return out


def conv_transpose_grads(
    module: ConvTranspose, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, PerSampleGrad]:
    """The adjoint convolution's: windows U unfolded from the output gradient, weight `x_i^T U_i` per group, bias
    `sum G_i`; ghost norm, or direct norm from one transposed-convolution weight gradient with the batch folded
    into the groups.

    x `[B, c, *S]`, G `[B, o, *S_out]` -> weight `[c, o/g, *k]` (`DeferredOuterGrad`) and bias `[B, o]`: the
    weight gradient of the convolution from G (zero-padded by `padding`) to x. Also k rows per sample, as Conv."""
    x = _batched(module, inputs[0])
    out = _bias(module, grad_output, trainable)
    if "weight" in trainable:
        padding = _pad_pairs(module, module.padding)

        def factors() -> OuterGrad:
            rows = _rows(module, grad_output)
            spatial = x.shape[-len(module.kernel_size) :]
            windows = _unfold(F.pad(rows, padding) if any(padding) else rows, module, module.groups, spatial)
            return _per_sample_blocks(_grouped(_rows(module, x), windows, module.groups), x.shape[0])

        def parts_norm(dtype: torch.dtype) -> Tensor:
            spatial = x.shape[-len(module.kernel_size) :]
            pad = functools.partial(F.pad, pad=padding)
            rows = _rows(module, grad_output)
            return _parts_norm(module, _rows(module, x), rows, x.shape[0], dtype, pad, spatial)

        out["weight"] = _deferred(module, x, grad_output, factors, parts_norm)
    return out


def _deferred(
    module: Conv | ConvTranspose,
    x: Tensor,
    grad_output: Tensor,
    factors: Callable[[], OuterGrad],
    parts_norm: Callable[[torch.dtype], Tensor],
) -> DeferredOuterGrad:
    """The weight's per-sample gradient as its factors (`factors()`: one `[o/g, c/g * k]` block per group and
    sample, over the positions of the factor not unfolded), or materialised by `_per_sample_weight_grads`."""
    shape = _weight_shape(module)
    not_unfolded = x if isinstance(module, ConvTranspose) else grad_output
    rows = _rows(module, x).shape[0] // x.shape[0]  # per sample
    return DeferredOuterGrad(
        operands=(x, grad_output),
        positions=rows * math.prod(not_unfolded.shape[-len(module.kernel_size) :]),
        block_shape=(shape[0] // module.groups, math.prod(shape[1:])),
        conv_groups=module.groups,
        factors=factors,
        dense=lambda: _per_sample_weight_grads(module, x, grad_output),
        weighted_sum=lambda w: _weighted_weight_grad(
            module, _rows(module, x), _rows(module, grad_output), w.repeat_interleave(rows)
        ),
        parts_norm=parts_norm,
    )


def _parts_norm(
    module: Conv | ConvTranspose,
    whole: Tensor,
    unfolded: Tensor,
    batch: int,
    dtype: torch.dtype,
    pad: Callable[[Tensor], Tensor],
    positions: Sequence[int] | None = None,
) -> Tensor:
    """`[B]` in `dtype`: the sum over rows, groups and positions t of `||whole_t|| ||window_t||`, the norms of the
    two factors' rows (`DeferredOuterGrad.parts_norm`) without unfolding them: `whole` `[N, ch, *P]` read at each
    position, the windows of `unfolded` `[N, ch', *S]` padded by `pad` as the convolution sees it, whose squared
    norms are a convolution with ones of its squares summed over each group's channels (padded alike: the squares
    of a padding are the padding of the squares)."""
    groups = module.groups  # (squares summed by channel, not a norm over a strided dim: 20x faster on CPU)
    at_positions = cast(whole, dtype).flatten(2).square().unflatten(1, (groups, -1)).sum(2).sqrt()  # [N, g, P]
    squares = pad(cast(unfolded, dtype).square().unflatten(1, (groups, -1)).sum(2))  # [N, g, *S]
    ones = squares.new_ones(groups, 1, *module.kernel_size)
    convolution = (F.conv1d, F.conv2d, F.conv3d)[len(module.kernel_size) - 1]
    stride, dilation = _per_dim(module, module.stride), _per_dim(module, module.dilation)
    with _full_float32(squares, dtype):  # [N, g, *P]: each window's squares summed, one convolution
        windows = convolution(squares, ones, stride=stride, dilation=dilation, groups=groups)
    for dim, size in enumerate(positions or ()):
        windows = windows.narrow(2 + dim, 0, size)
    windows = windows.flatten(2).clamp(min=0).sqrt()  # [N, g, P]
    return (at_positions * windows).reshape(batch, -1).sum(1)


def _rows(module: Conv | ConvTranspose, x: Tensor) -> Tensor:
    """`[B, k, c, *S]` (k rows per sample) -> the rows `[B * k, c, *S]`; `[B, c, *S]` as it is."""
    return x.flatten(0, 1) if x.dim() == len(module.kernel_size) + 3 else x


def _per_sample_weight_grads(module: Conv | ConvTranspose, x: Tensor, grad_output: Tensor) -> Tensor:
    """`[B, *weight.shape]`: the weight gradient of ONE convolution over the batch folded into the channels, with
    B times the groups, so that samples never mix. Accumulated in `accumulation_dtype` (16-bit inputs widened:
    their products are exact in float32, also under TF32, which is turned off for float32 inputs on CUDA)."""
    batch, dtype, spatial = x.shape[0], accumulation_dtype(x, grad_output), len(module.kernel_size)
    grads = _weight_grad(module, _folded(x, dtype, spatial), _folded(grad_output, dtype, spatial), batch)
    return grads.view(batch, *_weight_shape(module))


def _weighted_weight_grad(module: Conv | ConvTranspose, x: Tensor, grad_output: Tensor, weights: Tensor) -> Tensor:
    """`sum_b w_b g_b` `[*weight.shape]`: the convolution's weight gradient from its output gradient's rows scaled
    by `weights` `[B]`; the rows of weight 0 zeroed in both inputs (a NaN in them would survive a 0 weight)."""
    dtype = accumulation_dtype(x, grad_output)
    rows = (-1, *([1] * (x.dim() - 1)))
    kept = (weights != 0).view(rows)
    x = torch.where(kept, cast(x, dtype), 0)
    grad_output = torch.where(kept, cast(grad_output, dtype) * cast(weights, dtype).view(rows), 0)
    return _weight_grad(module, x, grad_output, 1)


def _weight_grad(module: Conv | ConvTranspose, x: Tensor, grad_output: Tensor, copies: int) -> Tensor:
    """The weight gradient of the convolution `module` from x to grad_output, its weight repeated `copies` times
    along dim 0 with as many times the groups (`copies` samples folded into the channels)."""
    transposed = isinstance(module, ConvTranspose)
    output_padding = [0] * len(module.kernel_size)
    if transposed:
        padding, output_padding = _per_dim(module, module.padding), _output_padding(module, x, grad_output)
    elif module.padding_mode != "zeros" or isinstance(module.padding, str):
        x, padding = _padded(module, x), output_padding
    else:
        padding = _per_dim(module, module.padding)
    shape = _weight_shape(module)
    with _full_float32(x, x.dtype):
        _, grads, _ = torch.ops.aten.convolution_backward(
            grad_output,
            x,
            x.new_empty((copies * shape[0], *shape[1:])),  # (read for its shape)
            None,
            _per_dim(module, module.stride),
            padding,
            _per_dim(module, module.dilation),
            transposed,
            output_padding,
            copies * module.groups,
            [False, True, False],
        )
    return grads


def _folded(x: Tensor, dtype: torch.dtype, spatial: int) -> Tensor:
    """`[B, c, *S]` -> `[1, B * c, *S]`, or `[B, k, c, *S]` (k rows per sample) -> `[k, B * c, *S]`: the samples in
    the channels, their rows the convolution's batch (over which its weight gradient sums). Row-major strides, also
    in size-1 dims (a tensor contiguous but for the stride of a size-1 dim made CPU's transposed convolution refuse
    its own weight gradient)."""
    rows = x if x.dim() == spatial + 3 else x.unsqueeze(1)
    folded = cast(rows, dtype).transpose(0, 1).reshape(rows.shape[1], -1, *rows.shape[3:])
    strides = [math.prod(folded.shape[i + 1 :]) for i in range(folded.dim())]
    return folded if list(folded.stride()) == strides else folded.clone(memory_format=torch.contiguous_format)


def _output_padding(module: ConvTranspose, x: Tensor, grad_output: Tensor) -> list[int]:
    """The output padding of this call: `module.output_padding`, or what `forward(x, output_size=...)` chose."""
    return [
        out - ((size - 1) * s - 2 * p + d * (k - 1) + 1)
        for out, size, s, p, d, k in zip(
            grad_output.shape[2:],
            x.shape[2:],
            _per_dim(module, module.stride),
            _per_dim(module, module.padding),
            _per_dim(module, module.dilation),
            module.kernel_size,
            strict=True,
        )
    ]


def _weight_shape(module: Conv | ConvTranspose) -> tuple[int, ...]:
    """`[o, c/g, *k]`, transposed `[c, o/g, *k]`: from the layer's settings, not its weight (under FSDP a shard)."""
    inputs, outputs = module.in_channels, module.out_channels
    first, second = (inputs, outputs) if isinstance(module, ConvTranspose) else (outputs, inputs)
    return (first, second // module.groups, *module.kernel_size)


def _full_float32(x: Tensor, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """cuDNN without TF32 for a float32 convolution on CUDA; elsewhere nothing."""
    return ieee_float32_convolutions() if x.is_cuda and dtype == torch.float32 else contextlib.nullcontext()


def _batched(module: Conv | ConvTranspose, x: Tensor) -> Tensor:
    """x `[B, c, *S]`, or `[B, k, c, *S]` where the engine found k rows per sample (frames folded into the batch)."""
    spatial = len(module.kernel_size)
    if x.dim() not in (spatial + 2, spatial + 3):
        raise FlashDPError(
            f"Wrong shape: {type(module).__name__} expects a batched input [B, C, ...] with {spatial + 2} dims. "
            f"Received {x.dim()} dims {tuple(x.shape)}. Add the batch dimension."
        )
    return x


def _bias(module: Conv | ConvTranspose, grad_output: Tensor, trainable: frozenset[str]) -> dict[str, PerSampleGrad]:
    """`[B, o]`: the output gradient `[B, (k,) o, *S]` summed over each sample's rows and positions."""
    if "bias" not in trainable:
        return {}
    channels = grad_output.dim() - len(module.kernel_size) - 1
    return {"bias": sum_over_positions(grad_output.movedim(channels, -1), 1)}


def _per_dim(module: Conv | ConvTranspose, value: int | Sequence[int]) -> list[int]:
    """A stride, padding or dilation as one int per spatial dim: the constructor makes them so, an assignment after
    it may hold one int (or a sequence of one) for all, which the forward reads alike."""
    values = list(value) if isinstance(value, Sequence) else [value]
    return values * len(module.kernel_size) if len(values) == 1 else values


def _padded(module: Conv, x: Tensor) -> Tensor:
    """The input as the convolution sees it: explicitly padded ('same', 'valid', ints, any padding_mode)."""
    pad = _explicit_padding(module)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, pad, mode=mode) if any(pad) else x


def _explicit_padding(module: Conv) -> list[int]:
    """The padding the forward applies, as F.pad's pairs from the last dim. A padding mode other than zeros pads by
    the pairs the constructor computed (`_reversed_padding_repeated_twice`, stale after an assignment, as the
    forward reads them); zeros pads by `padding` as it is at the call: ints, 'valid', or 'same' for the call's
    dilation (the extra position of an odd total on the right)."""
    if module.padding_mode != "zeros":
        return list(module._reversed_padding_repeated_twice)
    if module.padding == "valid":
        return [0] * 2 * len(module.kernel_size)
    if module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(_per_dim(module, module.dilation), module.kernel_size, strict=True)]
        return [p for total in reversed(totals) for p in (total // 2, total - total // 2)]
    return _pad_pairs(module, module.padding)


def _pad_pairs(module: Conv | ConvTranspose, padding: int | Sequence[int]) -> list[int]:
    """A padding of each spatial dim on both sides, as F.pad's pairs from the last dim."""
    return [p for size in reversed(_per_dim(module, padding)) for p in (size, size)]


def _unfold(x: Tensor, module: Conv | ConvTranspose, groups: int, positions: Sequence[int] | None = None) -> Tensor:
    """`[B, c, *S]` -> the convolution's windows per sample and group, `[B * g, P, c/g * prod(k)]` (channel-major,
    as the weight is laid out), contiguous: one copy, and the clipped sum's GEMM and the ghost norm's Gram
    matrices read it as it is. Only the first `positions` windows per spatial dim, where given (a transposed
    convolution's output_padding can leave windows past its input)."""
    spatial = len(module.kernel_size)
    x = x.unflatten(1, (groups, -1))  # [B, g, c/g, *S]
    dilation, stride = _per_dim(module, module.dilation), _per_dim(module, module.stride)
    for i, (k, d, s) in enumerate(zip(module.kernel_size, dilation, stride, strict=True)):
        x = x.unfold(3 + i, (k - 1) * d + 1, s)[..., ::d]  # appends this dim's window
        if positions is not None:
            x = x.narrow(3 + i, 0, positions[i])
    count = math.prod(x.shape[3 : 3 + spatial])
    order = [0, 1, *range(3, 3 + spatial), 2, *range(3 + spatial, 3 + 2 * spatial)]
    return x.permute(order).reshape(x.shape[0] * groups, count, -1)


def _per_sample_blocks(block: OuterGrad, batch: int) -> OuterGrad:
    """A block of the rows `(b, j, group)` (k rows j per sample) as one of `(b, group)` over the k rows' positions
    together: a sample's gradient sums its rows'."""
    rows = block.right.shape[0] // (batch * block.conv_groups)
    if rows == 1:
        return block

    def merged(factor: Tensor) -> Tensor:
        by_row = factor.unflatten(0, (batch, rows, block.conv_groups)).transpose(1, 2)
        return by_row.reshape(batch * block.conv_groups, -1, factor.shape[-1])

    return OuterGrad(merged(block.left), merged(block.right), conv_groups=block.conv_groups)


def _grouped(grad: Tensor, windows: Tensor, groups: int) -> OuterGrad:
    """The output-side factor `[B, o, *S]` and the windows `[B * g, P, c/g * k]` as one Linear per group."""
    left = rearrange(grad.flatten(2), "b (g o) p -> (b g) p o", g=groups)
    return OuterGrad(left, windows, conv_groups=groups)


for _conv in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    register_rule(_conv, conv_grads)
for _transposed in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    register_rule(_transposed, conv_transpose_grads)
