"""Passes over a checkpointed forward's graph that do not read the recorded calls' inputs.

A call recorded inside a non-reentrant checkpointed region keeps its inputs packed by the region's saved-tensor
hooks (`Call.packed`). Each backward pass recomputes the region, and the recomputation holds the tensor of every
packed handle until that handle is unpacked in the same pass. A pass that never reads the calls' inputs (the
verification's passes, the self-check's) would so hold every region's recomputed inputs until the calls are
released: the activations that checkpointing exists not to keep. `releasing_packed_inputs` unpacks each call's
inputs as the pass reaches the call and drops them, so a region's recomputation lives no longer than in a plain
backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from flashdp._pipeline.recorder import Call


@contextlib.contextmanager
def releasing_packed_inputs(calls: Sequence[Call]) -> Iterator[None]:
    """Within: each packed call's inputs are unpacked, and dropped, when a pass first reaches one of its outputs
    (in each pass run within)."""
    handles = []
    for call in calls:
        if call.packed:
            release = _Release(call)
            handles += [node.register_prehook(release) for node in {edge.node for edge in call.edges}]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Release:
    """A pre-hook on a call's output nodes: unpacks the call's inputs the first time one of them runs in a pass."""

    def __init__(self, call: Call) -> None:
        self.call, self.released_in = call, -1

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        graph_task = torch._C._current_graph_task_id()  # (a checkpoint keys its recomputations by it)
        if graph_task != self.released_in:
            self.released_in = graph_task
            self.call.unpacked()  # (the unpacked inputs are dropped here: this pass's handles are released)
