"""The epsilon of a history of DP-SGD steps on Google's dp-accounting, composed incrementally.

A history is a list of runs `(noise_multiplier, sample_rate, steps)` of Poisson-subsampled Gaussian steps. The
values are dp-accounting's own for the same events (`PLDAccountant`, `RdpAccountant`), to the last bit: each run is
composed as `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)` would be, in order. What
makes a call cheap is what is kept between calls: each (sigma, q)'s one-step distribution (building it is most of a
PLD call) and the composition of every run but the last (which grows with every step).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Generic, Literal, TypeVar

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant

AccountantKind = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
#: runs of (noise_multiplier, sample_rate, steps)
History = list[tuple[float, float, int]]

#: dp-accounting's default PLD discretization (the reported epsilon)
PLD_DISCRETIZATION = 1e-4
#: A PLD's size grows with the epsilon it reaches and its steps' loss range, over its discretization: at epsilon in
#: the thousands (a noise multiplier far below any meaningful DP-SGD) it takes gigabytes and minutes. Beyond these
#: the discretization is coarsened, by powers of two, to keep the work bounded; the result is still an upper bound
#: on epsilon (pessimistic discretization), and never above RDP's, which bounds it cheaply.
EXACT_UP_TO_EPSILON = 64.0
MAX_STEP_POINTS = 1_000_000
#: past this discretization a PLD says nothing RDP does not: the RDP bound is reported
MAX_DISCRETIZATION = 0.5
#: the tail mass dp-accounting truncates is below exp(-50): a Gaussian beyond 10 standard deviations
_TAIL_STDS = 10.0
#: one-step distributions kept (a schedule that changes sigma or q every step would otherwise keep them all)
_STEPS_KEPT = 8

Summary = TypeVar("Summary")


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


class Composition(abc.ABC, Generic[Summary]):
    """Epsilon of growing histories. `Summary` is what one accountant composes: a PLD, or an RDP curve."""

    def __init__(self) -> None:
        self._steps: dict[tuple[float, float], Summary] = {}
        self._reset()

    def _reset(self) -> None:
        self._prefix_runs: History = []
        self._prefix = self._identity()

    def epsilon(self, history: History, delta: float) -> float:
        runs = [(float(s), float(q), int(n)) for s, q, n in history if q > 0 and n > 0]  # q = 0 spends nothing
        if not runs:
            return 0.0
        if any(s == 0 for s, _, _ in runs):  # no noise: no privacy
            return math.inf
        with _quiet():
            bound = self._prepare(runs, delta)
            if not self._tractable():
                return bound
            done, last = runs[:-1], runs[-1]
            if self._prefix_runs != done[: len(self._prefix_runs)]:  # another history: start again
                self._reset()
            for run in done[len(self._prefix_runs) :]:
                self._prefix = self._compose(self._prefix, self._run(*run))
                self._prefix_runs.append(run)
            return min(float(self._epsilon(self._compose(self._prefix, self._run(*last)), delta)), bound)

    def _run(self, sigma: float, q: float, steps: int) -> Summary:
        key = (sigma, q)
        if key not in self._steps:
            if len(self._steps) >= _STEPS_KEPT:
                del self._steps[next(iter(self._steps))]
            self._steps[key] = self._one_step(sigma, q)
        return self._repeat(self._steps[key], steps)

    def _prepare(self, runs: History, delta: float) -> float:
        """Before composing `runs`: an upper bound on their epsilon known at no cost (a PLD may also change its
        discretization)."""
        return math.inf

    def _tractable(self) -> bool:
        """Whether composing is worth it after `_prepare` (else its bound is the answer)."""
        return True

    @abc.abstractmethod
    def _identity(self) -> Summary: ...

    @abc.abstractmethod
    def _one_step(self, sigma: float, q: float) -> Summary: ...

    @abc.abstractmethod
    def _repeat(self, step: Summary, steps: int) -> Summary: ...

    @abc.abstractmethod
    def _compose(self, first: Summary, second: Summary) -> Summary: ...

    @abc.abstractmethod
    def _epsilon(self, summary: Summary, delta: float) -> float: ...


class PldComposition(Composition[pld.privacy_loss_distribution.PrivacyLossDistribution]):
    """Privacy loss distributions, as `PLDAccountant(value_discretization_interval=discretization)` composes them
    (pessimistic: never below the true epsilon)."""

    def __init__(self, discretization: float = PLD_DISCRETIZATION) -> None:
        self.requested = discretization
        self.discretization = discretization
        self._rdp = RdpComposition()
        super().__init__()

    def _prepare(self, runs: History, delta: float) -> float:
        """The discretization that bounds the work (see EXACT_UP_TO_EPSILON); RDP's epsilon, an upper bound."""
        bound = self._rdp.epsilon(runs, delta)
        width = max(one_step_loss_width(s, q) for s, q, _ in runs)
        coarsening = max(1.0, bound / EXACT_UP_TO_EPSILON, width / (MAX_STEP_POINTS * self.requested))
        needed = self.requested * 2 ** math.ceil(math.log2(coarsening))
        if needed != self.discretization:
            self.discretization = needed
            self._steps.clear()
            self._reset()
        return bound

    def _tractable(self) -> bool:
        return self.discretization <= MAX_DISCRETIZATION

    def _identity(self):
        return pld.privacy_loss_distribution.identity(value_discretization_interval=self.discretization)

    def _one_step(self, sigma: float, q: float):
        return pld.privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=sigma, value_discretization_interval=self.discretization, sampling_prob=q
        )

    def _repeat(self, step, steps: int):
        return step.self_compose(steps)

    def _compose(self, first, second):
        return first.compose(second)

    def _epsilon(self, summary, delta: float) -> float:
        return summary.get_epsilon_for_delta(delta)


class RdpComposition(Composition[np.ndarray]):
    """Renyi DP curves over dp-accounting's default orders, as `RdpAccountant` composes them."""

    def __init__(self) -> None:
        self.orders = np.asarray(rdp.RdpAccountant().orders)
        super().__init__()

    def _identity(self) -> np.ndarray:
        return np.zeros_like(self.orders, dtype=np.float64)

    def _one_step(self, sigma: float, q: float) -> np.ndarray:
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        return np.asarray(rdp.RdpAccountant().compose(event).rdp)

    def _repeat(self, step: np.ndarray, steps: int) -> np.ndarray:
        return steps * step

    def _compose(self, first: np.ndarray, second: np.ndarray) -> np.ndarray:
        return first + second

    def _epsilon(self, summary: np.ndarray, delta: float) -> float:
        return rdp_privacy_accountant.compute_epsilon(self.orders, summary, delta)[0]


def composition(kind: AccountantKind, discretization: float = PLD_DISCRETIZATION) -> Composition:
    return RdpComposition() if kind == "rdp" else PldComposition(discretization)


def epsilon_of(
    kind: AccountantKind, history: History, delta: float, discretization: float = PLD_DISCRETIZATION
) -> float:
    """Epsilon after the steps in `history`, composed from scratch."""
    return composition(kind, discretization).epsilon(history, delta)


def one_step_loss_width(sigma: float, q: float) -> float:
    """The width of the range of privacy losses of one Poisson-subsampled Gaussian step (add or remove one
    sample), up to dp-accounting's tail truncation: what its PLD spans, in loss units."""
    loss = 1 / (2 * sigma**2) + _TAIL_STDS / sigma  # the Gaussian's largest loss within the truncation
    return _log1p_q_expm1(q, loss) - _log1p_q_expm1(q, -loss)


def _log1p_q_expm1(q: float, x: float) -> float:
    """`log(1 - q + q e^x)`, stable for any x."""
    return float(np.logaddexp(math.log1p(-q) if q < 1 else -math.inf, math.log(q) + x))
