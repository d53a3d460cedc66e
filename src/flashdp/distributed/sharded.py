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
    """A unit is one FSDP-wrapped module. Its clipped sums go to `reduce_scatter_unit(unit, sums)` as soon as all
    its trainable parameters have arrived, in arrival order (the forward's, the same on every rank);
    `accumulation_done()` hands over, in unit order, the units the forward left incomplete. So one collective per
    unit, and full-size sums are held one unit at a time.
    """

    reshards_after_forward = True

    def __init__(self, timer: PhaseTimer, dp_group: dist.ProcessGroup, trainable: list[set[Hashable]]) -> None:
        super().__init__(timer)
        self.dp_group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        #: per unit, the keys of its trainable parameters
        self.trainable = trainable
        self._pending: dict[int, dict[Hashable, Tensor]] = {}

    @abc.abstractmethod
    def unit_of(self, param: TrainableParam) -> tuple[int, Hashable]:
        """The parameter's unit, and its key within it."""

    @abc.abstractmethod
    def reduce_scatter_unit(self, unit: int, sums: dict[Hashable, Tensor]) -> None:
        """Reduce-scatter (SUM) a unit's full-size clipped sums into this rank's shards of its gradients."""

    def accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        unit, key = self.unit_of(param)
        sums = self._pending.setdefault(unit, {})
        sums[key] = clipped_sum
        if sums.keys() >= self.trainable[unit]:
            self.reduce_scatter_unit(unit, self._pending.pop(unit))

    def accumulation_done(self) -> None:
        for unit in sorted(self._pending):
            self.reduce_scatter_unit(unit, self._pending.pop(unit))

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
