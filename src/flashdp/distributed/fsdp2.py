"""FSDP2 (`fully_shard`): parameters are DTensors sharded on dim 0 over a 1-D mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import Tensor, nn

from flashdp.distributed.adapter import Adapter, reduce_scatter_sum, refuse_hybrid_sharding
from flashdp.scan import TrainableParam


def is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


class FSDP2Adapter(Adapter):
    """The norm pass runs with `set_requires_gradient_sync(False)`; the ghost second pass lets FSDP2
    reduce-scatter (its mean, so the loss is scaled by the world size); bk sums are reduce-scattered into each
    shard parameter by parameter; each rank noises its own shard with its own generator.
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        mesh = next(p for p in model.parameters()).device_mesh
        refuse_hybrid_sharding("FSDP2", mesh.ndim)
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

    def accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        """Reduce-scatter this rank's full-shape clipped sum into the local dim-0 shard of the DTensor's grad."""
        from torch.distributed.tensor import DTensor

        dtensor = param.param
        rows = clipped_sum.shape[0]
        chunk = -(-rows // self.world_size)
        padded = clipped_sum.new_zeros(chunk * self.world_size, *clipped_sum.shape[1:])
        padded[:rows] = clipped_sum
        shard = padded.new_empty(chunk, *clipped_sum.shape[1:])
        with self.timer.phase("communication"):
            reduce_scatter_sum(shard, padded, self.group)
        local_rows = max(0, min(chunk, rows - self.rank * chunk))
        local = shard[:local_rows].to(dtensor.dtype)
        if dtensor.grad is None:
            dtensor.grad = DTensor.from_local(
                local.contiguous(), dtensor.device_mesh, dtensor.placements, shape=dtensor.shape,
                stride=dtensor.stride(),
            )  # fmt: skip
        else:
            dtensor.grad.to_local().add_(local)

    def local_grad(self, param: Tensor) -> Tensor:
        return param.grad.to_local()

    def noise_seed(self, seed: int) -> int:
        return seed + 7919 * self.rank  # independent noise per shard
