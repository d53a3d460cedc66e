"""Matrix-multiply FLOPs of a function, counted by `torch.utils.flop_counter.FlopCounterMode` without its module
tracker (its global forward hooks would have flashdp compare each layer's output with its rule's forward, a hook run
before the engine's may have changed it, and count those comparisons too), and with a convolution's weight gradient
counted per group (torch's formula ignores groups: flashdp's per-sample convolution gradients, one convolution with
the batch folded into the groups, came out B times their cost)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_backward_flop


class _Global:
    """In place of the module tracker: every FLOP counted under "Global" only."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _Global:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _convolution_backward(grad_out_shape, x_shape, w_shape, *args, out_shape, **kwargs) -> int:
    """torch's count, the weight gradient's replaced: each of its elements sums over the batch and the output
    positions (of the input's, for a transposed convolution)."""
    *rest, output_mask = args
    flops = conv_backward_flop(
        grad_out_shape, x_shape, w_shape, *rest, [output_mask[0], False, False], out_val=out_shape
    )
    if output_mask[1]:
        transposed = rest[4]
        positions = math.prod((x_shape if transposed else grad_out_shape)[2:])
        flops += 2 * math.prod(w_shape) * grad_out_shape[0] * positions
    return flops


def counted_flops(run: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """The total FLOPs of `run()`, and per op."""
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.convolution_backward: _convolution_backward}
    )
    counter.mod_tracker = _Global()
    with counter:
        run()
    per_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), per_op
