"""Matrix-multiply FLOPs of a function, counted by `torch.utils.flop_counter.FlopCounterMode` without its module
tracker: the tracker's global forward hooks would have flashdp compare each layer's output with its rule's forward
(a hook that runs before the engine's may have changed it), and those comparisons' FLOPs would be counted too."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.flop_counter import FlopCounterMode


class _Global:
    """In place of the module tracker: every FLOP counted under "Global" only."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _Global:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def counted_flops(run: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """The total FLOPs of `run()`, and per op."""
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _Global()
    with counter:
        run()
    per_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), per_op
