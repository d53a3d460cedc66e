"""Per-phase wall-clock breakdown of DP steps: `make_private(..., profile=True)` or `FLASHDP_PROFILE=1`."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

import torch

PHASES = (
    "forward",
    "checks",
    "norm pass",
    "norm computation",
    "communication",
    "second pass / bk sums",
    "noise",
    "optimizer",
)


def profiling_requested(flag: bool | None) -> bool:
    return bool(flag) if flag is not None else os.environ.get("FLASHDP_PROFILE", "") not in ("", "0")


class PhaseTimer:
    """Accumulates seconds per phase; `report()` prints them and starts over. Synchronises CUDA around phases so
    that GPU time lands in the phase that queued it. Disabled, it costs nothing."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._forward_start: float | None = None
        self._nested: list[float] = []  # seconds spent in phases nested in each open phase
        self._reported_strategies: dict[str, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase; a phase nested in another (a collective inside the bk sums) counts only for itself."""
        if not self.enabled:
            yield
            return
        _sync()
        start = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            _sync()
            elapsed = time.perf_counter() - start
            inner = self._nested.pop()
            self.seconds[name] += elapsed - inner
            if self._nested:
                self._nested[-1] += elapsed

    def forward_started(self) -> None:
        """A trainable layer ran with grad enabled; the forward phase runs until the next backward."""
        if self.enabled and self._forward_start is None:
            self._forward_start = time.perf_counter()

    def forward_ended(self) -> None:
        if self.enabled and self._forward_start is not None:
            _sync()
            self.seconds["forward"] += time.perf_counter() - self._forward_start
            self._forward_start = None

    def report(self, step: int, strategies: dict[str, str]) -> None:
        """Print the phases of the step; and how each parameter's norm was computed, when that changed."""
        if not self.enabled:
            return
        total = sum(self.seconds.values()) or 1.0
        lines = [f"flashdp step {step}: {total * 1000:.2f} ms"]
        lines += [f"  {name:<22s} {s * 1000:9.2f} ms  {100 * s / total:5.1f}%" for name, s in self.seconds.items()]
        if strategies != self._reported_strategies:
            lines += strategy_lines(strategies)
            self._reported_strategies = dict(strategies)
        print("\n".join(lines), file=self.stream or sys.stderr)
        self.seconds = dict.fromkeys(PHASES, 0.0)


#: parameters named per strategy in the report, at most
_NAMED = 6


def strategy_lines(strategies: dict[str, str]) -> list[str]:
    """`  norms: direct 12, ghost 4, per-sample 20, generic 2 ('cls_token', 'pos_embed')`: the per-sample
    gradients of the generic rule are the fallback to look at when a model is slow."""
    by_strategy: dict[str, list[str]] = {}
    for name, strategy in strategies.items():
        by_strategy.setdefault(strategy, []).append(name)
    parts = []
    for strategy, names in sorted(by_strategy.items()):
        named = ""
        if strategy == "generic":
            shown = ", ".join(f"'{n}'" for n in names[:_NAMED])
            named = f" ({shown}{', ...' if len(names) > _NAMED else ''})"
        parts.append(f"{strategy} {len(names)}{named}")
    return [f"  norms: {', '.join(parts)}"] if parts else []


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
