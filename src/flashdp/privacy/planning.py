"""Privacy planning before training: the noise multiplier for a target epsilon, and the epsilon of a plan."""

from __future__ import annotations

from flashdp._checks import checked_delta, is_int
from flashdp.errors import FlashDPError
from flashdp.privacy.composition import epsilon_of
from flashdp.privacy.settings import PrivacyRequest


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str = "pld",
) -> float:
    """The noise multiplier sigma for which DP-SGD with Poisson sampling at `sample_rate`, run for `steps` steps
    (or `epochs` passes: `ceil(epochs / sample_rate)` steps), spends at most `target_epsilon` at `target_delta`,
    and at least 99% of it. The same calibration as `make_private(target_epsilon=...)` (Opacus:
    `get_noise_multiplier`). accountant: "pld" (tight, default) or "rdp"."""
    request = PrivacyRequest(
        sample_rate=sample_rate,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        steps=steps,
        epochs=epochs,
        accountant=accountant,
    )
    return request.resolve().noise_multiplier


def get_epsilon(
    *, noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld"
) -> float:
    """The epsilon at `delta` of `steps` DP-SGD steps with Poisson sampling at `sample_rate` and noise multiplier
    sigma: what `engine.epsilon(delta)` reports after those steps."""
    if sample_rate is None:
        raise FlashDPError("sample_rate (the Poisson sampling rate q, in (0, 1]) is required.")
    request = PrivacyRequest(noise_multiplier=noise_multiplier, sample_rate=sample_rate, accountant=accountant)
    privacy = request.resolve()
    if not (is_int(steps) and steps >= 0):
        raise FlashDPError(f"steps must be an int >= 0. Received {steps!r}.")
    history = [(privacy.noise_multiplier, sample_rate, steps)] if steps else []
    return epsilon_of(privacy.accountant, history, checked_delta(delta))
