"""Privacy accounting on Google's dp-accounting: the Poisson-subsampled Gaussian mechanism, composed over the
steps actually taken. PLD by default (tight), RDP as an option."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Literal

import dp_accounting
from dp_accounting import pld, rdp

from flashdp.errors import FlashDPError

AccountantKind = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dp-accounting logs (through absl) every RDP order near 1 it drops for not converging; they are harmless."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _fresh(kind: AccountantKind) -> dp_accounting.PrivacyAccountant:
    return pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant()


def _step_event(noise_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))


def epsilon_of(kind: AccountantKind, history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon after the steps in `history`: runs of (noise_multiplier, sample_rate, steps)."""
    if not history:
        return 0.0
    events = [dp_accounting.SelfComposedDpEvent(_step_event(s, q), n) for s, q, n in history]
    accountant = _fresh(kind)
    with _quiet():
        accountant.compose(dp_accounting.ComposedDpEvent(events))
        return float(accountant.get_epsilon(delta))


class Accountant:
    """The history of DP-SGD steps, and the epsilon it spends (cached per delta until the next step)."""

    def __init__(self, kind: AccountantKind) -> None:
        self.kind = kind
        self.history: list[tuple[float, float, int]] = []
        self._cache: dict[float, float] = {}

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.history)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, n = self.history[-1]
            self.history[-1] = (sigma, q, n + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))
        self._cache.clear()

    def epsilon(self, delta: float) -> float:
        if delta not in self._cache:
            self._cache[delta] = epsilon_of(self.kind, self.history, delta)
        return self._cache[delta]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] != self.kind:
            raise FlashDPError(
                f"Cannot resume: the checkpoint used the {state['kind']!r} accountant, not {self.kind!r}."
            )
        self.history = [tuple(entry) for entry in state["history"]]
        self._cache.clear()


def calibrate_noise_multiplier(
    kind: AccountantKind, target_epsilon: float, target_delta: float, sample_rate: float, steps: int
) -> float:
    """The smallest sigma (to within 1% of the target epsilon) whose epsilon after `steps` is at most the target.

    RDP brackets the search first (cheap, and never tighter than PLD, so its sigma is a safe upper end); the
    requested accountant then refines inside that bracket.
    """

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_step_event(sigma, sample_rate), steps)

    def calibrate(accountant: AccountantKind, bracket, tol: float) -> float:
        with _quiet():
            return float(
                dp_accounting.calibrate_dp_mechanism(
                    lambda: _fresh(accountant), make_event, target_epsilon, target_delta, bracket, tol=tol
                )
            )

    upper = calibrate("rdp", dp_accounting.LowerEndpointAndGuess(1e-2, 1.0), 1e-4)
    if kind == "rdp":
        return upper
    lower = upper / 2
    while lower > 0.05 and epsilon_of(kind, [(lower, sample_rate, steps)], target_delta) <= target_epsilon:
        lower /= 2
    tol = upper * 1e-3
    while True:
        sigma = calibrate(kind, dp_accounting.ExplicitBracketInterval(lower, upper), tol)
        if epsilon_of(kind, [(sigma, sample_rate, steps)], target_delta) >= 0.99 * target_epsilon or tol < 1e-9:
            return sigma
        tol /= 10
