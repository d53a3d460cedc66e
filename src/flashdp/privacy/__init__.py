"""Noise, accounting and calibration for DP-SGD."""

from flashdp.privacy.accountant import ACCOUNTANTS, Accountant, AccountantKind, calibrate_noise_multiplier, epsilon_of
from flashdp.privacy.noise import NoiseSource

__all__ = ["ACCOUNTANTS", "Accountant", "AccountantKind", "NoiseSource", "calibrate_noise_multiplier", "epsilon_of"]
