"""Sampling honesty: batches that do not look Poisson-sampled at the engine's rate are reported, true Poisson
batches never are."""

import warnings

import numpy as np
import pytest
import torch
from scipy.stats import poisson
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import flashdp
from flashdp import FlashDPWarning
from flashdp.privacy.sampling import SamplingMonitor


@pytest.mark.parametrize("mu", [0.5, 3.0, 40.0, 500.0])
def test_true_poisson_batch_sizes_never_raise_a_finding(mu):
    generator = torch.Generator().manual_seed(int(mu * 10))
    monitor = SamplingMonitor(mu)
    sizes = torch.poisson(torch.full((3000,), mu, device="cpu"), generator=generator).long().tolist()
    assert all(monitor.record(s) is None for s in sizes)


@pytest.mark.parametrize("mu", [8.0, 64.0, 1024.0])
def test_a_fixed_batch_size_is_found_once_the_poisson_odds_fall_below_one_in_a_million(mu):
    likeliest = poisson.pmf(np.floor(mu), mu)  # the most probable single size
    steps = next(n for n in range(2, 100) if likeliest ** (n - 1) < 1e-6)
    monitor = SamplingMonitor(mu)
    findings = [monitor.record(int(mu)) for _ in range(steps)]
    assert findings[-1] is not None and "exactly" in findings[-1]
    assert all(f is None for f in findings[:-1]), "found once, at the first step with enough evidence"


def test_a_mean_that_is_not_the_expected_batch_size_is_found():
    generator = torch.Generator().manual_seed(0)
    monitor = SamplingMonitor(32.0)
    sizes = torch.poisson(torch.full((40,), 48.0, device="cpu"), generator=generator).long().tolist()
    findings = [f for s in sizes if (f := monitor.record(s)) is not None]
    assert len(findings) == 1 and "mean batch size" in findings[0]


def _engine(model, **kwargs):
    return flashdp.make_private(
        model,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        **kwargs,
    )


def _train(engine, model, loader):
    for x, y in loader:
        if len(x) == 0:
            engine.backward_empty()
        else:
            engine.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
        engine.step()


def test_a_fixed_size_dataloader_is_reported_at_step_and_at_epsilon():
    dataset = TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
    model = nn.Linear(4, 2)
    engine = _engine(model, expected_batch_size=32, sample_rate=32 / 256)
    with pytest.warns(FlashDPWarning, match="exactly 32 samples"):
        _train(engine, model, DataLoader(dataset, batch_size=32, shuffle=True))
    with pytest.warns(FlashDPWarning, match="assumes Poisson sampling"):
        engine.epsilon(1e-5)


def test_the_engines_loader_samples_at_its_rate_without_a_finding():
    dataset = TensorDataset(torch.randn(400, 4), torch.randint(0, 2, (400,)))
    model = nn.Linear(4, 2)
    engine = _engine(model, expected_batch_size=40, sample_rate=0.1, seed=3)
    loader = engine.data_loader(dataset, steps=25)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlashDPWarning)
        _train(engine, model, loader)
        engine.epsilon(1e-5)
    assert engine.steps == 25
    sizes = [
        [
            len(x)
            for x, _ in _engine(nn.Linear(4, 2), expected_batch_size=40, sample_rate=0.1, seed=3).data_loader(
                dataset, steps=25
            )
        ]
        for _ in range(2)
    ]
    assert sizes[0] == sizes[1], "a seeded engine samples reproducibly"


def test_the_engines_loader_refuses_a_rate_inconsistent_with_the_batch_and_covers_secure_rng():
    dataset = TensorDataset(torch.randn(100, 4))
    with pytest.raises(flashdp.FlashDPError, match="expected_batch_size=10"):
        _engine(nn.Linear(4, 2), expected_batch_size=25, sample_rate=0.1).data_loader(dataset)
    secure = _engine(nn.Linear(4, 2), expected_batch_size=10, sample_rate=0.1, secure_rng=True).data_loader(dataset)
    assert secure.batch_sampler.secure_rng


def test_the_whole_dataset_every_step_is_what_sampling_at_rate_one_gives():
    """Full-batch DP-GD (q = 1): every batch holds all N examples, which the monitor took for a fixed-size loader."""
    monitor = SamplingMonitor(100.0, sample_rate=1.0)
    assert all(monitor.record(100) is None for _ in range(50))
    monitor.expect(100.0, 0.5)
    assert any(monitor.record(100) is not None for _ in range(50))


def test_a_seeded_engines_loaders_made_at_other_steps_draw_other_batches():
    """A breaker's: with `seed=`, every new `engine.data_loader` replayed the first one's batches (a loader made
    every epoch trained on the same subsamples, which epsilon() composes as fresh ones). A loader's stream is a
    function of the seed and the step it is made at: a resumed engine makes the uninterrupted run's."""
    dataset = TensorDataset(torch.randn(200, 4))

    def run(steps_before: int, state: dict | None = None) -> tuple[list[list[float]], dict]:
        model = nn.Linear(4, 2)
        engine = _engine(model, expected_batch_size=20, sample_rate=0.1, seed=3)
        if state is not None:
            engine.load_state_dict(state)
        for _ in range(steps_before):
            engine.backward(model(torch.randn(3, 4)).sum(1))
            engine.step()
        batches = [x[:, 0].tolist() for (x,) in engine.data_loader(dataset, steps=3)]
        return batches, engine.state_dict()

    first, _ = run(0)
    later, state = run(2)
    assert first != later
    assert run(0, state)[0] == later


@pytest.mark.parametrize("users", [False, True])
def test_the_engines_loader_samples_at_a_rate_set_on_the_engine_later(users):
    """A breaker's: a sample_rate set on the engine mid-run was composed by the accountant while the engine's
    loader went on sampling at the old rate (epsilon 2.68 reported for a run that spent 3.50)."""
    dataset = TensorDataset(torch.randn(1000, 4))
    ids = torch.arange(1000) if users else None
    options = {"users": ids, "examples_per_user": 1} if users else {}
    engine = _engine(nn.Linear(4, 2), expected_batch_size=50, sample_rate=0.05, seed=1)
    loader = engine.data_loader(dataset, steps=40, **options)
    engine.sample_rate, engine.expected_batch_size = 0.005, 5
    sizes = [len(batch[0][0] if users else batch[0]) for batch in loader]
    assert sum(sizes) / len(sizes) < 15  # (about 5; at the old rate about 50)
