"""Data-parallel training: what changes when the model is wrapped by DDP or sharded by FSDP2 (`fully_shard`).

Per-sample norms are LOCAL: DDP replicates and FSDP shards parameters, never a sample's activations, so each
rank's hooks see its own samples whole. Norms are never all-reduced over data-parallel ranks (that inflates them
by sqrt(world size)); only gradients are summed, once, and noise is added once per coordinate.
"""

from flashdp.distributed.adapter import Adapter, adapter_for

__all__ = ["Adapter", "adapter_for"]
