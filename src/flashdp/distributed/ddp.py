"""DistributedDataParallel: replicated parameters, one all-reduce of the clipped sums per step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flashdp._pipeline.profiling import PhaseTimer
from flashdp.distributed.base import Adapter
from flashdp.distributed.checks import for_backend
from flashdp.errors import FlashDPError
from flashdp.privacy.keyed import KEY_BITS

#: 32-bit words of a noise seed sent from the first rank: a secret key's bits
_SEED_WORDS = KEY_BITS // 32


class DDPAdapter(Adapter):
    """DDP's own bucketed all-reduce is switched off while the engine is attached (it would average partial,
    unclipped gradients, and expects every parameter's gradient in the backward after each forward); the engine
    sums the clipped gradients itself, once per step, and every rank draws the same noise.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, timer: PhaseTimer, broadcast_noise: bool) -> None:
        super().__init__(timer)
        if getattr(ddp, "static_graph", False):
            raise FlashDPError(
                "DDP(static_graph=True): a static graph's reducer expects the same gradient hooks in every "
                "backward, and flashdp runs backward passes of its own (the norm pass, the checks) with DDP's sync "
                "off. Construct DDP without static_graph (flashdp all-reduces the clipped sums itself, once a step)."
            )
        self.ddp = ddp
        self.broadcast_noise = broadcast_noise
        self.dp_group = ddp.process_group
        self.world_size = dist.get_world_size(self.dp_group)
        self._sync_before = ddp.require_backward_grad_sync

    def attach(self) -> None:
        self.ddp.require_backward_grad_sync = False

    def reduce_gradients(self, params: list[Tensor]) -> None:
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def noise_seed(self, seed: int) -> int:
        """The first rank's seed (a user's, or a 256-bit key), sent as 32-bit words."""
        words = [(seed >> (32 * i)) & 0xFFFFFFFF for i in range(_SEED_WORDS)]
        shared = for_backend(torch.tensor(words, dtype=torch.int64, device="cpu"), self.dp_group)
        dist.broadcast(shared, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        return sum(int(word) << (32 * i) for i, word in enumerate(shared.tolist()))

    def shared_noise(self, noise: Tensor) -> Tensor:
        """Equal seeds already give equal noise; the OS CSPRNG (secure_rng) does not, so rank 0's is sent."""
        if self.broadcast_noise:
            dist.broadcast(noise, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        return noise

    def detach(self) -> None:
        self.ddp.require_backward_grad_sync = self._sync_before
