"""The privacy arguments of make_private, checked and resolved to a noise multiplier."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashdp.errors import FlashDPError
from flashdp.privacy.accountant import ACCOUNTANTS, AccountantKind, calibrate_noise_multiplier


@dataclass(frozen=True)
class PrivacySettings:
    noise_multiplier: float
    expected_batch_size: int | None
    sample_rate: float | None
    accountant: AccountantKind


def resolve_privacy(
    *,
    noise_multiplier: float | None,
    expected_batch_size: int | None,
    sample_rate: float | None,
    target_epsilon: float | None,
    target_delta: float | None,
    steps: int | None,
    epochs: float | None,
    accountant: str,
) -> PrivacySettings:
    if accountant not in ACCOUNTANTS:
        raise FlashDPError(f"accountant must be one of {ACCOUNTANTS}. Received {accountant!r}.")
    if sample_rate is not None and not (isinstance(sample_rate, int | float) and 0 < sample_rate <= 1):
        raise FlashDPError(
            f"sample_rate is the Poisson sampling probability q, in (0, 1]. Received {sample_rate!r}. "
            "It is usually expected_batch_size / len(dataset)."
        )
    if expected_batch_size is not None and not (isinstance(expected_batch_size, int) and expected_batch_size > 0):
        raise FlashDPError(
            f"expected_batch_size must be a positive int (the global logical batch). Received {expected_batch_size!r}."
        )
    if (noise_multiplier is None) == (target_epsilon is None):
        raise FlashDPError(
            "Give exactly one of noise_multiplier (sigma) and target_epsilon (with target_delta, sample_rate and "
            f"steps or epochs). Received noise_multiplier={noise_multiplier!r}, target_epsilon={target_epsilon!r}."
        )
    if noise_multiplier is None:
        noise_multiplier = _calibrate(target_epsilon, target_delta, sample_rate, steps, epochs, accountant)
    if not (isinstance(noise_multiplier, int | float) and 0 <= noise_multiplier < math.inf):
        raise FlashDPError(f"noise_multiplier must be a finite number >= 0. Received {noise_multiplier!r}.")
    return PrivacySettings(float(noise_multiplier), expected_batch_size, sample_rate, accountant)


def _calibrate(target_epsilon, target_delta, sample_rate, steps, epochs, accountant) -> float:
    if not (isinstance(target_epsilon, int | float) and 0 < target_epsilon < math.inf):
        raise FlashDPError(f"target_epsilon must be a positive finite number. Received {target_epsilon!r}.")
    if not (isinstance(target_delta, int | float) and 0 < target_delta < 1):
        raise FlashDPError(f"target_epsilon needs target_delta in (0, 1), e.g. 1e-5. Received {target_delta!r}.")
    if sample_rate is None:
        raise FlashDPError("target_epsilon needs sample_rate (the Poisson sampling rate q) to calibrate sigma.")
    if (steps is None) == (epochs is None):
        raise FlashDPError(
            f"target_epsilon needs exactly one of steps and epochs. Received steps={steps!r}, epochs={epochs!r}."
        )
    if epochs is not None:
        if not (isinstance(epochs, int | float) and epochs > 0):
            raise FlashDPError(f"epochs must be positive. Received {epochs!r}.")
        steps = math.ceil(epochs / sample_rate)
    if not (isinstance(steps, int) and steps > 0):
        raise FlashDPError(f"steps must be a positive int. Received {steps!r}.")
    return calibrate_noise_multiplier(accountant, float(target_epsilon), float(target_delta), sample_rate, steps)
