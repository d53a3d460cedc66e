"""A logical batch split over data-parallel ranks (DPTrainer on several processes): each rank takes every
`world`-th row (or user), in micro-batches, AS MANY on every rank and none empty, so that every rank runs the same
forward and backward passes (their collectives must match) on models that cannot run a forward on zero rows (HF
transformers). A micro-batch a rank has no rows for is one padding row instead, run through
`engine.backward_padding`: its loss weighted by exactly 0, its gradient exactly zero (checked), it adds nothing and
counts as no sample (nor user).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flashdp._pipeline.users import UserGroups
from flashdp.data import micro_batches


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
    batch: dict[str, Any],
    rank: int,
    world: int,
    max_size: int,
    padding_row: Callable[[], dict[str, Any]],
    users_key: str | None = None,
) -> Iterator[Piece]:
    """This rank's micro-batches of the logical `batch` (the same on every rank): rows `rank::world`, or with
    `users_key` (user-level clipping) the rows of every `world`-th user (users in order of first appearance, each
    whole on one rank and in one micro-batch); at most `max_size` rows per micro-batch, as many micro-batches as the
    rank that needs most (at least one). `padding_row()` gives the one-row batch that stands in for a micro-batch
    this rank has no rows for."""
    size = batch_size(batch)
    owners = _owners(batch, size, world, users_key)
    mine = _micro_batches(batch, size, owners == rank, max_size, users_key)
    # how many micro-batches each rank runs, counted on the row ids (and users) alone, not on copies of its rows
    ids = {"row": torch.arange(size, device=_device(batch))} | (
        {} if users_key is None else {users_key: batch[users_key]}
    )
    most = max(len(_micro_batches(ids, size, owners == r, max_size, users_key)) for r in range(world))
    for micro in mine:
        yield Piece(micro, batch_size(micro))
    for _ in range(max(1, most) - len(mine)):
        yield Piece(padding_row(), 0)


def _owners(batch: dict[str, Any], size: int, world: int, users_key: str | None) -> Tensor:
    """`[size]` the rank each row goes to: row i to rank i % world, or its user's (by first appearance)."""
    if users_key is None:
        return torch.arange(size, device="cpu") % world
    return UserGroups.of(batch[users_key], size, torch.device("cpu")).index % world


def _micro_batches(
    batch: dict[str, Any], size: int, mine: Tensor, max_size: int, users_key: str | None
) -> list[dict[str, Any]]:
    """The non-empty micro-batches of the rows `mine` (`[size]` bool), a user's rows in one."""
    share = _rows(batch, size, mine.nonzero().flatten().to(_device(batch)))
    users = None if users_key is None else share[users_key]
    return [micro for micro in micro_batches(share, max_size, users=users) if batch_size(micro)]


def _device(batch: dict[str, Any]) -> torch.device:
    return next(v.device for v in batch.values() if isinstance(v, Tensor))


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


def _rows(batch: dict[str, Any], size: int, rows: slice | Tensor) -> dict[str, Any]:
    """The batch's rows `rows` (a slice or indices): every tensor with `size` rows indexed, anything else as it is."""
    return {k: v[rows] if isinstance(v, Tensor) and v.dim() and len(v) == size else v for k, v in batch.items()}
