"""One adapter per topology: single process, DistributedDataParallel, FSDP2.

- single process: everything local, one noise generator.
- DDP: DDP's own gradient sync is off while attached (forward and backward); ghost and bk sums are local; at
  step() one all-reduce (sum) of every gradient; the same noise on every rank.
- FSDP2: the norm pass runs with `set_requires_gradient_sync(False)`; the ghost second pass lets FSDP2
  reduce-scatter (its mean, so the loss is scaled by the world size); bk sums are reduce-scattered into each
  shard layer by layer; each rank noises its own shard with its own generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.profiling import PhaseTimer


class Adapter:
    """A single process: gradients are local and whole."""

    world_size = 1
    #: the engine's PhaseTimer; collectives are timed as "communication"
    timer = PhaseTimer(False)

    def norm_pass(self) -> contextlib.AbstractContextManager:
        """Around the norm pass: no gradient collective may run in it."""
        return contextlib.nullcontext()

    @property
    def second_pass_scale(self) -> float:
        """Loss factor of the ghost second pass, so that the wrapper's gradient reduction yields the SUM."""
        return 1.0

    def accumulate(self, param: nn.Parameter, clipped_sum: Tensor) -> None:
        """`param.grad += clipped_sum` (this rank's samples, full parameter shape)."""
        if param.grad is None:
            param.grad = clipped_sum.to(param.dtype)
        else:
            param.grad.add_(clipped_sum.to(param.grad.dtype))

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """At step(), before the noise: make every rank's gradient the sum over all ranks' samples."""

    def local_grad(self, param: nn.Parameter) -> Tensor:
        """The part of `param.grad` this rank adds noise to."""
        return param.grad

    def noise_seed(self, seed: int) -> int:
        """The seed of this rank's noise generator, from this process's seed."""
        return seed

    def shared_noise(self, noise: Tensor) -> Tensor:
        """Noise that must be equal on every rank holding the same coordinates is made so here."""
        return noise

    def detach(self) -> None:
        """Undo what attaching changed on the wrapper."""


class DDPAdapter(Adapter):
    """DistributedDataParallel: replicated parameters.

    DDP's own bucketed all-reduce is switched off while the engine is attached (it would average partial,
    unclipped gradients, and expects every parameter's gradient in the backward after each forward); the engine
    sums the clipped gradients itself, once per step, and every rank draws the same noise.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, broadcast_noise: bool) -> None:
        self.ddp = ddp
        self.broadcast_noise = broadcast_noise
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self._sync_before = ddp.require_backward_grad_sync
        ddp.require_backward_grad_sync = False

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def noise_seed(self, seed: int) -> int:
        shared = torch.tensor([seed], dtype=torch.int64)
        dist.broadcast(shared, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(shared.item())

    def shared_noise(self, noise: Tensor) -> Tensor:
        """Equal seeds already give equal noise; the OS CSPRNG (secure_rng) does not, so rank 0's is sent."""
        if self.broadcast_noise:
            dist.broadcast(noise, src=dist.get_global_rank(self.group, 0), group=self.group)
        return noise

    def detach(self) -> None:
        self.ddp.require_backward_grad_sync = self._sync_before


class FSDP2Adapter(Adapter):
    """FSDP2 (`fully_shard`): parameters are DTensors sharded on dim 0 over a 1-D mesh."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        mesh = next(p for p in model.parameters()).device_mesh
        if mesh.ndim != 1:
            raise FlashDPError(
                f"flashdp supports FSDP2 over a 1-D device mesh (data parallel); this model's mesh has {mesh.ndim} "
                "dims. For tensor parallelism pass norm_group= for the group that splits each sample."
            )
        self.group = mesh.get_group()
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        for module in self.fsdp_modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in self.fsdp_modules:
                module.set_requires_gradient_sync(True, recurse=False)

    @property
    def second_pass_scale(self) -> float:
        return float(self.world_size)  # FSDP2 reduce-scatters the mean over ranks

    def accumulate(self, param: nn.Parameter, clipped_sum: Tensor) -> None:
        """Reduce-scatter this rank's full-shape clipped sum into the local dim-0 shard of `param.grad`."""
        from torch.distributed.tensor import DTensor

        rows = clipped_sum.shape[0]
        chunk = -(-rows // self.world_size)
        padded = clipped_sum.new_zeros(chunk * self.world_size, *clipped_sum.shape[1:])
        padded[:rows] = clipped_sum
        shard = padded.new_empty(chunk, *clipped_sum.shape[1:])
        with self.timer.phase("communication"):
            dist.reduce_scatter_tensor(shard, padded, op=dist.ReduceOp.SUM, group=self.group)
        local_rows = max(0, min(chunk, rows - self.rank * chunk))
        local = shard[:local_rows].to(param.dtype)
        if param.grad is None:
            param.grad = DTensor.from_local(
                local.contiguous(), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
        else:
            param.grad.to_local().add_(local)

    def local_grad(self, param: nn.Parameter) -> Tensor:
        return param.grad.to_local()

    def noise_seed(self, seed: int) -> int:
        return seed + 7919 * self.rank  # independent noise per shard


def adapter_for(model: nn.Module, secure_rng: bool = False) -> Adapter:
    """The adapter for how `model` is wrapped; a clear error for wrappers flashdp does not support yet."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPAdapter(model, broadcast_noise=secure_rng)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise FlashDPError(
            "The model is wrapped by FSDP1 (FullyShardedDataParallel), which flashdp does not support yet. Shard it "
            "with FSDP2 instead (torch.distributed.fsdp.fully_shard), or use DistributedDataParallel."
        )
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return Adapter()
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return FSDP2Adapter(model)
    return Adapter()
