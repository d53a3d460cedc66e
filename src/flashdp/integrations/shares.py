"""A logical batch split over data-parallel ranks (DPTrainer on several processes): each rank takes every
`world`-th row, in micro-batches, AS MANY on every rank and none empty, so that every rank runs the same forward and
backward passes (their collectives must match) on models that cannot run a forward on zero rows (HF transformers).
A micro-batch a rank has no rows for is one padding row instead, run through `engine.backward_padding`: its loss
weighted by exactly 0, its gradient exactly zero (checked), it adds nothing and counts as no sample.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Piece:
    """One micro-batch of this rank: `rows` real rows; with rows = 0, a padding row (several processes) or an empty
    micro-batch (one process)."""

    inputs: dict[str, Any]
    rows: int


def batch_size(inputs: dict[str, Any]) -> int:
    """The rows of a batch: the leading dim of its tensors."""
    return next(len(v) for v in inputs.values() if isinstance(v, Tensor))


def rank_pieces(
    batch: dict[str, Any], rank: int, world: int, max_size: int, padding_row: Callable[[], dict[str, Any]]
) -> Iterator[Piece]:
    """This rank's micro-batches of the logical `batch` (the same on every rank): rows `rank::world`, at most
    `max_size` per micro-batch, as many micro-batches as the rank with the most rows needs (at least one);
    `padding_row()` gives the one-row batch that stands in for a micro-batch this rank has no rows for."""
    size = batch_size(batch)
    share = _rows(batch, size, slice(rank, None, world))
    share_size = len(range(rank, size, world))
    largest = -(-size // world)  # rank 0's share
    for piece in range(max(1, -(-largest // max_size))):
        start = piece * max_size
        if start < share_size:
            part = slice(start, min(start + max_size, share_size))
            yield Piece(_rows(share, share_size, part), part.stop - part.start)
        else:
            yield Piece(padding_row(), 0)


@contextlib.contextmanager
def untouched_rng() -> Iterator[None]:
    """Inside, draws from torch's CPU generator, Python's `random` and numpy's global generator are undone after:
    a padding row collated on one process only must not shift the draws every process makes alike."""
    python_state = random.getstate()
    numpy = _numpy()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(python_state)
    if numpy is not None:
        numpy.random.set_state(numpy_state)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def first_row(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's first row, as a batch of one."""
    return _rows(batch, batch_size(batch), slice(0, 1))


def _rows(batch: dict[str, Any], size: int, rows: slice) -> dict[str, Any]:
    """The batch's rows `rows`: every tensor with `size` rows sliced, anything else as it is."""
    return {k: v[rows] if isinstance(v, Tensor) and v.dim() and len(v) == size else v for k, v in batch.items()}
