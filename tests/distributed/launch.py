"""Run a function on 2 processes (gloo, CPU) and collect what each rank returns."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2

#: each run's ranks fork from one server that imported these once per test process (a spawned rank imports them
#: again: about 1.5 s of every run, for tests of a fraction of a second); FLASHDP_TEST_START_METHOD=spawn compares
PRELOADED = ["torch", "torch.distributed", "flashdp", "tests.distributed.workloads"]
START_METHOD = os.environ.get("FLASHDP_TEST_START_METHOD", "forkserver")
if START_METHOD == "forkserver":
    mp.set_forkserver_preload(PRELOADED)


def _worker(rank: int, fn: Callable, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no TCP port to race for when test workers run side by side
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=WORLD)
    try:
        torch.save(fn(rank, *args), Path(out) / f"{rank}.pt")
        dist.barrier()
    finally:
        gc.collect()  # wrappers (DDP's reducer) hold the group in reference cycles
        dist.destroy_process_group()
    # Skip interpreter finalisation: a gloo worker thread still alive there aborts the process ("terminate called
    # without an active exception", seen once in CI). The result is saved and every rank passed the barrier.
    os._exit(0)


def as_torchrun_process(rank: int | None) -> dict:
    """Inside a worker: the environment torchrun gives process `rank` of WORLD (read by HF TrainingArguments), and
    the TrainingArguments of a run on gloo; nothing for one process (`rank` None)."""
    if rank is None:
        return {}
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    return {"ddp_backend": "gloo"}


#: seconds a run may take before its ranks are killed: a rank waiting in a collective the other never joins
#: fails the test instead of hanging the suite
TIMEOUT = 180.0


def run(fn: Callable, *args) -> list:
    """`fn(rank, *args)` on each of 2 ranks; returns their results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_worker, args=(fn, out, args), nprocs=WORLD, join=False, start_method=START_METHOD)
        deadline = time.monotonic() + TIMEOUT
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {WORLD} ranks in {TIMEOUT:.0f} s: a rank hangs")
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(WORLD)]
