"""Privacy loss distributions (PLDs) composed in the Fourier domain, keeping what the next step needs.

One DP-SGD step's PLD is dp-accounting's pessimistic discretization of a Poisson-subsampled Gaussian mechanism
(`from_gaussian_mechanism`): for each adjacency (remove, add), the probabilities `[m]` of the losses
`discretization * (lower + i)` and the mass of an infinite loss. Composing steps convolves these PMFs. dp-accounting
does it by FFT, one composition at a time; here the `n` steps of a run are the run's transform to the n-th power, a
history is its completed runs' PMF (kept) convolved with the last run, and the transforms are kept across calls: one
more step of the last run costs one complex product, one inverse FFT and one scan for epsilon.

Each run keeps only a window of its losses, chosen by a Chernoff bound so that at most `TAIL_MASS` of its mass lies
outside; that mass is counted as an infinite loss (pessimistic), as dp-accounting counts it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import fft

#: the mass of each run's losses left outside its window (counted as infinite)
TAIL_MASS = 1e-15
#: Chernoff bound orders, in units of 1 / (the one-step PMF's length): moderate, so the moment generating function
#: stays finite
_ORDERS = np.concatenate((np.arange(-20, 0), np.arange(1, 21))).astype(np.float64)
#: the last run's kept power is advanced by products when the run grew by at most this many steps (else one power)
_STEPS_BY_PRODUCT = 16
#: the first chunk of losses the epsilon scan looks at (from the largest down); each next chunk is twice as long
_FIRST_SCAN = 4096


@dataclass(eq=False)
class StepPmf:
    """One step's privacy losses for one adjacency: probabilities `[m]` of the losses `discretization * (lower +
    i)`, and `infinity`, the mass of an infinite loss. `key` names the step in the kept transforms."""

    key: Hashable
    probs: np.ndarray
    lower: int
    infinity: float
    _orders: np.ndarray = field(init=False, repr=False)
    _log_mgfs: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._orders = _ORDERS / len(self.probs)
        positions = np.arange(len(self.probs), dtype=np.float64)
        # |order * position| <= 20: the exponentials neither overflow nor vanish, no shift needed (as logsumexp's)
        with np.errstate(divide="ignore"):
            self._log_mgfs = np.log(np.exp(np.outer(self._orders, positions)) @ self.probs)  # [orders]

    def window(self, steps: int) -> tuple[int, int]:
        """`[first, last]` positions (from `steps * lower`) holding all but `TAIL_MASS` of the `steps`-fold
        composition: by Chernoff, `P(S >= u) <= exp(steps * log E[e^{tX}] - t u)` for `t > 0` (and below for `t < 0`),
        each tail bounded by `TAIL_MASS / 2`."""
        first, last = 0, steps * (len(self.probs) - 1)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            bounds = (steps * self._log_mgfs + math.log(2 / TAIL_MASS)) / self._orders
        finite = np.isfinite(bounds)
        above, below = bounds[finite & (self._orders > 0)], bounds[finite & (self._orders < 0)]
        if above.size:
            last = min(last, math.ceil(above.min()))
        if below.size:
            first = max(first, math.floor(below.max()))
        return first, max(first, last)


@dataclass(frozen=True)
class ComposedPmf:
    """A composition's losses: `probs [L]` at `discretization * (lower + i)`, and the mass of an infinite loss."""

    probs: np.ndarray
    lower: int
    infinity: float


_IDENTITY = ComposedPmf(np.ones(1), 0, 0.0)


class FourierComposition:
    """The composition of a history of runs `(step, steps)` for one adjacency, with the PMF of all runs but the
    last and the last run's transforms kept between calls."""

    def __init__(self) -> None:
        self._prefix_runs: list[tuple[Hashable, int]] = []
        self._prefix = _IDENTITY
        self._size = 0
        self._prefix_transform = np.ones(1, dtype=np.complex128)
        self._last: tuple[Hashable, np.ndarray, int, np.ndarray] | None = None  # key, transform, n, transform**n

    def compose(self, runs: Sequence[tuple[StepPmf, int]]) -> ComposedPmf:
        """The PMF of the runs composed in order."""
        self._advance_prefix(runs[:-1])
        return self._extend(*runs[-1])

    def _advance_prefix(self, done: Sequence[tuple[StepPmf, int]]) -> None:
        """Make the kept prefix the composition of `done`: extended by the new runs when the kept one is a prefix of
        them, composed again from the start when not."""
        keys = [(step.key, steps) for step, steps in done]
        if keys[: len(self._prefix_runs)] != self._prefix_runs:
            self._prefix_runs, self._prefix, self._size = [], _IDENTITY, 0
        for i in range(len(self._prefix_runs), len(done)):
            self._prefix = _truncated(self._extend(*done[i]))
            self._prefix_runs.append(keys[i])
            self._size = 0  # the kept transform is the previous prefix's

    def _extend(self, step: StepPmf, steps: int) -> ComposedPmf:
        """The kept prefix composed with `steps` steps of `step`, in the window of the steps' Chernoff bound."""
        first, last = step.window(steps)
        length = len(self._prefix.probs) + last - first
        size = fft.next_fast_len(length, real=True)
        if size != self._size:
            self._size, self._last = size, None
            self._prefix_transform = fft.rfft(self._prefix.probs, size)
        spectrum = self._prefix_transform * self._power(step, steps, size)
        probs = _window(fft.irfft(spectrum, size), first, length)
        prefix = self._prefix
        infinity = -math.expm1(math.log1p(-prefix.infinity) + steps * math.log1p(-step.infinity)) + TAIL_MASS
        return ComposedPmf(probs, prefix.lower + steps * step.lower + first, infinity)

    def _power(self, step: StepPmf, steps: int, size: int) -> np.ndarray:
        """The step's transform at `size` to the `steps`-th power, advanced from the kept one when the run grew by a
        few steps (the kept one is of this size: it is dropped when the size changes)."""
        kept = self._last
        if kept is not None and kept[0] == step.key:
            transform, power = kept[1], kept[3]
            if 0 <= steps - kept[2] <= _STEPS_BY_PRODUCT:
                for _ in range(steps - kept[2]):
                    power = power * transform
            else:
                power = transform**steps
        else:
            transform = fft.rfft(step.probs, size)
            power = transform**steps
        self._last = (step.key, transform, steps, power)
        return power


def _truncated(pmf: ComposedPmf) -> ComposedPmf:
    """The composition with at most `TAIL_MASS / 2` of its losses at each end folded pessimistically: the lowest
    moved up onto the lowest loss kept, the highest counted as infinite. Keeps a prefix of many runs as long as its
    mass spreads (each run's window alone would add its whole width)."""
    probs = pmf.probs
    below = np.cumsum(probs)
    first = int(np.searchsorted(below, TAIL_MASS / 2, side="right"))
    above = np.cumsum(probs[::-1])
    end = len(probs) - int(np.searchsorted(above, TAIL_MASS / 2, side="right"))
    if first >= end:  # (not for a distribution of mass near 1: kept whole)
        return pmf
    kept = probs[first:end].copy()
    kept[0] += below[first - 1] if first else 0.0
    dropped = float(above[len(probs) - end - 1]) if end < len(probs) else 0.0
    return ComposedPmf(kept, pmf.lower + first, pmf.infinity + max(dropped, 0.0))


def _window(values: np.ndarray, start: int, length: int) -> np.ndarray:
    """`length` values from `start`, wrapping around the end (a circular convolution's window)."""
    start %= len(values)
    if start + length <= len(values):
        return values[start : start + length]
    return np.concatenate((values[start:], values[: start + length - len(values)]))


def epsilon_for_delta(pmf: ComposedPmf, discretization: float, delta: float) -> float:
    """The smallest epsilon >= 0 whose hockey-stick divergence is at most `delta`: the losses are scanned from the
    largest down, in chunks, keeping `upper` (the mass at or above the scanned losses, infinity included) and `lower`
    (the same mass weighted by `e^-loss`); epsilon is `log((upper - delta) / lower)` once that is at least the next
    loss (the scan of dp-accounting's `get_epsilon_for_delta`, vectorized), and 0 when the divergence at 0 is
    already at most `delta`."""
    if pmf.infinity > delta:
        return math.inf
    upper, lower = pmf.infinity, 0.0
    end, chunk = len(pmf.probs), _FIRST_SCAN
    while end > 0:
        start = max(0, end - chunk)
        probs = pmf.probs[start:end][::-1]
        losses = (pmf.lower + np.arange(end - 1, start - 1, -1)) * discretization
        uppers = np.cumsum(np.concatenate(([upper], probs)))  # [k]: before the k-th loss of the chunk
        with np.errstate(over="ignore", invalid="ignore"):  # far below any epsilon: past where the scan stops
            lowers = np.cumsum(np.concatenate(([lower], np.exp(-losses) * probs)))
        found = _first_stop(uppers, lowers, losses, delta)
        if found is not None:
            return found
        upper, lower = float(uppers[-1]), float(lowers[-1])
        end, chunk = start, 2 * chunk
    return _from_masses(upper, lower, delta)


def _first_stop(uppers: np.ndarray, lowers: np.ndarray, losses: np.ndarray, delta: float) -> float | None:
    """Where the scan of one chunk stops: before loss k when `log((upper - delta) / lower) >= loss_k` (epsilon is
    that log), or after it when `e^-loss` underflowed with `upper >= delta` (epsilon is the loss)."""
    before_u, before_l = uppers[:-1], lowers[:-1]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        candidate = np.log((before_u - delta) / before_l)
    reached = (before_u > delta) & (before_l > 0) & (candidate >= losses)
    underflow = (uppers[1:] >= delta) & (lowers[1:] == 0)
    stop = np.flatnonzero(reached | underflow)
    if stop.size == 0:
        return None
    k = int(stop[0])
    if reached[k]:
        return _from_masses(float(before_u[k]), float(before_l[k]), delta)
    return max(0.0, float(losses[k]))


def _from_masses(upper: float, lower: float, delta: float) -> float:
    """Epsilon from the masses where the scan stopped: 0 when the divergence at 0 is already at most delta."""
    return 0.0 if upper <= lower + delta else math.log((upper - delta) / lower)
