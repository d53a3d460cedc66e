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


#: PLD discretization while calibrating: 10x faster than the default 1e-4 and pessimistic (never below it).
_SEARCH_DISCRETIZATION = 1e-3


def _fresh(kind: AccountantKind, discretization: float | None = None) -> dp_accounting.PrivacyAccountant:
    if kind == "rdp":
        return rdp.RdpAccountant()
    return (
        pld.PLDAccountant()
        if discretization is None
        else pld.PLDAccountant(value_discretization_interval=discretization)
    )


def _step_event(noise_multiplier: float, sample_rate: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))


def epsilon_of(
    kind: AccountantKind, history: list[tuple[float, float, int]], delta: float, discretization: float | None = None
) -> float:
    """Epsilon after the steps in `history`: runs of (noise_multiplier, sample_rate, steps)."""
    if not history:
        return 0.0
    events = [dp_accounting.SelfComposedDpEvent(_step_event(s, q), n) for s, q, n in history]
    accountant = _fresh(kind, discretization)
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
    """A sigma whose epsilon after `steps` (with the reporting accountant) lies in [0.99 * target, target].

    Bisection on sigma between a bracket found by doubling; PLD searches with a coarser discretization (an upper
    bound on the reported epsilon), and the result is checked with the reporting accountant.
    """

    def search_epsilon(sigma: float) -> float:
        return epsilon_of(kind, [(sigma, sample_rate, steps)], target_delta, _SEARCH_DISCRETIZATION)

    def final_epsilon(sigma: float) -> float:
        return epsilon_of(kind, [(sigma, sample_rate, steps)], target_delta)

    upper = 1.0
    while search_epsilon(upper) > target_epsilon:
        upper *= 2
        if upper > 1e6:
            raise FlashDPError(
                f"No noise multiplier up to 1e6 reaches epsilon {target_epsilon} at delta {target_delta}."
            )
    lower = upper / 2
    while search_epsilon(lower) <= target_epsilon:
        upper, lower = lower, lower / 2
        if lower < 1e-3:
            raise FlashDPError(
                f"target_epsilon={target_epsilon} is reached with almost no noise (sigma < 0.001); "
                "DP-SGD at this epsilon is not meaningful. Lower the target or give noise_multiplier."
            )
    for evaluate in (search_epsilon, final_epsilon):
        upper = _bisect(evaluate, lower, upper, target_epsilon)
    return upper


def _bisect(epsilon, lower: float, upper: float, target: float) -> float:
    """Shrink [lower, upper], with epsilon(lower) > target >= epsilon(upper), until epsilon(upper) >= 0.99 target."""
    value = epsilon(upper)
    for _ in range(60):
        if value >= 0.99 * target:
            break
        middle = (lower + upper) / 2
        middle_value = epsilon(middle)
        if middle_value <= target:
            upper, value = middle, middle_value
        else:
            lower = middle
    return upper
