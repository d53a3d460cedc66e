"""Accounting: dp-accounting's values, cheap at every step; bounded work at absurd settings; calibration."""

import functools
import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdp import FlashDPError
from flashdp.privacy import Accountant, calibrate_noise_multiplier, epsilon_of
from flashdp.privacy.composition import ABSOLUTE_MARGIN, FOURIER_DELTA_FLOOR, MARGIN


def _reference(kind, history, delta, discretization=1e-4):
    """dp-accounting's own accountant over the same events."""
    accountant = (
        pld.PLDAccountant(value_discretization_interval=discretization) if kind == "pld" else rdp.RdpAccountant()
    )
    for sigma, q, steps in history:
        step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        accountant.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return accountant.get_epsilon(delta)


runs = st.lists(
    st.tuples(
        st.sampled_from([0.7, 1.0, 2.5]), st.sampled_from([0.001, 0.01, 0.1]), st.integers(min_value=1, max_value=40)
    ),
    min_size=1,
    max_size=3,
)


def agrees_with_dp_accounting(kind, value, reference):
    """RDP: dp-accounting's value to the bit. PLD: an upper bound on it, within the documented margin."""
    if kind == "rdp":
        return value == reference
    return reference <= value <= reference * (1 + 2 * MARGIN) + 2 * ABSOLUTE_MARGIN


@settings(max_examples=8, deadline=None)
@given(runs=runs, kind=st.sampled_from(["pld", "rdp"]))
def test_epsilon_after_every_step_agrees_with_dp_accounting(runs, kind):
    """Asked at every step, through the kept composition, the value is dp-accounting's for the whole history
    (PLD: never below it, within 2e-6)."""
    accountant = Accountant(kind)
    checked = 0
    for sigma, q, steps in runs:
        for _ in range(steps):
            accountant.step(sigma, q)
            accountant.epsilon(1e-5)
        if checked < 2 or kind == "rdp":  # PLD references are slow: the first runs, then the end
            assert agrees_with_dp_accounting(kind, accountant.epsilon(1e-5), _reference(kind, accountant.history, 1e-5))
            checked += 1
    assert agrees_with_dp_accounting(kind, accountant.epsilon(1e-5), _reference(kind, accountant.history, 1e-5))
    assert agrees_with_dp_accounting(kind, accountant.epsilon(1e-6), _reference(kind, accountant.history, 1e-6))


@functools.cache
def _one_step_pld(**kwargs):
    return _from_gaussian_mechanism(**kwargs)


_from_gaussian_mechanism = pld.privacy_loss_distribution.from_gaussian_mechanism


@settings(max_examples=6, deadline=None)
@given(first=runs, second=runs, every=st.integers(min_value=3, max_value=9))
def test_the_kept_composition_equals_one_from_scratch(first, second, every):
    """Steps of one history, asked every few steps, then another history loaded (a resume): each value equals
    the one composed from scratch for the same history, to rounding. (The one-step distributions, dp-accounting's,
    are built once per test.)"""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pld.privacy_loss_distribution, "from_gaussian_mechanism", _one_step_pld)
        _compare_with_scratch((first, second), every)


def _compare_with_scratch(histories, every):
    accountant = Accountant("pld")
    for history in histories:
        accountant.load_state_dict({"kind": "pld", "history": []})
        for k, (sigma, q, steps) in enumerate(history):
            for n in range(steps):
                accountant.step(sigma, q)
                if (n + k) % every == 0:
                    fresh = epsilon_of("pld", accountant.history, 1e-5)
                    assert accountant.epsilon(1e-5) == pytest.approx(fresh, rel=1e-9)


def test_a_long_run_asked_at_every_step_stays_on_dp_accounting():
    """Hundreds of steps of one run, the transform advanced by products between calls: at the end, and where the
    FFT size changed on the way, the value is still dp-accounting's (within the margin)."""
    accountant = Accountant("pld")
    for step in range(1, 401):
        accountant.step(1.0, 0.02)
        value = accountant.epsilon(1e-5)
        if step in (37, 400):
            assert agrees_with_dp_accounting("pld", value, _reference("pld", accountant.history, 1e-5))


def test_a_tiny_noise_multiplier_is_answered_at_once_with_an_upper_bound():
    """Epsilon in the thousands: a coarser PLD, still above the exact one and close to it; far below any
    meaningful sigma, RDP's bound (PLD would need gigabytes)."""
    history = [(0.5, 1.0, 1000)]
    exact = _reference("pld", history, 1e-5)
    bounded = epsilon_of("pld", history, 1e-5)
    assert exact <= bounded <= 1.01 * exact
    tiny = [(0.001, 0.5, 1000)]
    assert epsilon_of("pld", tiny, 1e-5) == epsilon_of("rdp", tiny, 1e-5) > 1e8


def test_no_noise_spends_everything_and_no_sampling_nothing():
    assert epsilon_of("pld", [(0.0, 0.01, 3)], 1e-5) == float("inf")
    assert epsilon_of("rdp", [(1.0, 0.0, 3)], 1e-5) == 0.0


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_noise_below_float64s_reach_spends_everything(kind):
    """A breaker's: at sigma = 1e-155, RDP reported epsilon 0 (dp-accounting's own arithmetic underflows) and PLD
    raised a bare OverflowError. Below 1e-100 no noise is counted; 1e-90 is still computed (about 1e179)."""
    assert epsilon_of(kind, [(1e-155, 0.01, 3)], 1e-5) == float("inf")
    assert 1e170 < epsilon_of(kind, [(1e-90, 0.01, 3)], 1e-5) < float("inf")


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_calibration_at_a_tiny_target_leaves_the_coarse_bracket(kind):
    """Target 0.01: the coarse search overstates epsilon most there; the result must still be within 1%."""
    q, steps, target = 0.1, 1000, 0.01
    sigma = calibrate_noise_multiplier(kind, target, 1e-5, q, steps)
    assert 0.99 * target <= _reference(kind, [(sigma, q, steps)], 1e-5) <= target


def test_calibration_of_an_absurd_target_ends_at_once():
    sigma = calibrate_noise_multiplier("pld", 1e4, 1e-5, 0.01, 1000)  # a bound on the work, conservative
    assert epsilon_of("pld", [(sigma, 0.01, 1000)], 1e-5) <= 1e4
    with pytest.raises(FlashDPError, match=r"almost no noise \(sigma < 0\.001\)"):
        calibrate_noise_multiplier("pld", 1e12, 1e-5, 0.01, 1000)
    with pytest.raises(FlashDPError, match="No noise multiplier up to 1e\\+06"):
        calibrate_noise_multiplier("pld", 1e-9, 1e-5, 1.0, 10**6)


ALTERNATING = [(0.8, 0.02, 50), (1.2, 0.02, 50)] * 3


@pytest.mark.parametrize("delta", [1e-7, FOURIER_DELTA_FLOOR, 1e-9, 1e-12, 1e-14])
def test_small_deltas_stay_on_dp_accounting(delta):
    """Found by an adversarial search: at delta 1e-12 the Fourier composition of alternating runs was 1.2e-4 below
    dp-accounting's (4e-2 at 1e-14): its rounding is above the masses such deltas weigh. Below the floor,
    dp-accounting composes the history itself."""
    accountant = Accountant("pld")
    for sigma, q, steps in ALTERNATING:
        for _ in range(steps):
            accountant.step(sigma, q)
    assert agrees_with_dp_accounting("pld", accountant.epsilon(delta), _reference("pld", ALTERNATING, delta))


def test_an_epsilon_near_zero_is_not_below_dp_accountings():
    """At a delta just under dp-accounting's delta at epsilon 0 the epsilon is ~1e-7, where a relative margin alone
    was thinner than the two compositions' rounding (found by an adversarial search)."""
    history = [(0.8, 0.02, 3), (1.2, 0.02, 3)]
    reference = pld.PLDAccountant(value_discretization_interval=1e-4)
    for sigma, q, steps in history:
        reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    for factor in (1 - 1e-6, 1 - 1e-9, 1 - 1e-3):
        delta = reference.get_delta(0.0) * factor
        assert agrees_with_dp_accounting("pld", epsilon_of("pld", history, delta), reference.get_epsilon(delta))


def test_delta_zero_gives_infinity():
    assert epsilon_of("pld", [(1.0, 0.01, 10)], 0.0) == math.inf
