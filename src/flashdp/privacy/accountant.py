"""The accountant of one training run: the history of DP-SGD steps taken, and the epsilon they spend (PLD by
default, tight; RDP as an option), cheap enough to ask for at every step (`flashdp.privacy.composition`)."""

from __future__ import annotations

from flashdp._checks import is_number
from flashdp.errors import FlashDPError
from flashdp.privacy.composition import AccountantKind, History, composition


class Accountant:
    """The history of DP-SGD steps as runs of `(noise_multiplier, sample_rate, steps)`, and its epsilon (kept
    per delta until the next step; the composition of all runs but the last is kept across steps)."""

    def __init__(self, kind: AccountantKind) -> None:
        self.kind = kind
        self.history: History = []
        self._composition = composition(kind)
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
            self._cache[delta] = self._composition.epsilon(self.history, delta)
        return self._cache[delta]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "history": [list(run) for run in self.history]}

    def check_state(self, state: object) -> None:
        """Raise FlashDPError unless `state` is an accountant state this accountant can resume from."""
        if not isinstance(state, dict) or not {"kind", "history"} <= set(state):
            raise FlashDPError(
                "Cannot resume: the checkpoint's accountant state lacks 'kind' or 'history' (it was not written by "
                "engine.state_dict())."
            )
        if state["kind"] != self.kind:
            raise FlashDPError(
                f"Cannot resume: the checkpoint used the {state['kind']!r} accountant, not {self.kind!r}."
            )
        history = state["history"]
        if not isinstance(history, list | tuple) or not all(_is_run(run) for run in history):
            raise FlashDPError(
                "Cannot resume: the checkpoint's accountant history is not a list of (noise_multiplier, "
                f"sample_rate, steps) runs. Received {history!r:.200}."
            )

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
        self._cache.clear()


def _is_run(run: object) -> bool:
    if not (isinstance(run, list | tuple) and len(run) == 3):
        return False
    sigma, q, steps = run
    numbers = all(is_number(x) for x in run)
    return numbers and sigma >= 0 and 0 <= q <= 1 and isinstance(steps, int) and steps > 0
