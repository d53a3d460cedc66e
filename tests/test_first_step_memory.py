"""The steps that check (the first, which verifies the layout and runs the self-check, and each later self-check)
need no more memory than a non-private step: their passes run before the norm pass, hold nothing of it, and do not
keep a checkpointed region's recomputation. Memory is the allocator's own record of the step, replayed (exact and
deterministic on CPU, not a timing)."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import flashdp
from benchmarks.memory import step_peak_mib

VOCAB, D, T = 256, 32, 128
#: the most a checked step may hold above a non-private step (the allocator's rounding and small bookkeeping)
SLACK = 1.05


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Activations far above the parameters' size, as in the long-context runs the check is about."""

    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.checkpointing = checkpointing

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointing else block(h)
        return self.head(h)


def _losses(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _peaks(model: nn.Module, ids: torch.Tensor, mode: str | None, steps: int) -> list[float]:
    """The peak memory of each of `steps` training steps (MiB above what is held when the step starts)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode is None:

        def step() -> None:
            _losses(model, ids).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    else:
        engine = flashdp.make_private(
            model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer,
            expected_batch_size=len(ids), sample_rate=0.01, self_check=2,
        )  # fmt: skip

        def step() -> None:
            engine.backward(_losses(model, ids))
            engine.step()

    return [step_peak_mib(step, "cpu") for _ in range(steps)]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_checked_steps_need_no_more_memory_than_a_non_private_step(mode, checkpointing, batch):
    torch.manual_seed(0)
    model = TinyLM(checkpointing)
    ids = torch.randint(0, VOCAB, (batch, T + 1))
    non_private = max(_peaks(copy.deepcopy(model), ids, None, 2))
    # steps 0 and 2 self-check (the first also verifies the layout), 1 and 3 do not
    private = _peaks(model, ids, mode, 4)
    assert max(private) <= SLACK * non_private, (private, non_private)
