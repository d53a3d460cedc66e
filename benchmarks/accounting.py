"""What one `engine.epsilon(delta)` costs when asked after every step, and calibration's time at the edges.

    python benchmarks/accounting.py                       # prints the table
    python benchmarks/accounting.py --baseline OLD_TREE   # also times OLD_TREE/src, writes docs/benchmarks.md

Each case preloads an accountant with a history, then times `step(); epsilon(1e-5)` for a few steps (the
first call after a restart composes the whole history; the figure is the mean of the calls after it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (label, kind, sigma, q, steps before timing)
CASES = [
    ("PLD, sigma 1.0, q 0.005, after 1,000 steps", "pld", 1.0, 256 / 50_000, 1_000),
    ("PLD, sigma 0.8, q 0.01, after 5,000 steps", "pld", 0.8, 0.01, 5_000),
    ("RDP, sigma 1.0, q 0.005, after 1,000 steps", "rdp", 1.0, 256 / 50_000, 1_000),
    ("PLD, sigma changed every step (50 runs)", "pld", None, 0.01, 50),
]
TIMED_CALLS = 5


def _time_cases() -> list[dict]:
    from flashdp.privacy import Accountant

    rows = []
    for label, kind, sigma, q, preload in CASES:
        accountant = Accountant(kind)
        for k in range(preload):
            accountant.step(sigma if sigma is not None else 1.0 + k / 100, q)
        accountant.epsilon(1e-5)  # the first call composes the whole history
        times = []
        for k in range(TIMED_CALLS):
            accountant.step(sigma if sigma is not None else 0.5 + k / 100, q)
            start = time.perf_counter()
            accountant.epsilon(1e-5)
            times.append(time.perf_counter() - start)
        rows.append({"case": label, "ms": 1000 * sum(times) / len(times)})
    return rows


def _in_tree(tree: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}"}
    out = subprocess.run([sys.executable, __file__, "--json"], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print this tree's timings as JSON")
    parser.add_argument("--baseline", type=Path, help="a checkout of the tree to compare with")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(_time_cases()))
        return
    after = _in_tree(ROOT)
    before = _in_tree(args.baseline) if args.baseline else None
    lines = ["| history | epsilon() per step, before (ms) | after (ms) |", "|---|---|---|"]
    for i, row in enumerate(after):
        old = f"{before[i]['ms']:.0f}" if before else "-"
        lines.append(f"| {row['case']} | {old} | {row['ms']:.1f} |")
    table = "\n".join(lines)
    print(table)
    if before is None:
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.sections import write_section

    text = (
        "## Accounting: epsilon() after every step\n\n"
        f"CPU ({platform.machine()}), {datetime.date.today()}, `python benchmarks/accounting.py --baseline "
        "<tree before>`: before is the accountant that recomposed the whole history on every call, after the one "
        "that keeps each (sigma, q)'s one-step distribution and the composition of all runs but the last. Values "
        "are equal to dp-accounting's (tests/privacy/test_accounting.py). Mean of "
        f"{TIMED_CALLS} calls, each after one more step.\n\n{table}"
    )
    write_section("accounting", text)


if __name__ == "__main__":
    main()
