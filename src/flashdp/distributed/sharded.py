"""What the sharded wrappers (FSDP2, FSDP1) share: clipped sums reduce-scattered into the shards one unit at a
time, and independent noise on every rank's own shard."""

from __future__ import annotations

import abc
from collections.abc import Hashable

import torch.distributed as dist
from torch import Tensor

from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.profiling import PhaseTimer
from flashdp.distributed.base import Adapter
from flashdp.errors import FlashDPError


class ShardedAdapter(Adapter, abc.ABC):
    """A unit is one FSDP-wrapped module. Every backward reduce-scatters every unit with trainable parameters once,
    in unit order, whatever this rank's loss reached: the parameters arrive sorted by unit (`accumulation_order`),
    a unit goes to `reduce_scatter_unit(unit, sums)` once a later unit's parameter arrives (or at
    `accumulation_done()`), with zeros for the parameters that did not arrive. So every rank runs the same
    collectives in the same order even where its batch reaches other layers than another rank's (an expert no
    token of this rank was routed to, a branch taken on one rank only), and full-size sums are held one unit at a
    time.
    """

    reshards_after_forward = True

    def __init__(self, timer: PhaseTimer, dp_group: dist.ProcessGroup, trainable: list[list[Hashable]]) -> None:
        super().__init__(timer)
        self.dp_group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        #: per unit, the keys of its trainable parameters, in an order the same on every rank
        self.trainable = trainable
        self._pending: dict[Hashable, Tensor] = {}  # the current unit's sums
        self._unit = 0  # the unit being accumulated: those before it are reduce-scattered

    @abc.abstractmethod
    def unit_of(self, param: TrainableParam) -> tuple[int, Hashable]:
        """The parameter's unit, and its key within it."""

    @abc.abstractmethod
    def reduce_scatter_unit(self, unit: int, sums: dict[Hashable, Tensor]) -> None:
        """Reduce-scatter (SUM) a unit's full-size clipped sums, one per trainable parameter of the unit in
        `self.trainable[unit]`'s order (zeros where this rank has none), into this rank's shards of its
        gradients."""

    @abc.abstractmethod
    def zero_sum(self, unit: int, key: Hashable) -> Tensor:
        """The full-size clipped sum of a parameter this rank's loss did not reach: zeros."""

    def accumulation_order(self, param: TrainableParam) -> int:
        return self.unit_of(param)[0]

    def accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        unit, key = self.unit_of(param)
        if unit < self._unit:
            raise RuntimeError(f"flashdp: a clipped sum of unit {unit} arrived after unit {self._unit}'s")
        self._reduce_scatter_units_before(unit)
        self._pending[key] = clipped_sum

    def accumulation_done(self) -> None:
        self._reduce_scatter_units_before(len(self.trainable))
        self._unit = 0

    def _reduce_scatter_units_before(self, end: int) -> None:
        """Reduce-scatter units `[self._unit, end)` that have trainable parameters, each once, in unit order."""
        for unit in range(self._unit, end):
            if self.trainable[unit]:
                sums, self._pending = self._pending, {}
                every = {key: sums[key] if key in sums else self.zero_sum(unit, key) for key in self.trainable[unit]}
                self.reduce_scatter_unit(unit, every)
        self._unit = max(self._unit, end)

    def reduce_scatter(self, output: Tensor, input: Tensor) -> None:
        """`output` = this rank's 1 / world slice (along dim 0) of the sum over ranks of `input`."""
        # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in recent torch
        collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        with self.timer.phase("communication"):
            collective(output, input, op=dist.ReduceOp.SUM, group=self.dp_group)

    def noise_seed(self, seed: int) -> int:
        return seed + 7919 * self.rank  # independent noise per shard


def refuse_hybrid_sharding(what: str, ndim: int) -> None:
    if ndim != 1:
        raise FlashDPError(
            f"flashdp supports {what} over one data-parallel group; this model is sharded over a {ndim}-D mesh "
            "(hybrid sharding). Shard over one group, or for tensor parallelism pass norm_group= for the group "
            "that splits each sample."
        )
