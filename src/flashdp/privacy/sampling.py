"""Whether the batches a run trains on look Poisson-sampled at the rate its epsilon assumes.

The engine sees each step's batch size. Under Poisson sampling at rate q the size is Poisson-distributed around
its mean `mu = q * N` (binomial, variance at most mu); batches of one fixed size (a shuffled DataLoader), or a mean
far from `mu` (a sample_rate that is not the loader's), are caught with a false-alarm probability below 1e-6.
"""

from __future__ import annotations

import math

from scipy.stats import norm

#: the probability, under true Poisson sampling, of the evidence that raises a warning
FALSE_ALARM = 1e-6
#: steps seen before the mean batch size is judged
MIN_STEPS_FOR_MEAN = 10
#: |z| of the mean batch size beyond which a mean that far off has probability FALSE_ALARM
MEAN_Z = float(norm.isf(FALSE_ALARM / 2))


class SamplingMonitor:
    """Batch sizes seen per step (on this rank), judged against their expected mean `mu` on this rank. Keeps only
    their count, their sum and whether all were equal: a constant cost per step, however long the run."""

    def __init__(self, expected_size: float, sample_rate: float | None = None) -> None:
        self.count = 0
        self.total = 0
        self.first_size: int | None = None
        self.all_equal = True
        self.finding: str | None = None  # set once: what was found
        self.expect(expected_size, sample_rate)

    def expect(self, expected_size: float, sample_rate: float | None) -> None:
        """The mean batch size to expect from now on, and the rate: at q = 1 every batch is the whole dataset, one
        size, as Poisson sampling at that rate gives."""
        self.expected_size = expected_size
        self._whole_dataset = sample_rate == 1
        # each repeat of one size has at most this log-probability under Poisson sampling
        self._log_likeliest = _log_max_poisson_pmf(expected_size)

    def record(self, size: int) -> str | None:
        """Add one step's batch size; the finding if this step makes it (once per run), else None."""
        self.count += 1
        self.total += size
        if self.first_size is None:
            self.first_size = size
        self.all_equal = self.all_equal and size == self.first_size
        if self.finding is not None:
            return None
        self.finding = self._constant_sizes() or self._wrong_mean()
        return self.finding

    def _constant_sizes(self) -> str | None:
        """Every batch of one size: under Poisson sampling each repeat has probability at most the largest
        probability of any one size."""
        if self.count < 2 or not self.all_equal or self._whole_dataset:
            return None
        if (self.count - 1) * self._log_likeliest > math.log(FALSE_ALARM):
            return None
        return (
            f"every one of the last {self.count} batches had exactly {self.first_size} samples. Poisson sampling "
            "gives varying batch sizes, and epsilon() assumes it: a DataLoader with a fixed batch_size spends more "
            "privacy than reported. Build the loader with engine.data_loader(dataset) (or flashdp.poisson_loader)."
        )

    def _wrong_mean(self) -> str | None:
        if self.count < MIN_STEPS_FOR_MEAN or self.expected_size <= 0:
            return None
        mean = self.total / self.count
        z = (mean - self.expected_size) / math.sqrt(self.expected_size / self.count)
        if abs(z) < MEAN_Z:
            return None
        return (
            f"the mean batch size over {self.count} steps is {mean:.1f} samples where the engine expects "
            f"{self.expected_size:.1f} (expected_batch_size per rank): either the loader does not sample at the "
            "engine's sample_rate (then epsilon() does not describe this run) or expected_batch_size is not "
            "sample_rate * len(dataset). Give make_private the loader's rate, or build the loader with "
            "engine.data_loader(dataset)."
        )


def _log_max_poisson_pmf(mu: float) -> float:
    """log of the largest probability of any one value of a Poisson(mu) variable (at its mode, floor(mu))."""
    if mu <= 0:
        return 0.0
    k = math.floor(mu)
    return k * math.log(mu) - mu - math.lgamma(k + 1) if k > 0 else -mu
