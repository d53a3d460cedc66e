"""Step time of one model under the flashdp of a given source tree, as ratios to non-private training in the same
run: run it once per tree, alternately, to compare a change with the tree before it.

    git worktree add ../before <commit>
    python benchmarks/compare_trees.py --tree ../before --model wrn --batch 16 64
    python benchmarks/compare_trees.py --tree . --model wrn --batch 16 64

The models and steps are this checkout's (`benchmarks/harness.py`); only flashdp is imported from `--tree`.
Modes are timed in interleaved rounds, median of `--rounds`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="a source tree whose src/flashdp is timed")
    parser.add_argument("--model", default="wrn")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence, or image side in pixels")
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--modes", default="non-private,flashdp-bk,flashdp-ghost")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sys.path[:0] = [str(args.tree.resolve() / "src"), str(ROOT)]
    import flashdp
    from benchmarks.harness import interleaved_times, make_step

    modes = args.modes.split(",")
    print(f"flashdp from {Path(flashdp.__file__).parent}")
    for batch in args.batch:
        steps = {mode: make_step(args.model, mode, args.seq, batch) for mode in modes}
        for step in steps.values():  # warm-up
            step()
        median = {mode: statistics.median(ms) for mode, ms in interleaved_times(steps, args.rounds).items()}
        cells = [f"{m} {median[m]:.0f} ms {median[m] / median[modes[0]]:.2f}x" for m in modes]
        print(f"{args.model} B={batch}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
