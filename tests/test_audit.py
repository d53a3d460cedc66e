"""The canary audit: no violation on a correct run, a violation on planted bugs, and its statistics."""

import math

import pytest
import torch
from scipy import stats
from torch import nn

import flashdp
import flashdp.noisy_step
from flashdp import FlashDPError
from flashdp.audit import CanaryAudit, epsilon_lower_bound

STEPS, Q, SIGMA = 50, 0.5, 13.4  # epsilon about 1 at delta 1e-5


def _audited_run(plant=None):
    torch.manual_seed(0)
    model = nn.Linear(50, 40)
    engine = flashdp.make_private(
        model,
        max_grad_norm=1.0,
        noise_multiplier=SIGMA,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        expected_batch_size=4,
        sample_rate=Q,
        seed=1,
    )
    if plant is not None:
        plant(engine)
    audit = CanaryAudit(engine, canaries=1000, seed=2)
    x = torch.randn(4, 50)
    for _ in range(STEPS):
        engine.backward(model(x).sum(1))  # real data too: it moves the canary coordinates
        engine.step()
    return audit.result(delta=1e-5, confidence=0.95)


def test_a_correct_run_shows_no_violation():
    result = _audited_run()
    assert 0.9 < result.epsilon_claimed < 1.0
    assert not result.violation and result.epsilon_lower_bound < result.epsilon_claimed
    assert "no violation found" in str(result)


def _no_clipping(engine, monkeypatch):
    monkeypatch.setattr(flashdp.noisy_step, "clip_coefficients", lambda style, norms_sq, c: torch.ones_like(norms_sq))


def _no_noise(engine, monkeypatch):
    monkeypatch.setattr(
        engine.noisy_step.noise, "gaussian", lambda shape, std, device, dtype: torch.zeros(shape, dtype=dtype)
    )


def _noise_a_tenth_of_the_accounted(engine, monkeypatch):
    draw = engine.noisy_step.noise.gaussian
    monkeypatch.setattr(
        engine.noisy_step.noise, "gaussian", lambda shape, std, device, dtype: draw(shape, std / 10, device, dtype)
    )


@pytest.mark.parametrize("bug", [_no_clipping, _no_noise, _noise_a_tenth_of_the_accounted])
def test_a_planted_bug_is_reported_as_a_violation(bug, monkeypatch):
    result = _audited_run(lambda engine: bug(engine, monkeypatch))
    assert result.violation and result.epsilon_lower_bound > 2 * result.epsilon_claimed
    assert str(result).startswith("VIOLATION")


def test_the_lower_bound_against_the_binomial_tail_written_out():
    """All r guesses right, delta 0: the bound is the epsilon where p^r = beta, p = e^eps / (1 + e^eps)."""
    r, beta = 100, 0.05
    p = beta ** (1 / r)
    assert epsilon_lower_bound(r, r, 1, 0.0, beta) == pytest.approx(math.log(p / (1 - p)), rel=1e-6)
    assert epsilon_lower_bound(r, r // 2, 1, 0.0, beta) == 0.0  # chance level proves nothing
    bound = epsilon_lower_bound(r, 80, 1000, 1e-5, beta)
    p = 1 / (1 + math.exp(-bound))
    assert stats.binom.sf(79, r, p) + 2 * 1000 * 1e-5 == pytest.approx(beta, rel=1e-3)


def test_the_audit_needs_a_sample_rate_and_enough_coordinates():
    model = nn.Linear(3, 2)
    kwargs = {"max_grad_norm": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(FlashDPError, match="sample_rate=q"):
        CanaryAudit(flashdp.make_private(model, **kwargs))
    model = nn.Linear(3, 2)
    with pytest.raises(
        FlashDPError, match=r"canaries must be an int from 2 to the number of trainable coordinates \(8\)"
    ):
        CanaryAudit(flashdp.make_private(model, sample_rate=0.1, **kwargs), canaries=100)
