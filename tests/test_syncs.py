"""Host-device synchronisations in a steady-state step, counted on the CPU: every operation that makes the host wait
for a GPU (a value read back, a size that depends on data, a copy to the host).

The budget: TWO per `engine.backward` and none per `engine.step()` on one process. The first reads the losses'
finiteness before the forward's calls are taken (a refused loss leaves the forward to a backward on a fixed one,
and no pass runs on NaN). The second reads, together, the rules' checks of their recomputations (attention,
recurrent, generic) and the squared norms' finiteness: the norms must be known finite before anything is clipped
(a float32 overflow is recomputed in float64, a NaN refused or skipped). Under DDP or FSDP the step adds one (the
global batch size checked against expected_batch_size) and nonfinite="error" one (every rank stops together). The
first backward of a forward structure and each self-check take more: they compare values.
On CUDA, `torch.cuda.set_sync_debug_mode("warn")` reports the same (see benchmarks/gpu/CHECKLIST.md)."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import flashdp
from flashdp.kernels import triton_unavailable_reason
from tests.oracle import seeded

#: operations that wait for the device: values read to the host, sizes that depend on data, copies to the host
SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.cpu,
    torch.Tensor.numpy, torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
    torch.unique_consecutive,
}  # fmt: skip
#: operations that wait only with a tensor of repeats (an int gives a known size)
SYNCING_WITH_TENSOR_REPEATS = {torch.Tensor.repeat_interleave, torch.repeat_interleave}


class Syncs(TorchFunctionMode):
    """Counts the syncing operations called from flashdp's code, by file and line."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        repeats = args[1] if len(args) > 1 else (kwargs or {}).get("repeats")
        if func in SYNCING or (func in SYNCING_WITH_TENSOR_REPEATS and isinstance(repeats, torch.Tensor)):
            ours = [f for f in traceback.extract_stack()[:-1] if "/flashdp/" in f.filename]
            if ours:
                self.sites[f"{ours[-1].filename.rpartition('/flashdp/')[2]}:{ours[-1].lineno} {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


class Wide(nn.Module):
    """A layer of every dedicated rule kind: embeddings (one shared across the batch), a grouped convolution,
    normalisations, attention, a recurrent layer, and a generic-rule layer (PReLU)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(50, 16, padding_idx=0), nn.Embedding(8, 16)
        self.conv, self.group_norm = nn.Conv1d(16, 16, 3, padding=1, groups=2), nn.GroupNorm(4, 16)
        self.norm, self.attention = nn.LayerNorm(16), nn.MultiheadAttention(16, 2, batch_first=True)
        self.rnn, self.rms = nn.GRU(16, 16, batch_first=True), nn.RMSNorm(16)
        self.act, self.head = nn.PReLU(), nn.Linear(16, 5)

    def forward(self, ids):
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device)[None])
        h = self.group_norm(self.conv(h.transpose(1, 2))).transpose(1, 2)
        h = self.norm(h)
        h, _ = self.attention(h, h, h)
        h, _ = self.rnn(h)
        return self.head(self.act(self.rms(h))).mean((1, 2))


MODES = ["bk", "ghost"] + (["flash"] if triton_unavailable_reason() is None else [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("options", [{}, {"clipping": "per_layer", "nonfinite": "skip"}], ids=str)
def test_a_steady_step_waits_for_the_device_twice_per_backward(mode, options):
    torch.manual_seed(0)
    model = Wide()
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=torch.optim.SGD(model.parameters()),
        expected_batch_size=4, sample_rate=0.1, **options,
    )  # fmt: skip
    ids = torch.randint(0, 50, (4, 6), generator=seeded(0))
    for _ in range(2):  # the first verifies the forward structure and runs the self-check
        engine.backward(model(ids))
        engine.step()
    loss = model(ids)
    with Syncs() as backward:
        engine.backward(loss)
    with Syncs() as step:
        engine.step()
    assert sum(backward.sites.values()) == 2, dict(backward.sites)
    assert not step.sites, dict(step.sites)


def test_the_count_sees_flashdps_syncs_and_only_flashdps():
    from flashdp._pipeline import nonfinite

    with Syncs() as counted:
        assert nonfinite.all_finite(torch.ones(2))  # (bool() of a device tensor, in flashdp)
        assert bool(torch.ones(2).all())  # (in this file: the model's or the user's, not counted)
    assert list(counted.sites.values()) == [1]
    assert next(iter(counted.sites)).startswith("_pipeline/nonfinite.py:")
