"""Data-parallel training: what changes when the model is wrapped by DDP or sharded by FSDP2 (`fully_shard`) or
FSDP1 (`FullyShardedDataParallel`).

Per-sample norms are LOCAL: DDP replicates and FSDP shards parameters, never a sample's activations, so each
rank's hooks see its own samples whole. Norms are never all-reduced over data-parallel ranks (that inflates them
by sqrt(world size)); only gradients are summed, once, and noise is added once per coordinate.

- `base.py`: the adapter interface, and the single process.
- `ddp.py`: replicated parameters; one all-reduce of the clipped sums per step, the same noise everywhere.
- `sharded.py`: what FSDP2 and FSDP1 share: per-unit reduce-scatter of the clipped sums, noise per shard.
- `fsdp2.py`: DTensor shards. `fsdp1.py`: flat-parameter shards.
- `checks.py`: set-ups that would clip or average wrongly, refused with what to do instead.
"""

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from flashdp._pipeline.profiling import PhaseTimer
from flashdp.distributed.base import Adapter
from flashdp.distributed.ddp import DDPAdapter
from flashdp.distributed.fsdp1 import FSDP1Adapter
from flashdp.distributed.fsdp2 import FSDP2Adapter, is_fsdp2

__all__ = ["Adapter", "adapter_for"]


def adapter_for(model: nn.Module, timer: PhaseTimer, secure_rng: bool = False) -> Adapter:
    """The adapter for how `model` is wrapped; it only inspects the wrapper until `attach()`."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPAdapter(model, timer, broadcast_noise=secure_rng)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return FSDP1Adapter(model, timer)
    if is_fsdp2(model):
        return FSDP2Adapter(model, timer)
    return Adapter(timer)
