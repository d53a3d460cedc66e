"""Poisson sampling and micro-batching."""

from collections import UserDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import flashdp
from flashdp import FlashDPError, PoissonSampler
from tests.oracle import seeded
from tests.twister import is_a_seeds_expansion


def test_inclusion_is_independent_with_probability_q():
    n, q, steps = 2000, 0.03, 400
    sampler = PoissonSampler(n, q, steps=steps, seed=0)
    counts = torch.zeros(n)
    sizes = []
    for batch in sampler:
        counts[batch] += 1
        sizes.append(len(batch))
    assert len(sizes) == steps
    assert abs(sum(sizes) / (steps * n) - q) < 0.003
    # batch sizes vary as Binomial(n, q): variance n q (1 - q)
    assert abs(torch.tensor(sizes, dtype=torch.float64).var().item() / (n * q * (1 - q)) - 1) < 0.2
    per_example = counts / steps
    assert abs(per_example.mean().item() - q) < 0.003 and per_example.std().item() < 0.02


def test_default_length_is_one_expected_epoch_and_secure_rng_samples_too():
    assert len(PoissonSampler(1000, 0.01)) == 100
    sizes = [len(b) for b in PoissonSampler(1000, 0.1, steps=50, secure_rng=True)]
    assert 80 < sum(sizes) / 50 < 120


def test_ranks_sample_disjoint_shards_that_cover_the_dataset():
    shards = [PoissonSampler(10, 1.0, steps=1, seed=0, rank=r, world_size=3) for r in range(3)]
    batches = [next(iter(s)) for s in shards]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert all(set(a).isdisjoint(b) for i, a in enumerate(batches) for b in batches[i + 1 :])


def test_loader_turns_empty_batches_into_empty_tensors():
    dataset = TensorDataset(torch.randn(20, 3, 2), torch.arange(20))
    loader = flashdp.poisson_loader(dataset, 0.01, steps=30, seed=0)
    shapes = [(x.shape[1:], y.dtype) for x, y in loader]
    assert any(True for x, _ in loader if x.shape[0] == 0), "q=0.01 over 20 examples must give empty batches"
    assert all(s == (torch.Size([3, 2]), torch.int64) for s in shapes)


def test_empty_poisson_batch_trains_end_to_end():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = flashdp.make_private(
        model,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        expected_batch_size=1,
        sample_rate=0.01,
    )
    x = torch.zeros(0, 3)
    for micro in flashdp.micro_batches(x, 4):
        engine.backward(model(micro).sum(1))
    engine.step()
    assert engine.steps == 1


def test_micro_batches_split_nested_batches():
    batch = {"x": torch.randn(7, 2), "pair": (torch.arange(7), [torch.ones(7)])}
    pieces = list(flashdp.micro_batches(batch, 3))
    assert [p["x"].shape[0] for p in pieces] == [3, 3, 1]
    assert torch.equal(torch.cat([p["pair"][0] for p in pieces]), torch.arange(7))
    assert isinstance(pieces[0]["pair"], tuple) and isinstance(pieces[0]["pair"][1], list)


def test_micro_batches_refuse_mismatched_leading_dims_and_bad_sizes():
    with pytest.raises(FlashDPError, match="share the leading"):
        list(flashdp.micro_batches((torch.ones(3), torch.ones(4)), 2))
    with pytest.raises(FlashDPError, match="max_size must be at least 1"):
        list(flashdp.micro_batches(torch.ones(3), 0))


def test_micro_batch_accumulation_then_step_equals_one_step_on_the_union():
    def run(pieces: int):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        engine = flashdp.make_private(
            model,
            max_grad_norm=0.3,
            noise_multiplier=0.8,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            expected_batch_size=9,
            sample_rate=0.1,
            seed=11,
        )
        x = torch.randn(9, 4, generator=seeded(1))
        for micro in flashdp.micro_batches(x, -(-9 // pieces)):
            engine.backward(model(micro).square().sum(1))
        engine.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    torch.testing.assert_close(run(3), run(1), rtol=1e-6, atol=1e-7)


class Encoding(UserDict):
    """A batch as HF collators return it (BatchEncoding is a UserDict, not a dict)."""


def test_mapping_batches_that_are_not_dicts_are_split_and_emptied_too():
    dataset = [Encoding(ids=torch.tensor([i, i + 1]), label=torch.tensor(i)) for i in range(10)]

    def collate(samples):
        return Encoding({k: torch.stack([s[k] for s in samples]) for k in samples[0]})

    loader = flashdp.poisson_loader(dataset, 0.05, steps=40, seed=0, collate_fn=collate)
    sizes = {len(batch["ids"]) for batch in loader}
    assert 0 in sizes, "q = 0.05 over 10 samples draws empty batches"
    empty = next(batch for batch in loader if len(batch["ids"]) == 0)
    assert isinstance(empty, Encoding) and empty["ids"].shape == (0, 2) and empty["label"].shape == (0,)
    pieces = list(flashdp.micro_batches(collate(dataset), 4))
    assert [len(p["ids"]) for p in pieces] == [4, 4, 2] and all(isinstance(p, Encoding) for p in pieces)


def _shared_batches(rank: int) -> list[list[int]]:
    """The index batches a loader shared by the 2 processes yields on this one (CSPRNG: no seed could align them)."""
    loader = flashdp.poisson_loader(list(range(40)), 0.2, secure_rng=True, steps=5, shared_by=dist.group.WORLD)
    return [batch.tolist() for batch in loader]


def test_a_loader_shared_by_processes_yields_the_first_ones_batches_on_every_one():
    from tests.distributed import launch

    first, second = launch.run(_shared_batches)
    assert first == second and len(first) == 5 and any(first)


@pytest.mark.parametrize("users", [False, True])
def test_an_epochs_batches_depend_on_the_seed_and_the_epoch_alone(users):
    """What a resumed run needs: a new sampler set to epoch e draws what one that went through epochs 0..e drew;
    epoch 0 is the stream a new sampler starts with; epochs differ."""

    def sampler():
        if users:
            return flashdp.data.UserPoissonSampler(torch.arange(30) // 3, 0.3, 2, steps=4, seed=5)
        return PoissonSampler(30, 0.3, steps=4, seed=5)

    went_through = sampler()
    epochs = []
    for epoch in range(3):
        went_through.set_epoch(epoch)
        epochs.append(list(went_through))
    assert list(sampler()) == epochs[0] and epochs[1] != epochs[0]
    resumed = sampler()
    resumed.set_epoch(2)
    assert list(resumed) == epochs[2]


@pytest.mark.parametrize("users", [False, True])
def test_an_unseeded_samplers_batches_are_one_of_more_than_2_to_the_32_streams(users):
    """(Unseeded, the sampler seeded torch's CPU generator from 63 bits of OS entropy, of which it keeps 32: who
    enumerates 2^32 seeds knows every batch, and the subsampling's amplification is lost.) Every epoch's generator
    has a state that is no seed's expansion."""
    sampler = (
        flashdp.data.UserPoissonSampler(torch.arange(30) // 3, 0.3, 2, steps=4)
        if users
        else PoissonSampler(30, 0.3, steps=4)
    )
    inner = sampler._users_sampler if users else sampler
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert not is_a_seeds_expansion(inner.generator)
        assert all(set(batch) <= set(range(30)) for batch in sampler)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"steps": -1}, "steps .* must be a positive int. Received -1"),
        ({"steps": 2.5}, "steps .* must be a positive int. Received 2.5"),
        ({"examples_per_user": 2}, "give users= too"),
    ],
)
def test_a_loaders_bad_arguments_are_refused_naming_them(options, match):
    """A breaker's: DataLoader's bare ValueError or TypeError, or examples_per_user ignored without users."""
    with pytest.raises(FlashDPError, match=match):
        flashdp.poisson_loader(TensorDataset(torch.randn(10, 2)), 0.5, **options)


@pytest.mark.parametrize("rate", ["0.1", None, float("nan"), 0, 1.5, -0.1])
def test_a_sampling_rate_that_is_not_a_probability_is_refused(rate):
    """(A string or None raised a bare TypeError before: the sampler compared it with numbers.)"""
    with pytest.raises(flashdp.FlashDPError, match="sample_rate"):
        flashdp.poisson_loader(list(range(10)), rate)
