"""The privacy arguments of make_private as given (`PrivacyRequest`), checked and resolved to a noise multiplier
(`PrivacySettings`) once the model has passed its own checks, since calibration may take seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashdp._checks import is_int, is_number
from flashdp.errors import FlashDPError
from flashdp.privacy.calibration import calibrate_noise_multiplier
from flashdp.privacy.composition import ACCOUNTANTS, AccountantKind


@dataclass(frozen=True)
class PrivacySettings:
    noise_multiplier: float
    expected_batch_size: int | None
    sample_rate: float | None
    accountant: AccountantKind

    def __post_init__(self) -> None:
        check_noise_multiplier(self.noise_multiplier)
        check_sample_rate(self.sample_rate)
        check_expected_batch_size(self.expected_batch_size)


def check_noise_multiplier(sigma: object) -> None:
    if not (is_number(sigma) and 0 <= sigma < math.inf):
        raise FlashDPError(f"noise_multiplier must be a finite number >= 0. Received {sigma!r}.")


def check_sample_rate(q: object) -> None:
    if q is not None and not (is_number(q) and 0 < q <= 1):
        raise FlashDPError(
            f"sample_rate is the Poisson sampling probability q, in (0, 1]. Received {q!r}. "
            "It is usually expected_batch_size / len(dataset)."
        )


def check_expected_batch_size(batch: object) -> None:
    if batch is not None and not (is_int(batch) and batch > 0):
        raise FlashDPError(
            f"expected_batch_size must be a positive int (the global logical batch). Received {batch!r}."
        )


@dataclass(frozen=True)
class PrivacyRequest:
    """make_private's privacy arguments as given: a noise multiplier, or a target to calibrate one for."""

    noise_multiplier: float | None = None
    expected_batch_size: int | None = None
    sample_rate: float | None = None
    target_epsilon: float | None = None
    target_delta: float | None = None
    steps: int | None = None
    epochs: float | None = None
    accountant: str = "pld"

    def resolve(self) -> PrivacySettings:
        """Checked, with sigma calibrated when a target epsilon was given."""
        self._check()
        sigma = self.noise_multiplier if self.noise_multiplier is not None else self._calibrate()
        check_noise_multiplier(sigma)
        return PrivacySettings(float(sigma), self.expected_batch_size, self.sample_rate, self.accountant)

    def _check(self) -> None:
        if self.accountant not in ACCOUNTANTS:
            raise FlashDPError(f"accountant must be one of {ACCOUNTANTS}. Received {self.accountant!r}.")
        check_sample_rate(self.sample_rate)
        check_expected_batch_size(self.expected_batch_size)
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise FlashDPError(
                "Give exactly one of noise_multiplier (sigma) and target_epsilon (with target_delta, sample_rate "
                f"and steps or epochs). Received noise_multiplier={self.noise_multiplier!r}, "
                f"target_epsilon={self.target_epsilon!r}."
            )

    def _calibrate(self) -> float:
        target, delta, q = self.target_epsilon, self.target_delta, self.sample_rate
        if not (is_number(target) and 0 < target < math.inf):
            raise FlashDPError(f"target_epsilon must be a positive finite number. Received {target!r}.")
        if not (is_number(delta) and 0 < delta < 1):
            raise FlashDPError(f"target_epsilon needs target_delta in (0, 1), e.g. 1e-5. Received {delta!r}.")
        if q is None:
            raise FlashDPError("target_epsilon needs sample_rate (the Poisson sampling rate q) to calibrate sigma.")
        steps, epochs = self.steps, self.epochs
        if (steps is None) == (epochs is None):
            raise FlashDPError(
                f"target_epsilon needs exactly one of steps and epochs. Received steps={steps!r}, epochs={epochs!r}."
            )
        if epochs is not None:
            if not (is_number(epochs) and epochs > 0):
                raise FlashDPError(f"epochs must be positive. Received {epochs!r}.")
            steps = math.ceil(epochs / q)
        if not (is_int(steps) and steps > 0):
            raise FlashDPError(f"steps must be a positive int. Received {steps!r}.")
        return calibrate_noise_multiplier(self.accountant, float(target), float(delta), q, steps)
