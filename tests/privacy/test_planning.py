"""The public planning functions: get_epsilon agrees with dp-accounting (equal for RDP, an upper bound within
1e-6 for PLD); get_noise_multiplier spends the target."""

import pytest

import flashdp
from flashdp import FlashDPError
from tests.privacy.test_accounting import _reference, agrees_with_dp_accounting


@pytest.mark.parametrize("kind", ["pld", "rdp"])
@pytest.mark.parametrize(("sigma", "q", "steps"), [(0.8, 0.01, 50), (2.0, 0.1, 30)])
def test_get_epsilon_agrees_with_dp_accounting(kind, sigma, q, steps):
    got = flashdp.get_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5, accountant=kind)
    assert agrees_with_dp_accounting(kind, got, _reference(kind, [(sigma, q, steps)], 1e-5))


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_get_noise_multiplier_spends_between_99_percent_and_all_of_the_target(kind):
    q, epochs = 0.02, 2
    sigma = flashdp.get_noise_multiplier(
        target_epsilon=4.0, target_delta=1e-5, sample_rate=q, epochs=epochs, accountant=kind
    )
    spent = _reference(kind, [(sigma, q, round(epochs / q))], 1e-5)
    assert 0.99 * 4.0 <= spent <= 4.0


def test_planning_refuses_bad_input_with_the_expected_value_named():
    with pytest.raises(FlashDPError, match="exactly one of steps and epochs"):
        flashdp.get_noise_multiplier(target_epsilon=3, target_delta=1e-5, sample_rate=0.01)
    with pytest.raises(FlashDPError, match="sample_rate"):
        flashdp.get_noise_multiplier(target_epsilon=3, target_delta=1e-5, sample_rate=1.5, steps=10)
    with pytest.raises(FlashDPError, match="delta"):
        flashdp.get_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=10, delta=0)
    with pytest.raises(FlashDPError, match="steps"):
        flashdp.get_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=True, delta=1e-5)
    assert flashdp.get_epsilon(noise_multiplier=1.0, sample_rate=0.01, steps=0, delta=1e-5) == 0.0
