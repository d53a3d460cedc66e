"""The process's resident memory over a whole run, the first step included: each mode in its own process, the peak
RSS above the RSS when training starts (the model, its data and the optimizer built), after each step.

    python benchmarks/process_memory.py --seq 1024 --batch 4
    python benchmarks/process_memory.py --seq 4096 --batch 1 --checkpointing
    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/process_memory.py ...   # glibc returns every freed block at once

On Linux with glibc, freed blocks below its (dynamic) mmap threshold stay in the process's heap, so the RSS peak
also counts what the heap holds freed; `benchmarks/memory.py` measures the allocator's own record of live tensors
instead. The Llama-like decoder of `benchmarks/harness.py`, SGD.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import make_step

MODES = ("non-private", "flashdp-bk", "flashdp-ghost")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(mode: str, seq: int, batch: int, checkpointing: bool, steps: int) -> list[float]:
    """The peak RSS above the start of training, in MiB, after each step."""
    warnings.simplefilter("ignore")
    step = make_step("llama", mode, seq, batch, checkpointing=checkpointing)
    start, peaks = _rss_mib(), []
    for _ in range(steps):
        step()
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq, args.batch, args.checkpointing, args.steps)))
        return
    shape = ["--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)]
    shape += ["--checkpointing"] if args.checkpointing else []
    peaks = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--worker", mode, *shape], capture_output=True, text=True)
        peaks[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = peaks["non-private"][-1]
    for mode, values in peaks.items():
        steps = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {args.seq} | {args.batch} | {'yes' if args.checkpointing else 'no'} | {mode} | {steps} | "
              f"{values[-1] / base:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
