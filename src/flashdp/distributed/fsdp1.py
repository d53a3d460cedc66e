"""FSDP1 (`FullyShardedDataParallel`), with `use_orig_params` True or False.

FSDP1 keeps each unit's parameters in one flat parameter: the unit's flattened parameters concatenated (with
alignment padding when use_orig_params=True), padded to a multiple of the world size and sharded into equal
contiguous slices. flashdp reads that layout from FSDP1 internals unchanged since torch 2.1, all of them in
`_read_layout`, which fails with one clear error if they move.

- norm pass: under `no_sync()` of every root unit (it computes no parameter gradient anyway).
- one backward only: FSDP1 removes its gradient hooks in the callback that ends a backward, so a second
  backward over the same forward would not reduce-scatter. ghost and flash therefore take their clipped sums
  from what the norm pass recorded, as bk does; the result is the same.
- clipped sums: laid out in a buffer the size of the unit's unsharded flat parameter and reduce-scattered (SUM)
  into flashdp's own sharded gradient (`_Unit.grad`): one unit at a time, every unit on every backward (see
  ShardedAdapter). step() makes it the flat parameter's .grad.
- noise: each rank adds it to its shard of every flat parameter, from its own generator.
- limit: FSDP1 reshards a unit in the hook that follows its gradient accumulation, which the norm pass never
  reaches, so units gathered for the norm pass stay gathered until that pass ends (FSDP2 has no such limit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from flashdp._pipeline.params import ParamView, TrainableParam
from flashdp._pipeline.profiling import PhaseTimer
from flashdp.distributed.sharded import ShardedAdapter
from flashdp.errors import FlashDPError
from flashdp.per_sample import accumulation_dtype


@dataclass
class _Unit:
    """One FSDP1 unit's flat parameter: where each original parameter sits in its unsharded form."""

    flat_param: nn.Parameter
    shard_numel: int
    offsets: list[int]  # per original parameter, its start in the unsharded flat parameter
    numels: list[int]
    shapes: list[torch.Size]
    trainable: set[int]  # indices of the original parameters that require grad
    #: makes a tensor `[shard numel]` the flat parameter's .grad, as FSDP1's post-backward would (see `_exposer`)
    expose: Callable[[Tensor], None]
    #: [shard numel] this step's reduced clipped sums, made the flat parameter's .grad by `step()` only: between
    #: backwards the flat parameter (and the original parameters) hold no .grad, so that FSDP1's forward finds
    #: nothing to write back (with use_orig_params it zeroes, in place, the part of a .grad that belongs to a frozen
    #: parameter) and its pre-backward nothing to save for its post-backward, which flashdp's norm pass never runs
    grad: Tensor | None = None


@dataclass(frozen=True)
class _Layout:
    units: list[_Unit]
    use_orig_params: bool
    #: id(module) -> attribute name -> (unit index, parameter index); tied parameters map to their first owner
    where: dict[int, dict[str, tuple[int, int]]]
    flat_param_ids: set[int]


class FSDP1Adapter(ShardedAdapter):
    allows_second_pass = False

    def __init__(self, model: nn.Module, timer: PhaseTimer) -> None:
        wrapped = FSDP.fsdp_modules(model)
        for unit in wrapped:
            if unit.sharding_strategy != ShardingStrategy.FULL_SHARD:
                raise FlashDPError(
                    f"flashdp supports FSDP1 with sharding_strategy FULL_SHARD; this model uses "
                    f"{unit.sharding_strategy.name}. flashdp's backward runs under no_sync(), where SHARD_GRAD_OP "
                    "keeps the gathered parameters after the backward, so the next forward would not see the "
                    "optimizer's update. Use FULL_SHARD, or FSDP2 (fully_shard, with reshard_after_forward=False "
                    "for SHARD_GRAD_OP's behaviour); for NO_SHARD use DistributedDataParallel; hybrid sharding is "
                    "not supported."
                )
        self.roots = FSDP.fsdp_modules(model, root_only=True)
        dp_group = wrapped[0].process_group
        self.layout = _read_layout(wrapped, dist.get_world_size(dp_group))
        super().__init__(timer, dp_group, [sorted(unit.trainable) for unit in self.layout.units])

    def param_views(self, module: nn.Module) -> dict[str, ParamView]:
        units = self.layout.units
        views = {
            name: ParamView(getattr(module, name), (u, i), units[u].shapes[i])
            for name, (u, i) in self.layout.where.get(id(module), {}).items()
            if i in units[u].trainable
        }
        unmanaged = [
            n for n, p in module._parameters.items()
            if p is not None and p.requires_grad and n not in views and id(p) not in self.layout.flat_param_ids
        ]  # fmt: skip
        if unmanaged:
            raise FlashDPError(
                f"{type(module).__name__} has trainable parameters {unmanaged} that FSDP1 does not manage (ignored "
                "modules or parameters), so no rank would sum their gradients. Freeze them or let FSDP1 shard them."
            )
        return views

    def named_parameters(self, model: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """Also the flat parameter of each unit whose parameters all train, which with use_orig_params no module
        registers: the leaf of the graph under every parameter of the unit. One reached through a view no recorded
        call held (a module called by `module.forward(x)`, a weight read by `F.linear` where its layer is not
        called) is then a use the coverage walk refuses, not one it cannot name and skips (it was: such parameters
        got no gradient, silently). Not where the unit holds a frozen parameter, whose views no call holds either
        and which the walk must let pass: there the gap stays (docs/distributed.md)."""
        registered = list(model.named_parameters())
        yield from registered
        seen = {id(p) for _, p in registered}
        for number, unit in enumerate(self.layout.units):
            if id(unit.flat_param) not in seen and len(unit.trainable) == len(unit.numels):
                yield f"<FSDP1 unit {number}'s flat parameter>", unit.flat_param

    def holds_own(self, param: TrainableParam, tensor: object) -> bool:
        """A contiguous view of the unit's flat parameter at the parameter's place and shape: FSDP1 gives each module
        new views for every forward (the weight's transpose put in its place is a view there too, not contiguous:
        a breaker's 0.6 C before that was checked)."""
        unit_index, index = param.key
        unit = self.layout.units[unit_index]
        return (
            isinstance(tensor, Tensor)
            and tensor._base is unit.flat_param
            and tensor.storage_offset() - unit.flat_param.storage_offset() == unit.offsets[index]
            and tensor.shape == unit.shapes[index]
            and tensor.is_contiguous()
        )

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for root in self.roots:
                stack.enter_context(root.no_sync())
            yield

    def unit_of(self, param: TrainableParam) -> tuple[int, Hashable]:
        return param.key

    def zero_sum(self, u: int, key: Hashable) -> Tensor:
        flat = self.layout.units[u].flat_param
        return flat.new_zeros(self.layout.units[u].numels[key], dtype=accumulation_dtype(flat))

    def reduce_scatter_unit(self, u: int, sums: dict[Hashable, Tensor]) -> None:
        """The unit's sums laid out as its unsharded flat parameter `[shard numel * world]`, reduce-scattered."""
        unit = self.layout.units[u]
        flat = unit.flat_param  # (its dtype, not the sums': the same on every rank)
        buffer = flat.new_zeros(unit.shard_numel * self.world_size, dtype=accumulation_dtype(flat))
        for i, clipped_sum in sums.items():
            buffer[unit.offsets[i] : unit.offsets[i] + unit.numels[i]] = clipped_sum.reshape(-1)
        shard = buffer.new_empty(unit.shard_numel)
        self.reduce_scatter(shard, buffer)
        unit.grad = shard.to(unit.flat_param.dtype) if unit.grad is None else unit.grad.add_(shard.to(unit.grad.dtype))

    def gradient_holders(self, params: list[TrainableParam]) -> list[Tensor]:
        return [unit.flat_param for unit in self.layout.units if unit.trainable]

    def accumulated_gradients(self, params: list[TrainableParam]) -> list[tuple[str, Tensor | None]]:
        """Per unit, the accumulated shard, and the flat parameter's .grad; with use_orig_params the original
        parameters' .grad: those are None between backwards unless someone else wrote them."""
        units = [
            (f"FSDP1 flat parameter {u}{part}", grad)
            for u, unit in enumerate(self.layout.units)
            if unit.trainable
            for part, grad in (("", unit.grad), (" (.grad)", unit.flat_param.grad))
        ]
        return units + ([(p.name, p.param.grad) for p in params] if self.layout.use_orig_params else [])

    def reduce_gradients(self, params: list[Tensor]) -> None:
        for unit in self.layout.units:  # the sums are reduced already; step() made zeros where no backward reached
            if unit.trainable:
                if unit.grad is None:
                    unit.grad = unit.flat_param.grad
                unit.expose(unit.grad)  # (with use_orig_params the original parameters' .grad: views into it)

    def zero_grad(self) -> None:
        for unit in self.layout.units:
            unit.flat_param.grad = unit.grad = None


def _read_layout(wrapped: list[nn.Module], world_size: int) -> _Layout:
    """Every FSDP1 internal flashdp relies on, read once; one clear error if this torch moved any of them."""
    try:
        units, where = [], {}
        fsdps = [m for m in wrapped if m._handle is not None]
        use_orig_params = fsdps[0]._use_orig_params
        for u, fsdp in enumerate(fsdps):
            flat = fsdp._handle.flat_param
            units.append(_read_unit(fsdp, flat, world_size))
            for i, info in enumerate(flat._param_infos):
                where.setdefault(id(info.module), {})[info.param_name] = (u, i)
            for info in flat._shared_param_infos:
                first_owner = where[id(info.prim_module)][info.prim_param_name]
                where.setdefault(id(info.module), {})[info.param_name] = first_owner
    except (AttributeError, KeyError, ValueError) as problem:
        raise FlashDPError(
            f"This torch's FSDP1 flat parameters do not have the layout flashdp reads ({problem}). Shard the model "
            "with FSDP2 (torch.distributed.fsdp.fully_shard) instead."
        ) from problem
    return _Layout(units, use_orig_params, where, {id(unit.flat_param) for unit in units})


def _read_unit(fsdp: nn.Module, flat: nn.Parameter, world_size: int) -> _Unit:
    numels = list(flat._numels)
    offsets, position = [], 0
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
        if not is_padding:
            offsets.append(position)
        position += numel
    if fsdp._use_orig_params:
        trainable = {i for i, p in enumerate(flat._params) if p.requires_grad}
    else:
        trainable = set(range(len(numels))) if flat.requires_grad else set()
    shapes = [torch.Size(s) for s in flat._shapes]
    shard_numel = flat._sharded_size.numel()
    consistent = len(offsets) == len(numels) == len(flat._param_infos) == len(shapes)
    if not consistent or position > shard_numel * world_size:
        raise ValueError("inconsistent parameter metadata")
    return _Unit(flat, shard_numel, offsets, numels, shapes, trainable, _exposer(fsdp, flat, trainable))


def _exposer(fsdp: nn.Module, flat: nn.Parameter, trainable: set[int]) -> Callable[[Tensor], None]:
    """What FSDP1's post-backward does with a reduced gradient shard, which flashdp's norm pass never reaches
    (no parameter gradient flows through FSDP1's hooks): the shard becomes the flat parameter's .grad, the one
    FSDP1 saved at the backward's start to accumulate into is dropped (else FSDP1 keeps showing that stale one,
    from an earlier micro-batch or step, through the original parameters' .grad), and with use_orig_params every
    trainable parameter's .grad is a view into the shard, which is checked."""
    handle, orig = fsdp._handle, fsdp._use_orig_params
    params, in_shard = (list(flat._params), [i.in_shard for i in flat._shard_param_infos]) if orig else ([], [])
    none_mask = flat._is_grad_none_mask if orig else None

    def expose(grad: Tensor) -> None:
        flat.grad = grad
        if hasattr(flat, "_saved_grad_shard"):
            del flat._saved_grad_shard
        if not orig:
            return
        for i in trainable:
            none_mask[i] = False  # (every trainable parameter got a gradient, as FSDP1's post-backward assumes)
        handle._use_sharded_grad_views()
        storage = grad.untyped_storage().data_ptr()
        stale = [
            i for i in trainable
            if in_shard[i] and (params[i].grad is None or params[i].grad.untyped_storage().data_ptr() != storage)
        ]  # fmt: skip
        if stale:
            raise FlashDPError(
                f"FSDP1 (use_orig_params=True) did not point the .grad of {len(stale)} original parameter(s) at the "
                "gradient flashdp computed: this torch's FSDP1 moved an internal flashdp relies on, and the optimizer "
                "would step with another gradient. Shard the model with FSDP2 (fully_shard) instead."
            )

    return expose
