"""Peak memory a training step adds, from the allocator itself (not sampled RSS).

GPU: `max_memory_allocated` above what was allocated when the step began. CPU: the PyTorch profiler's record of
every allocation and free of the CPU allocator, replayed in order: the highest the live total climbs above where
it started. Memory held before the step (the model, the optimizer's state, the data) is not counted; memory the
step allocates and still holds at its end (gradients, optimizer state on a first step) is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def step_peak_mib(step: Callable[[], None], device: str) -> float:
    """MiB: the peak of the memory allocated while `step()` runs, above the memory allocated when it starts."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak / 2**20
