"""No tensor created on the wrong device. Training runs with `torch.set_default_device("meta")` while the model and
data sit on the CPU: a tensor flashdp creates without an explicit device lands on `meta` and fails loudly, as one
created on the CPU would meet a model on `cuda:0`. Every run is compared with the same run without it."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import flashdp
from flashdp.audit import CanaryAudit
from flashdp.kernels import triton_unavailable_reason
from tests.distributed import workloads
from tests.distributed.launch import run
from tests.test_hf_models import VOCAB, gpt2


@contextlib.contextmanager
def default_device_meta():
    previous = torch.get_default_device()  # (CUDA where the suite runs there)
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(previous)


class Positions(nn.Module):
    """A position embedding looked up with `[1, T]` ids and broadcast over the batch (a shared output)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(13, 8), nn.Embedding(6, 8)
        self.norm, self.rnn, self.head = nn.LayerNorm(8), nn.GRU(8, 8), nn.Linear(8, 3)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        h = self.norm(self.tokens(ids) + self.positions(positions))
        h, _ = self.rnn(h.transpose(0, 1))  # time-major
        return self.head(h.transpose(0, 1)).sum((1, 2))


def _train(model: nn.Module, steps: list[torch.Tensor], meta: bool, **options) -> tuple[list, list]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"seed": None if options.get("secure_rng") else 3, **options}
    engine = flashdp.make_private(
        model, max_grad_norm=0.5, noise_multiplier=0.7, optimizer=optimizer, expected_batch_size=4,
        sample_rate=0.1, self_check=1, **options,
    )  # fmt: skip
    norms = []
    with default_device_meta() if meta else contextlib.nullcontext():
        for ids in steps:
            norms.append(engine.backward(model(ids)) if len(ids) else engine.backward_empty())
            engine.step()
        norms.append(engine.per_sample_norms(model(steps[0]), per_parameter=True))
        epsilon = engine.epsilon(1e-5)
    engine.detach()
    return norms, [p.detach().clone() for p in model.parameters()] + [epsilon]


def _steps() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 13, (b, 6), generator=generator) for b in (4, 1, 0, 6, 3)]


MODES = ["bk", "ghost"] + (["flash"] if triton_unavailable_reason() is None else [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "options", [{}, {"clipping": "per_layer"}, {"nonfinite": "skip"}, {"secure_rng": True}], ids=str
)
def test_training_creates_no_tensor_on_the_default_device(mode, options):
    if mode != "bk" and options.get("nonfinite") == "skip":
        options = {**options, "clipping": "per_layer"}  # (skip needs bk or per-layer clipping)
    torch.manual_seed(0)
    model = Positions()
    expected_norms, expected = _train(copy.deepcopy(model), _steps(), meta=False, mode=mode, **options)
    norms, got = _train(model, _steps(), meta=True, mode=mode, **options)
    if options.get("secure_rng"):  # (the noise is not reproducible: the norms of the first step are)
        torch.testing.assert_close(norms[0], expected_norms[0])
        return
    torch.testing.assert_close(norms, expected_norms)
    torch.testing.assert_close(got, expected)


def test_a_hugging_face_model_and_the_canary_audit_create_no_tensor_on_the_default_device():
    model = gpt2()
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = flashdp.make_private(
        model, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=3, sample_rate=0.5
    )
    with default_device_meta():
        audit = CanaryAudit(engine, canaries=20, seed=0)
        for _ in range(2):
            engine.backward(flashdp.per_sample_lm_loss(model(ids).logits, ids))
            engine.step()
        result = audit.result(delta=1e-5)
    assert result.epsilon_claimed > 0
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_user_level_training_creates_no_tensor_on_the_default_device(mode):
    """(Found on CUDA: the users' grouping and the user loader built their indices on the default device, so with
    `torch.set_default_device("cuda")` user-level training failed on its first step.)"""
    ids = torch.randint(0, 13, (12, 6), generator=torch.Generator().manual_seed(0))
    examples, users = torch.arange(12), [u % 5 for u in range(12)]

    def train(meta: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Positions()
        engine = flashdp.make_private(
            model, mode=mode, max_grad_norm=0.5, noise_multiplier=0.7, expected_batch_size=3, sample_rate=0.5,
            seed=3, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        )  # fmt: skip
        with default_device_meta() if meta else contextlib.nullcontext():
            loader = engine.data_loader(examples, steps=3, users=users, examples_per_user=2)
            assert len(list(loader.batch_sampler)) == 3  # (iterating the DataLoader itself draws a seed on it)
        batches = [(ids[rows], step_users) for rows, step_users in loader]
        with default_device_meta() if meta else contextlib.nullcontext():
            for x, step_users in batches:
                if len(x):
                    engine.backward(model(x), users=step_users)
                else:
                    engine.backward_empty()
                engine.step()
        return [p.detach().clone() for p in model.parameters()]

    torch.testing.assert_close(train(meta=True), train(meta=False))


def _ddp_rank(rank: int, mode: str) -> dict:
    model = workloads.build_model()
    ids = workloads.global_batch()[rank * 4 : rank * 4 + 4]
    wrapped = workloads.wrap(model, "ddp")
    with default_device_meta():
        norms = workloads.train(model, wrapped, ids, mode, noise=0.0, micro=3)
    return {"norms": norms, "params": workloads.full_params(wrapped)}


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_ddp_creates_no_tensor_on_the_default_device(mode):
    ranks = run(_ddp_rank, mode)
    expected_norms, expected = workloads.single_process(mode)
    torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=1e-5, atol=1e-6)
    for rank in ranks:
        torch.testing.assert_close(rank["params"], expected, rtol=1e-5, atol=1e-6)


class SeesTheDefaultDevice(nn.Module):
    """A module the generic rule counts, noting where a tensor made without a device lands in each run of its
    forward: the recorded one, and the rule's re-runs inside the backward. A parameter of its own (no rule counts
    it); or, `flipped`, a Linear's run on the rows in reverse order, so that the module is recorded as a scope and
    counted by the generic rule only once the Linear's rows are found not to be samples."""

    def __init__(self, flipped: bool):
        super().__init__()
        self.flipped, self.inner = flipped, nn.Linear(3, 2, device="cpu")
        self.weight = nn.Parameter(torch.randn(3, 2, device="cpu"), requires_grad=not flipped)
        self.inner.requires_grad_(flipped)
        self.seen: list[torch.device] = []

    def forward(self, x):
        self.seen.append(torch.empty(0).device)
        return self.inner(x.flip(0)).flip(0) if self.flipped else x @ self.weight


@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_forward_run_again_in_the_backward_runs_under_the_forwards_default_device(mode, flipped):
    """(On CUDA as the default device, a model's forward re-run by the generic rule made its tensors on the CPU:
    the backward runs outside `torch.set_default_device`'s mode, so a sparse matrix built in the forward met its
    inputs on another device and the model was refused.) The re-runs enter the forward's default device."""
    sees = SeesTheDefaultDevice(flipped)
    model = nn.Sequential(nn.Linear(3, 3, device="cpu"), sees)  # (its output gradient is handed over in the pass)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    with engine, default_device_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore", flashdp.FlashDPWarning)
        engine.backward(model(torch.randn(4, 3, device="cpu")).sum(1))
    assert len(sees.seen) > 1, "the generic rule re-ran the forward"
    assert set(sees.seen) == {torch.device("meta")}
