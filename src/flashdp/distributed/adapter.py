"""The single-process adapter, the interface every wrapper's adapter implements, and the choice among them.

- single process: everything local, one noise generator.
- DDP (`ddp.py`): replicated parameters; one all-reduce of the clipped sums per step, the same noise everywhere.
- FSDP2 (`fsdp2.py`): DTensor shards; per-parameter reduce-scatter of the clipped sums, noise per shard.
- FSDP1 (`fsdp1.py`): flat-parameter shards; per-unit reduce-scatter of the clipped sums, noise per shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable

import torch.distributed as dist
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.profiling import PhaseTimer
from flashdp.scan import ParamView, TrainableParam, local_param_views


class Adapter:
    """A single process: gradients are local and whole."""

    world_size = 1
    #: the data-parallel group, whose ranks hold different samples (None: one process)
    group: dist.ProcessGroup | None = None
    #: the engine's PhaseTimer; collectives are timed as "communication"
    timer = PhaseTimer(False)
    #: whether ghost and flash may run a second backward over the graph of the norm pass
    second_backward = True

    def param_views(self, module: nn.Module) -> dict[str, ParamView]:
        """The module's own trainable parameters, with their full shapes and identities."""
        return local_param_views(module)

    def attach(self) -> None:
        """Change what the engine needs changed on the wrapper (`detach()` restores it)."""

    def norm_pass(self) -> contextlib.AbstractContextManager:
        """Around the norm pass: no gradient collective may run in it."""
        return contextlib.nullcontext()

    @property
    def second_pass_scale(self) -> float:
        """Loss factor of the ghost second pass, so that the wrapper's gradient reduction yields the SUM."""
        return 1.0

    def accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        """`grad += clipped_sum` (this rank's samples, full parameter shape) where the optimizer will read it."""
        add_to_grad(param.param, clipped_sum)

    def accumulation_done(self) -> None:
        """After the last `accumulate` of one backward."""

    def gradient_holders(self, params: list[TrainableParam]) -> list[Tensor]:
        """The tensors whose `.grad` step() noises and averages: every trainable coordinate once."""
        return [p.param for p in params]

    def reduce_gradients(self, params: list[Tensor]) -> None:
        """At step(), before the noise: make every rank's gradient the sum over all ranks' samples."""

    def local_grad(self, param: Tensor) -> Tensor:
        """The part of `param.grad` this rank adds noise to."""
        return param.grad

    def noise_seed(self, seed: int) -> int:
        """The seed of this rank's noise generator, from this process's seed."""
        return seed

    def shared_noise(self, noise: Tensor) -> Tensor:
        """Noise that must be equal on every rank holding the same coordinates is made so here."""
        return noise

    def zero_grad(self) -> None:
        """After `optimizer.zero_grad()`: clear gradients the optimizer does not see."""

    def detach(self) -> None:
        """Undo what attaching changed on the wrapper."""


def add_to_grad(param: Tensor, value: Tensor) -> None:
    """`param.grad += value`, creating it in the parameter's dtype."""
    if param.grad is None:
        param.grad = value.to(param.dtype)
    else:
        param.grad.add_(value.to(param.grad.dtype))


class PerUnitSums:
    """One backward's clipped sums grouped by the wrapper's unit (an FSDP-wrapped module).

    A unit goes to `reduce(unit, sums)` as soon as all its trainable parameters have arrived, in arrival order
    (the forward's, the same on every rank); `finish()` hands over, in unit order, the units the forward left
    incomplete. So one collective per unit, and full-size sums are held one unit at a time.
    """

    def __init__(self, trainable: list[set[Hashable]], reduce: Callable[[int, dict[Hashable, Tensor]], None]) -> None:
        self.trainable = trainable
        self.reduce = reduce
        self.pending: dict[int, dict[Hashable, Tensor]] = {}

    def add(self, unit: int, key: Hashable, clipped_sum: Tensor) -> None:
        sums = self.pending.setdefault(unit, {})
        sums[key] = clipped_sum
        if sums.keys() >= self.trainable[unit]:
            self.reduce(unit, self.pending.pop(unit))

    def finish(self) -> None:
        for unit in sorted(self.pending):
            self.reduce(unit, self.pending.pop(unit))


def reduce_scatter_sum(output: Tensor, input: Tensor, group: dist.ProcessGroup) -> None:
    """`output` = this rank's 1 / world slice (along dim 0) of the sum over ranks of `input`."""
    # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in recent torch
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group)


def adapter_for(model: nn.Module, secure_rng: bool = False) -> Adapter:
    """The adapter for how `model` is wrapped; it only inspects the wrapper until `attach()`."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from flashdp.distributed.ddp import DDPAdapter
    from flashdp.distributed.fsdp1 import FSDP1Adapter
    from flashdp.distributed.fsdp2 import FSDP2Adapter, is_fsdp2

    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPAdapter(model, broadcast_noise=secure_rng)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return FSDP1Adapter(model)
    if is_fsdp2(model):
        return FSDP2Adapter(model)
    return Adapter()


def refuse_hybrid_sharding(what: str, ndim: int) -> None:
    if ndim != 1:
        raise FlashDPError(
            f"flashdp supports {what} over one data-parallel group; this model is sharded over a {ndim}-D mesh "
            "(hybrid sharding). Shard over one group, or for tensor parallelism pass norm_group= for the group "
            "that splits each sample."
        )
