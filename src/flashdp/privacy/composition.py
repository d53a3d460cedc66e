"""The epsilon of a history of DP-SGD steps on Google's dp-accounting, cheap to ask after every step.

A history is a list of runs `(noise_multiplier, sample_rate, steps)` of Poisson-subsampled Gaussian steps.
- PLD (the default): dp-accounting's one-step privacy loss distribution (`from_gaussian_mechanism`, pessimistic),
  composed in the Fourier domain with its transforms kept between calls (`flashdp.privacy.fourier_pld`). The result
  agrees with dp-accounting's `PLDAccountant` over the same events to rounding (relative 1e-9 in the tests); it is
  reported `MARGIN` (relative) and `ABSOLUTE_MARGIN` higher, so it is never below dp-accounting's and within 1e-6 of
  it, or RDP's bound where that is lower. Below `FOURIER_DELTA_FLOOR`, dp-accounting composes the history itself.
- RDP: dp-accounting's `RdpAccountant` curve of each (sigma, q), summed over the runs: its value to the last bit.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Literal

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant

from flashdp.errors import FlashDPError
from flashdp.privacy.fourier_pld import FourierComposition, StepPmf, epsilon_for_delta

AccountantKind = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
#: runs of (noise_multiplier, sample_rate, steps)
History = list[tuple[float, float, int]]

#: dp-accounting's default PLD discretization (the reported epsilon)
PLD_DISCRETIZATION = 1e-4
#: PLD epsilons are reported this much (relative) above the composition's, plus `ABSOLUTE_MARGIN`: more than its
#: rounding differences from dp-accounting's (below 1e-9 relative in the tests), so the report is an upper bound on
#: dp-accounting's value
MARGIN = 1e-6
#: ... and this much absolute: near epsilon 0 the relative margin is too thin for the two's rounding
ABSOLUTE_MARGIN = 1e-9
#: Below this delta the epsilon depends on losses whose mass is under the Fourier composition's rounding (an
#: adversarial search found it up to 4% below dp-accounting's at delta 1e-14, in step at 1e-9): there the history is
#: composed by dp-accounting itself, as slowly as before.
FOURIER_DELTA_FLOOR = 1e-8
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


def _spending(history: History) -> History:
    """The runs that spend privacy (a sample rate of 0 spends nothing), as floats and ints."""
    return [(float(s), float(q), int(n)) for s, q, n in history if q > 0 and n > 0]


#: noise multipliers below this count as none: the accountants' arithmetic (1 / sigma^2) leaves float64 near 1e-154
#: (dp-accounting's RDP then reports epsilon 0, its PLD overflows); at 1e-100 one step already costs ~1e200
NEGLIGIBLE_SIGMA = 1e-100


def _trivial(runs: History) -> float | None:
    """The epsilon of histories that need no composing: none (0), or a step without noise (inf)."""
    if not runs:
        return 0.0
    if any(s < NEGLIGIBLE_SIGMA for s, _, _ in runs):
        return math.inf
    return None


class _Kept(dict):
    """One-step values by (sigma, q): those of the latest history's runs (every composition needs each of them;
    rebuilding a PLD costs about 0.3 s), the others dropped."""

    def of(self, runs: History, build: Callable[[float, float], object]) -> list:
        """Each run's one-step value, `build(sigma, q)` where not kept; the values of other (sigma, q) dropped."""
        wanted = {(sigma, q) for sigma, q, _ in runs}
        for key in [k for k in self if k not in wanted]:
            del self[key]
        for key in wanted - self.keys():
            self[key] = build(*key)
        return [self[(sigma, q)] for sigma, q, _ in runs]


class RdpComposition:
    """Renyi DP curves over dp-accounting's default orders, summed as `RdpAccountant` composes them."""

    def __init__(self) -> None:
        self.orders = np.asarray(rdp.RdpAccountant().orders)
        self._steps = _Kept()

    def epsilon(self, history: History, delta: float) -> float:
        runs = _spending(history)
        trivial = _trivial(runs)
        if trivial is not None:
            return trivial
        curve = np.zeros_like(self.orders, dtype=np.float64)
        with _quiet():
            for one_step, (_, _, steps) in zip(self._steps.of(runs, _rdp_one_step), runs, strict=True):
                curve = curve + steps * one_step
            return rdp_privacy_accountant.compute_epsilon(self.orders, curve, delta)[0]


def _rdp_one_step(sigma: float, q: float) -> np.ndarray:
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    return np.asarray(rdp.RdpAccountant().compose(event).rdp)


class PldComposition:
    """Privacy loss distributions at `discretization`, as `PLDAccountant(value_discretization_interval=...)` composes
    them (pessimistic: never below the true epsilon), one composition per adjacency (remove, add)."""

    def __init__(self, discretization: float = PLD_DISCRETIZATION) -> None:
        self.requested = discretization
        self.discretization = discretization
        self._rdp = RdpComposition()
        self._reset()

    def _reset(self) -> None:
        self._steps = _Kept()
        self._adjacencies = (FourierComposition(), FourierComposition())

    def epsilon(self, history: History, delta: float) -> float:
        runs = _spending(history)
        trivial = _trivial(runs)
        if trivial is not None:
            return trivial
        bound = self._rdp.epsilon(runs, delta)
        if not math.isfinite(bound):  # (delta 0: no finite epsilon)
            return bound
        self._choose_discretization(runs, bound)
        if self.discretization > MAX_DISCRETIZATION:  # a PLD says nothing RDP does not
            return bound
        if delta < FOURIER_DELTA_FLOOR:
            return min(_composed_by_dp_accounting(runs, delta, self.discretization), bound)
        with _quiet():
            steps = list(zip(self._steps.of(runs, self._one_step), (n for _, _, n in runs), strict=True))
        adjacencies = 1 if all(remove is add for (remove, add), _ in steps) else 2
        value = max(
            epsilon_for_delta(composer.compose([(pair[a], n) for pair, n in steps]), self.discretization, delta)
            for a, composer in enumerate(self._adjacencies[:adjacencies])
        )
        return min(value * (1 + MARGIN) + ABSOLUTE_MARGIN, bound)

    def _choose_discretization(self, runs: History, bound: float) -> None:
        """The discretization that bounds the work (see EXACT_UP_TO_EPSILON), given RDP's epsilon `bound`."""
        width = max(one_step_loss_width(s, q) for s, q, _ in runs)
        coarsening = max(1.0, bound / EXACT_UP_TO_EPSILON, width / (MAX_STEP_POINTS * self.requested))
        needed = self.requested * 2 ** math.ceil(math.log2(coarsening))
        if needed != self.discretization:
            self.discretization = needed
            self._reset()

    def _one_step(self, sigma: float, q: float) -> tuple[StepPmf, StepPmf]:
        """The step's (remove, add) PMFs; the same object twice where dp-accounting's PLD is symmetric."""
        distribution = pld.privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=sigma, value_discretization_interval=self.discretization, sampling_prob=q
        )
        remove = _step_pmf((sigma, q, "remove"), distribution, "_pmf_remove")
        add = (
            remove if _internal(distribution, "_symmetric") else _step_pmf((sigma, q, "add"), distribution, "_pmf_add")
        )
        return remove, add


def _composed_by_dp_accounting(runs: History, delta: float, discretization: float) -> float:
    """dp-accounting's `PLDAccountant` over the history's events, composed from scratch."""
    accountant = pld.PLDAccountant(value_discretization_interval=discretization)
    with _quiet():
        for sigma, q, steps in runs:
            event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
            accountant.compose(event, steps)
        return accountant.get_epsilon(delta)


def _step_pmf(key: tuple, distribution: object, adjacency: str) -> StepPmf:
    dense = _internal(distribution, adjacency).to_dense_pmf()
    return StepPmf(key, _internal(dense, "_probs"), _internal(dense, "_lower_loss"), _internal(dense, "_infinity_mass"))


def _internal(obj: object, name: str):
    """An attribute of dp-accounting's PLD classes that it documents but does not make public."""
    if not hasattr(obj, name):
        raise FlashDPError(
            f"This dp-accounting version's {type(obj).__name__} has no {name!r}, which flashdp reads to compose "
            "privacy loss distributions. Install a dp-accounting version flashdp supports (see its pyproject), "
            'or account with accountant="rdp".'
        )
    return getattr(obj, name)


def composition(kind: AccountantKind, discretization: float = PLD_DISCRETIZATION) -> PldComposition | RdpComposition:
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
