"""Noise, accounting and calibration for DP-SGD."""

from flashdp.privacy.accountant import Accountant
from flashdp.privacy.calibration import calibrate_noise_multiplier
from flashdp.privacy.composition import ACCOUNTANTS, AccountantKind, epsilon_of
from flashdp.privacy.noise import NoiseSource
from flashdp.privacy.planning import get_epsilon, get_noise_multiplier

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "AccountantKind",
    "NoiseSource",
    "calibrate_noise_multiplier",
    "epsilon_of",
    "get_epsilon",
    "get_noise_multiplier",
]
