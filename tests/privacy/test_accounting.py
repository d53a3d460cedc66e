"""Accounting: dp-accounting's values, cheap at every step; bounded work at absurd settings; calibration."""

import dp_accounting
import pytest
from dp_accounting import pld, rdp
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdp import FlashDPError
from flashdp.privacy import Accountant, calibrate_noise_multiplier, epsilon_of


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


@settings(max_examples=8)
@given(runs=runs, kind=st.sampled_from(["pld", "rdp"]))
def test_epsilon_after_every_step_equals_dp_accounting_exactly(runs, kind):
    """Asked at every step, through the kept composition, the value is dp-accounting's for the whole history."""
    accountant = Accountant(kind)
    checked = 0
    for sigma, q, steps in runs:
        for _ in range(steps):
            accountant.step(sigma, q)
        if checked < 2 or kind == "rdp":  # PLD references are slow: the first runs, then the end
            assert accountant.epsilon(1e-5) == _reference(kind, accountant.history, 1e-5)
            checked += 1
    assert accountant.epsilon(1e-5) == _reference(kind, accountant.history, 1e-5)
    assert accountant.epsilon(1e-6) == _reference(kind, accountant.history, 1e-6)


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
