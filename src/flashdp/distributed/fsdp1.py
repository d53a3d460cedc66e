"""FSDP1 (`FullyShardedDataParallel`), with `use_orig_params` True or False.

FSDP1 keeps each unit's parameters in one flat parameter: the unit's flattened parameters concatenated (with
alignment padding when use_orig_params=True), padded to a multiple of the world size and sharded into equal
contiguous slices. flashdp reads that layout from the flat parameter's metadata (`_param_infos`, `_shapes`,
`_numels_with_padding`, ...), FSDP1 internals unchanged since torch 2.1; `_layout` fails loudly if they move.

- norm pass: under `no_sync()` of every root unit (it computes no parameter gradient anyway).
- one backward only: FSDP1 removes its gradient hooks in the callback that ends a backward, so a second
  backward over the same forward would not reduce-scatter. ghost and flash therefore take their clipped sums
  from what the norm pass recorded, as bk does; the result is the same.
- clipped sums: once the unit's last trainable parameter has arrived, laid out in a buffer the size of the
  unit's unsharded flat parameter and reduce-scattered (SUM) into the sharded flat gradient: one unit at a time.
- noise: each rank adds it to its shard of every flat parameter, from its own generator.
- limit: FSDP1 reshards a unit in the hook that follows its gradient accumulation, which the norm pass never
  reaches, so units gathered for the norm pass stay gathered until that pass ends (FSDP2 has no such limit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flashdp.distributed.adapter import Adapter, PerUnitSums, reduce_scatter_sum
from flashdp.errors import FlashDPError
from flashdp.scan import ParamView, TrainableParam


@dataclass
class _Unit:
    """One FSDP1 unit's flat parameter: where each original parameter sits in its unsharded form."""

    fsdp: nn.Module
    flat_param: nn.Parameter
    shard_numel: int
    offsets: list[int]  # per original parameter, its start in the unsharded flat parameter
    numels: list[int]
    trainable: set[int]  # indices of the original parameters that require grad
    #: [shard numel] this step's reduced clipped sums. The flat parameter's .grad is set to it after every
    #: backward, but FSDP1's forward and backward hooks may move or drop that .grad in between: this is the truth.
    grad: Tensor | None = None

    @property
    def handle(self):
        return self.fsdp._handle


class FSDP1Adapter(Adapter):
    second_backward = False

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        units = [u for u in FSDP.fsdp_modules(model) if u._handle is not None]
        for unit in units:
            if unit.sharding_strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
                raise FlashDPError(
                    f"flashdp supports FSDP1 with sharding_strategy FULL_SHARD or SHARD_GRAD_OP; this model uses "
                    f"{unit.sharding_strategy.name}. For NO_SHARD use DistributedDataParallel; hybrid sharding is "
                    "not supported."
                )
        self.roots = FSDP.fsdp_modules(model, root_only=True)
        self.group = units[0].process_group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.use_orig_params = units[0]._use_orig_params
        self.units = [_layout(unit) for unit in units]
        # id(module) -> attribute name -> (unit index, parameter index); tied parameters map to their first owner
        self._where: dict[int, dict[str, tuple[int, int]]] = {}
        for u, unit in enumerate(self.units):
            flat = unit.flat_param
            for i, info in enumerate(flat._param_infos):
                self._where.setdefault(id(info.module), {})[info.param_name] = (u, i)
            for info in flat._shared_param_infos:
                prim = self._where[id(info.prim_module)][info.prim_param_name]
                self._where.setdefault(id(info.module), {})[info.param_name] = prim
        self._sums = PerUnitSums([unit.trainable for unit in self.units], self._reduce_scatter)

    def param_views(self, module: nn.Module) -> dict[str, ParamView]:
        from torch.distributed.fsdp._flat_param import FlatParameter

        views = {
            name: ParamView(getattr(module, name), (u, i), torch.Size(self.units[u].flat_param._shapes[i]))
            for name, (u, i) in self._where.get(id(module), {}).items()
            if i in self.units[u].trainable
        }
        unmanaged = [
            n for n, p in module._parameters.items()
            if p is not None and p.requires_grad and n not in views and not isinstance(p, FlatParameter)
        ]  # fmt: skip
        if unmanaged:
            raise FlashDPError(
                f"{type(module).__name__} has trainable parameters {unmanaged} that FSDP1 does not manage (ignored "
                "modules or parameters), so no rank would sum their gradients. Freeze them or let FSDP1 shard them."
            )
        return views

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for root in self.roots:
                stack.enter_context(root.no_sync())
            yield

    def accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        u, i = param.key
        self._sums.add(u, i, clipped_sum)

    def accumulation_done(self) -> None:
        self._sums.finish()

    def _reduce_scatter(self, u: int, sums: dict[int, Tensor]) -> None:
        """The unit's sums laid out as its unsharded flat parameter `[shard numel * world]`, reduce-scattered."""
        unit = self.units[u]
        flat = unit.flat_param
        buffer = next(iter(sums.values())).new_zeros(unit.shard_numel * self.world_size)
        for i, clipped_sum in sums.items():
            buffer[unit.offsets[i] : unit.offsets[i] + unit.numels[i]] = clipped_sum.reshape(-1)
        shard = buffer.new_empty(unit.shard_numel)
        with self.timer.phase("communication"):
            reduce_scatter_sum(shard, buffer, self.group)
        unit.grad = shard.to(flat.dtype) if unit.grad is None else unit.grad.add_(shard.to(unit.grad.dtype))
        self._expose(unit)

    def _expose(self, unit: _Unit) -> None:
        """Make the accumulated shard the flat parameter's .grad; with use_orig_params=True the optimizer reads
        the original parameters' .grad, views into it."""
        unit.flat_param.grad = unit.grad
        if self.use_orig_params:
            unit.handle._use_sharded_grad_views()

    def gradient_holders(self, params: list[TrainableParam]) -> list[Tensor]:
        return [unit.flat_param for unit in self.units if unit.trainable]

    def reduce_gradients(self, params: list[Tensor]) -> None:
        for unit in self.units:  # the sums are reduced already; step() made zeros where no backward reached
            if unit.trainable:
                if unit.grad is None:
                    unit.grad = unit.flat_param.grad
                self._expose(unit)

    def noise_seed(self, seed: int) -> int:
        return seed + 7919 * self.rank  # independent noise per shard

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.flat_param.grad = unit.grad = None


def _layout(fsdp: nn.Module) -> _Unit:
    flat = fsdp._handle.flat_param
    try:
        shard_numel = flat._sharded_size.numel()
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
        consistent = len(offsets) == len(numels) == len(flat._param_infos) == len(flat._shapes)
    except AttributeError as missing:
        consistent, problem = False, str(missing)
    else:
        problem = "inconsistent parameter metadata"
    if not consistent or position > shard_numel * dist.get_world_size(fsdp.process_group):
        raise FlashDPError(
            f"This torch's FSDP1 flat parameters do not have the layout flashdp reads ({problem}). Shard the model "
            "with FSDP2 (torch.distributed.fsdp.fully_shard) instead."
        )
    return _Unit(fsdp, flat, shard_numel, offsets, numels, trainable)
