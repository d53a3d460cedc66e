"""Python's cyclic garbage collector paused while a backward runs.

A backward holds thousands of Python objects (recorded calls, their gradients' parts, plans) for its whole length,
which is long enough for the collector's young generations to promote them: they count toward the next full
collection, which scans every object of the process (the model, torch, transformers), and then die with the
backward. On the host-overhead model (`benchmarks/host_overhead.py`) a full collection every ~10 ghost steps took
15% of ghost's host time. Paused, nothing is collected mid-backward and its objects die by reference counting
before a young collection sees them; cycles made meanwhile wait for the next collection after it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collection_paused() -> Iterator[None]:
    """Meanwhile no automatic collection; the collector's state (enabled or not) is restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
