"""An empirical lower bound on epsilon for your own training run: a one-run canary audit.

The audit follows Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023), with
white-box Dirac canaries. There are m canaries. Each is a record whose gradient is `canary_norm` (10 C by default)
times +-1 on one coordinate of the model's trainable parameters, a different coordinate for each canary. Each canary
is in the training set with probability 1/2, decided once by a secret coin. At every `engine.step()` each canary
in the set is sampled with the run's probability q, like any record. It is clipped by the engine's own clipping
coefficients and added to the gradient sum before the engine's noise, averaging and optimizer step. After training,
each canary's score is how far its coordinate moved in the canary's direction. The top scores are guessed "in", the
bottom scores "out".

If the run is (epsilon, delta)-DP, the number of correct guesses among r is at most Binomial(r, e^eps / (1 +
e^eps)), up to a term in delta (their Theorem 3.1; here the term is bounded by 2 m delta, which is conservative).
The audit reports the largest epsilon that this rejects at the chosen confidence. A lower bound above the
accountant's epsilon means the run leaks more than it claims: clipping that does not bound a sample's contribution,
noise that is missing or smaller than accounted, or a sampling rate or step count the accountant does not know.

What it cannot show:
- The bound is usually far below the accountant's epsilon even for a correct run, and it cannot exceed about
  log(r / 3) with r guesses (all correct): 3.3 for 100 guesses. A run claiming a larger epsilon cannot be shown to
  violate it.
- Dirac canaries go through the clipping coefficients, noise, averaging, optimizer and accountant, but not through
  the model's forward and backward. A wrong per-sample norm computed for real data is the self-check's to catch
  (`make_private(self_check=...)`), not the audit's.
- It runs in one process (not under DDP or FSDP). The canary coordinates also move with the real data's gradients,
  which weakens the bound but never makes it invalid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats
from torch import Tensor

from flashdp.engine import DPEngine
from flashdp.errors import FlashDPError
from flashdp.privacy import keyed

#: the canary's gradient norm before clipping, in units of C: a run whose clipping does not bound it shows
CANARY_NORM_IN_C = 10.0


@dataclass(frozen=True)
class AuditResult:
    """What an audit found, against what the accountant claims, at `delta`."""

    epsilon_lower_bound: float
    epsilon_claimed: float
    delta: float
    confidence: float
    guesses: int
    correct: int

    @property
    def violation(self) -> bool:
        """The run leaks more than the accountant claims (with probability at least `confidence`)."""
        return self.epsilon_lower_bound > self.epsilon_claimed

    def __str__(self) -> str:
        verdict = (
            "VIOLATION: the run leaks more than its accountant claims"
            if self.violation
            else "no violation found (which does not prove the guarantee)"
        )
        return (
            f"{verdict}: epsilon >= {self.epsilon_lower_bound:.3g} with confidence {self.confidence:g} "
            f"({self.correct} of {self.guesses} canary guesses correct), accountant's epsilon "
            f"{self.epsilon_claimed:.3g} at delta {self.delta:g}."
        )


class CanaryAudit:
    """Canaries for one training run with `engine`; create it before the first step, read `result()` after.

    canaries: m, at most the number of trainable coordinates. guesses: how many canaries are guessed (half "in",
    half "out"), fixed before training (default m / 5). seed: of the canaries' coins, coordinates, signs and
    sampling (default: OS entropy); it must stay secret from whoever is audited.
    """

    def __init__(
        self, engine: DPEngine, canaries: int = 1000, guesses: int | None = None, seed: int | None = None
    ) -> None:
        if engine.sample_rate is None:
            raise FlashDPError("The audit samples canaries like records: make_private(..., sample_rate=q) is needed.")
        step = engine.noisy_step
        if step.world_size > 1:
            raise FlashDPError("The audit runs in one process: it does not support DDP or FSDP.")
        holders = step.parameters()
        sizes = [p.numel() for p in holders]
        if not (isinstance(canaries, int) and 2 <= canaries <= sum(sizes)):
            raise FlashDPError(
                f"canaries must be an int from 2 to the number of trainable coordinates ({sum(sizes)}). "
                f"Received {canaries!r}."
            )
        guesses = max(2, canaries // 5) if guesses is None else guesses
        if not (isinstance(guesses, int) and 2 <= guesses <= canaries):
            raise FlashDPError(f"guesses must be an int from 2 to canaries ({canaries}). Received {guesses!r}.")
        self.engine = engine
        self.canaries = canaries
        self.guesses = guesses
        self._generator = (
            torch.Generator().manual_seed(seed)
            if seed is not None
            else keyed.keyed_generator(keyed.secret_key(), 0, torch.device("cpu"))
        )
        self._holders = holders
        flat = torch.randperm(sum(sizes), generator=self._generator, device="cpu")[:canaries]
        ends = torch.tensor(sizes, device="cpu").cumsum(0)
        self._param_index = torch.bucketize(flat, ends, right=True)
        self._offsets = flat - torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), ends])[self._param_index]
        self._signs = torch.randint(0, 2, (canaries,), generator=self._generator, device="cpu").float() * 2 - 1
        self.included = torch.rand(canaries, generator=self._generator, device="cpu") < 0.5
        self._start = self._coordinates().clone()
        self._hook = step.register_hook(self._add_canaries)

    def _coordinates(self) -> Tensor:
        """`[m]` the canaries' coordinates of the parameters, float64."""
        with torch.no_grad():
            flat = [p.detach().reshape(-1) for p in self._holders]
            pairs = zip(self._param_index.tolist(), self._offsets.tolist(), strict=True)
            return torch.stack([flat[i][o].double().cpu() for i, o in pairs])

    def _add_canaries(self) -> None:
        """At `engine.step()`, before the noise: each canary in the set, sampled with probability q, added to the
        gradient sum with the engine's clipping coefficient."""
        engine = self.engine
        coins = torch.rand(self.canaries, generator=self._generator, device="cpu")
        sampled = self.included & (coins < engine.sample_rate)
        chosen = sampled.nonzero().flatten()
        if not len(chosen):
            return
        groups, group_of_param = engine.noisy_step.clip_groups()
        norm = CANARY_NORM_IN_C * engine.max_grad_norm
        group_of = torch.tensor(group_of_param, device="cpu")[self._param_index[chosen]]
        norms_sq = torch.zeros(groups, len(chosen), dtype=torch.float64, device="cpu")
        norms_sq[group_of, torch.arange(len(chosen), device="cpu")] = norm**2
        coef = engine.noisy_step.clip_coefficients(norms_sq)
        contribution = coef[group_of, torch.arange(len(chosen), device="cpu")] * norm * self._signs[chosen].double()
        with torch.no_grad():
            for k, value in zip(chosen.tolist(), contribution.tolist(), strict=True):
                grad = self._holders[int(self._param_index[k])].grad.view(-1)
                grad[int(self._offsets[k])] += value

    def scores(self) -> Tensor:
        """`[m]` how far each canary's coordinate moved against its gradient (a step descends it) since the start."""
        return (self._start - self._coordinates()) * self._signs.double()

    def result(self, delta: float, confidence: float = 0.95) -> AuditResult:
        """The lower bound on epsilon at `delta`, with `confidence`, and the accountant's epsilon."""
        order = torch.argsort(self.scores(), descending=True)
        half = self.guesses // 2
        guessed_in, guessed_out = order[: self.guesses - half], order[len(order) - half :]
        correct = int(self.included[guessed_in].sum()) + int((~self.included[guessed_out]).sum())
        bound = epsilon_lower_bound(self.guesses, correct, self.canaries, delta, 1 - confidence)
        return AuditResult(bound, self.engine.epsilon(delta), delta, confidence, self.guesses, correct)

    def detach(self) -> None:
        """Stop adding canaries (the run's parameters keep what they received)."""
        self._hook.remove()


def epsilon_lower_bound(guesses: int, correct: int, canaries: int, delta: float, beta: float) -> float:
    """The largest epsilon such that `correct` or more right guesses out of `guesses` has probability below `beta`
    under (epsilon, delta)-DP: `P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 m delta < beta`. 0 if none."""

    def p_value(epsilon: float) -> float:
        p = 1 / (1 + math.exp(-epsilon))
        return float(stats.binom.sf(correct - 1, guesses, p)) + 2 * canaries * delta

    if p_value(0.0) >= beta:
        return 0.0
    lower, upper = 0.0, 1.0
    while p_value(upper) < beta:
        lower, upper = upper, upper * 2
        if upper > 1e3:
            return math.inf
    for _ in range(60):
        middle = (lower + upper) / 2
        lower, upper = (middle, upper) if p_value(middle) < beta else (lower, middle)
    return lower
