"""Where the batch is in each recorded call's outputs, told from sizes alone: the facts a forward structure is keyed
on, and the questions the layout learning asks (`learning.py`). Pure functions of the plan and the calls' shapes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import nn

from flashdp._pipeline.norm_pass import batch_dims
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError, another_rank_refused
from flashdp.per_sample import OutputMeta


class CallShape(NamedTuple):
    """What a forward structure records of one call (not the call, whose tensors the norm pass frees)."""

    module: nn.Module
    output_meta: tuple


def shapes_of(calls: list[Call]) -> list[CallShape]:
    return [CallShape(call.module, call.output_meta) for call in calls]


def lacks_batch(shape: torch.Size, dim: int, batch: int) -> bool:
    """No batch dim: the size there is neither B nor B * k rows (k per sample)."""
    return len(shape) <= dim or shape[dim] % batch != 0


def dims_of(plan: GradientPlan, call: Call | CallShape) -> tuple[int, ...]:
    """The batch dim of each of the call's outputs, as its site's rule reads them."""
    return batch_dims(plan.site(call.module), call)


class Output(NamedTuple):
    """One recorded output of a rule site's call, with the dim its rule reads the batch in."""

    call: int
    index: int
    meta: OutputMeta
    dim: int


def outputs(plan: GradientPlan, calls: Sequence[Call | CallShape]) -> Iterator[Output]:
    """Every output of the calls of rule sites (a scope only encloses them), in call order."""
    for i, call in enumerate(calls):
        if plan.site(call.module).match is not None:
            for j, (meta, dim) in enumerate(zip(call.output_meta, dims_of(plan, call), strict=True)):
                yield Output(i, j, meta, dim)


def structure(plan: GradientPlan, shapes: list[CallShape], batch: int) -> tuple:
    """What a verified layout rests on: the modules called, in order, and for each output of a rule site's call its
    number of dims, the dim its rule reads the batch in, and whether its size there is a multiple of B (a batch, or
    B * k rows) or not (shared across the batch, or mis-shaped). A step whose sizes fall the other way, whose output
    has other dims (a position embedding of `[T]` ids, `[T, d]`, where `[B, T]` ids gave `[B, T, d]`), or whose
    layer has since been learnt time-major (a structure verified with its batch in dim 0 says nothing of dim 1) is
    a new structure, verified again. For a batch of one (or none) only the modules: every layout gives its one
    sample all rows, so only what covers each parameter's uses matters, and it is known once these modules were
    verified on a larger batch."""
    if batch < 2:
        return tuple(id(call.module) for call in shapes)
    return tuple(_call_layout(plan, call, batch) for call in shapes)


def _call_layout(plan: GradientPlan, call: CallShape, batch: int) -> tuple[int, tuple[tuple[int, int, bool], ...]]:
    if plan.site(call.module).match is None:  # a scope: only encloses rule sites
        return id(call.module), ()
    dims = dims_of(plan, call)
    return id(call.module), tuple(
        (len(m.shape), d, lacks_batch(m.shape, d, batch)) for m, d in zip(call.output_meta, dims, strict=True)
    )


#: a reading of an output's gradient by sample: the shape it is viewed in, and the dim of that shape that is the batch
Reading = tuple[torch.Size, int]


def other_readings(plan: GradientPlan, call: Call, batch: int) -> tuple[tuple[Reading, ...], ...]:
    """Per output of a rule site's call, the other places the batch could be than where its rule reads it: each
    other dim of size B (for a position-wise rule, before its features: time-major with T == B, a convolution or
    an attention over the batch), and for B * k rows read sample-major, the same rows read interleaved (a
    time-major `[T, B, d]` flattened to `[T * B, d]`). A verifying pass under which one of them passes too (token
    masks that leave each time step to one sample make time steps look like samples) cannot tell where the batch
    is, nor whether the layer mixes samples: it decides nothing, and refuses the step where the layer computes
    across its rows or the layout was learnt on this backward (`Verifying.undecidable`)."""
    dims, position_wise = dims_of(plan, call), plan.site(call.module).match.rule.position_wise
    return tuple(
        _other_readings(m.shape, dim, batch, position_wise) for m, dim in zip(call.output_meta, dims, strict=True)
    )


def _other_readings(shape: torch.Size, dim: int, batch: int, position_wise: bool) -> tuple[Reading, ...]:
    readings = [(shape, d) for d in range(len(shape) - position_wise) if d != dim and shape[d] == batch]
    rows = shape[dim] if dim < len(shape) else 0
    if rows > batch and rows % batch == 0:  # (B * k rows: sample-major, or k blocks of B interleaved)
        readings.append((torch.Size([*shape[:dim], rows // batch, batch, *shape[dim + 1 :]]), dim + 1))
    return tuple(readings)


def time_major_dim(plan: GradientPlan, call: Call, batch: int, later: bool = True) -> int | None:
    """For a call of a position-wise rule whose outputs have the batch in another dim than the one it was told (a
    time-major `[T, B, d]` call), the first dim before the features where every output has size B, after the
    one it was told (`later`: a layout failing where it fits by size, tried in order), or any other (a call
    that does not fit: a batch-first call of a layer learnt time-major)."""
    site = plan.site(call.module)
    if not site.match.rule.position_wise:
        return None
    current = dims_of(plan, call)[0]
    shapes = [meta.shape for meta in call.output_meta]
    dims = [d for d in range(max(len(s) for s in shapes) - 1) if all(len(s) > d and s[d] == batch for s in shapes)]
    return next((d for d in dims if d > current or (not later and d != current)), None)


#: a call whose batch dim sizes alone cannot tell: (label, output shape, the dims of size B, or [] for an output
#: that fits the batch by size but that a later op broadcasts over the batch)
Ambiguous = tuple[str, torch.Size, list[int]]


def ambiguous(plan: GradientPlan, shapes: list[CallShape], batch: int) -> list[Ambiguous]:
    """The rule site calls with B in more than one dim before the features (where only a verifying pass, which
    FSDP1 cannot run, tells which is the batch)."""
    found = []
    for out in outputs(plan, shapes) if batch > 1 else ():
        shape = out.meta.shape
        dims = {d for d in range(len(shape) - 1) if shape[d] == batch}
        if not lacks_batch(shape, out.dim, batch):
            dims.add(out.dim)
        if len(dims) > 1:
            found.append((plan.site(shapes[out.call].module).label, shape, sorted(dims)))
    return found


def ambiguous_error(found: list[Ambiguous]) -> FlashDPError:
    """Under FSDP1: the layers whose batch dim sizes cannot tell (or, where this rank found none, another's)."""
    if not found:
        return another_rank_refused()
    label, shape, dims = found[0]
    more = f" (and {len(found) - 1} more layers)" if len(found) > 1 else ""
    if dims:
        why = (
            f"has this rank's batch size in dims {dims}{more}: the batch could be any of them (batch-first "
            "[B, T, ...], or time-major [T, B, ...] with T equal to B)"
        )
    else:
        why = (
            f"fits the batch by size (B or a multiple of B rows in dim 0){more}, yet a later op broadcasts it over "
            "the batch: it may be shared by every sample (a position embedding of [T] ids with T a multiple of B)"
        )
    return FlashDPError(
        f"Under FSDP1, which cannot run flashdp's verifying pass, a layer's batch dim is told by size alone, and the "
        f"output of layer {label}, of shape {tuple(shape)}, {why}. Nothing was added to .grad. Use FSDP2 "
        "(fully_shard) or DDP, where flashdp verifies the layout; or give every rank a batch size that differs "
        "from these sizes (e.g. pad the sequence to another length)."
    )
