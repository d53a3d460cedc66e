"""User-level sampling (`UserPoissonSampler`, `engine.data_loader(..., users=...)`) and micro-batches that keep
each user's rows together."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import flashdp
from flashdp import FlashDPError
from flashdp.data import UserPoissonSampler

#: 40 users with 1 to 6 examples each, interleaved in the dataset
USERS = torch.tensor([u for rep in range(6) for u in range(40) if u % 6 >= rep])


def test_users_are_included_independently_with_probability_q_and_give_at_most_k_examples():
    q, k, steps = 0.3, 2, 400
    sampler = UserPoissonSampler(USERS, q, k, steps=steps, seed=0)
    counts = torch.zeros(40)
    for batch in sampler:
        users = USERS[batch]
        assert len(batch) == len(set(batch))  # no example twice
        per_user = torch.bincount(users, minlength=40)
        available = torch.bincount(USERS, minlength=40)
        present = per_user > 0
        assert torch.equal(per_user[present], available[present].clamp(max=k))  # min(k, n_u) of each
        counts += present
    # each user in about q of the steps: two-sided binomial test on the total, and no user far off
    total = int(counts.sum())
    assert stats.binomtest(total, 40 * steps, q).pvalue > 1e-4
    assert all(stats.binomtest(int(c), steps, q).pvalue > 1e-5 for c in counts)


def test_a_users_k_examples_are_a_uniform_subset():
    """A user with 6 examples and k = 2: every example chosen about k / 6 of the times the user is sampled."""
    sampler = UserPoissonSampler(USERS, 1.0, 2, steps=600, seed=1)
    mine = (USERS == 5).nonzero().flatten()
    chosen = torch.zeros(len(mine))
    for batch in sampler:
        chosen += torch.isin(mine, torch.tensor(batch)).float()
    assert all(stats.binomtest(int(c), 600, 2 / 6).pvalue > 1e-5 for c in chosen)


def test_ranks_sample_disjoint_users_that_cover_every_user():
    shards = [UserPoissonSampler(USERS, 1.0, 10, steps=1, seed=0, rank=r, world_size=3) for r in range(3)]
    users = [set(USERS[next(iter(s))].tolist()) for s in shards]
    assert set().union(*users) == set(range(40)) and sum(map(len, users)) == 40
    assert [s.num_users for s in shards] == [len(u) for u in users]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"users": USERS[:-1], "examples_per_user": 2}, r"one integer user id per example of the dataset"),
        ({"users": USERS.float(), "examples_per_user": 2}, r"torch.float32"),
        ({"users": USERS.to(torch.complex64), "examples_per_user": 2}, r"torch.complex64"),
        ({"users": USERS}, r"examples_per_user=k"),
        ({"users": USERS, "examples_per_user": 0}, r"examples_per_user must be an integer >= 1\. Received 0"),
        ({"users": USERS, "examples_per_user": True}, r"examples_per_user must be an integer >= 1\. Received True"),
    ],
)
def test_bad_user_sampling_arguments_are_refused(kwargs, match):
    dataset = TensorDataset(torch.randn(len(USERS), 3))
    with pytest.raises(FlashDPError, match=match):
        flashdp.poisson_loader(dataset, 0.1, **kwargs)


def test_engine_loader_samples_users_and_trains_by_user():
    """The engine's loader yields (batch, users); expected_batch_size counts users, which it checks."""
    dataset = TensorDataset(torch.randn(len(USERS), 3), torch.randn(len(USERS)))
    model = nn.Linear(3, 1)
    with pytest.raises(FlashDPError, match=r"sample_rate \* the number of users = 0.25 \* 40 = 10.0"):
        engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=30,
                                      sample_rate=0.25)  # fmt: skip
        engine.data_loader(dataset, users=USERS, examples_per_user=3)
    engine.detach()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer,
                              expected_batch_size=10, sample_rate=0.25, seed=0) as engine:  # fmt: skip
        loader = engine.data_loader(dataset, users=USERS, examples_per_user=3, steps=5)
        for (x, y), users in loader:
            assert users.shape == (len(x),) and users.dtype == torch.long
            assert torch.bincount(users).max() <= 3
            if len(x):
                engine.backward((model(x).squeeze(1) - y).square(), users=users)
            else:
                engine.backward_empty()
            engine.step()
        assert engine.steps == 5


def test_more_users_per_step_than_users_is_refused():
    dataset = TensorDataset(torch.randn(len(USERS), 3))
    engine = flashdp.make_private(nn.Linear(3, 1), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=60,
                                  sample_rate=0.25)  # fmt: skip
    refused = pytest.raises(FlashDPError, match=r"expected_batch_size=60 exceeds the number of users \(40\)")
    with engine, refused:
        engine.data_loader(dataset, users=USERS, examples_per_user=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.bool])
def test_micro_batches_refuse_ids_that_are_not_integers(dtype):
    ids = torch.tensor([0, 1, 1]).to(dtype)
    with pytest.raises(FlashDPError, match=rf"users must be an integer tensor of shape \(3,\).*{dtype}"):
        list(flashdp.micro_batches(torch.zeros(3, 2), 2, users=ids))


@given(
    users=st.lists(st.integers(0, 5), max_size=12),
    max_size=st.integers(1, 6),
)
def test_micro_batches_keep_each_users_rows_together(users, max_size):
    ids = torch.tensor(users, dtype=torch.long)
    rows = torch.arange(len(users))
    if len(users) and int(torch.bincount(ids).max()) > max_size:
        with pytest.raises(FlashDPError, match=r"user \d+ has \d+ rows, more than max_size"):
            list(flashdp.micro_batches((rows, ids), max_size, users=ids))
        return
    pieces = list(flashdp.micro_batches((rows, ids), max_size, users=ids))
    assert sorted(torch.cat([r for r, _ in pieces]).tolist()) == list(range(len(users)))
    seen: set[int] = set()
    for piece_rows, piece_users in pieces:
        assert len(piece_rows) <= max_size
        assert torch.equal(piece_users, ids[piece_rows])
        assert not seen & set(piece_users.tolist())  # a user in one piece only
        seen |= set(piece_users.tolist())
