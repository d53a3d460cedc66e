"""The compute floor of each mode: the matrix-multiply FLOPs of a steady step against non-private training's,
counted by `torch.utils.flop_counter.FlopCounterMode` (`benchmarks/flops.py`; the same on any machine, however
loaded).

    python benchmarks/flop_ratios.py                     # the workloads DP is benchmarked on
    python benchmarks/flop_ratios.py --models llama,gpt2

A mode's measured step-time ratio above its FLOP ratio is spent elsewhere: elementwise work the counter does not
see (normalisations, the noise draw), memory traffic, host time. Below it is impossible where matrix multiplies
dominate. Models and shapes from `benchmarks/harness.py` and `benchmarks/hf_models.py`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.flops import counted_flops
from benchmarks.harness import make_step
from benchmarks.hf_models import NAMES, SHAPES, WORKLOADS

MODES = ("non-private", "flashdp-bk", "flashdp-ghost")


def step_flops(model: str, mode: str) -> int:
    """The matrix-multiply FLOPs of a steady step of `mode`: after the first (it verifies and self-checks) and a
    first one counted (the counter's dispatch mode changes some ops' autograd graph, e.g. HF attention's: a new
    structure, verified once)."""
    seq, batch = SHAPES[model]
    step = make_step(model, mode, seq, batch)
    step()
    counted_flops(step)
    return counted_flops(step)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=WORKLOADS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    print("| model | non-private GFLOP | bk / non-private | ghost / non-private |\n|---|---|---|---|")
    for model in args.models.split(","):
        flops = {mode: step_flops(model, mode) for mode in MODES}
        base = flops["non-private"]
        bk, ghost = (flops[m] / base for m in MODES[1:])
        print(f"| {NAMES[model]} | {base / 1e9:.1f} | {bk:.3f}x | {ghost:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
