"""Type checks shared by every argument check: a number is an int or a float but never a bool (True would pass
for 1), and the delta of a privacy guarantee."""

from __future__ import annotations

from flashdp.errors import FlashDPError


def is_number(x: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def is_int(x: object) -> bool:
    """An int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def checked_delta(delta: object) -> float:
    """The delta at which an epsilon is reported, in (0, 1)."""
    if not (is_number(delta) and 0 < delta < 1):
        raise FlashDPError(f"delta must be in (0, 1), e.g. 1e-5. Received {delta!r}.")
    return float(delta)
