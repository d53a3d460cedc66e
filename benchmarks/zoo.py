"""Which rule counts each parameter of the HF models users fine-tune, from the test suite's tiny configs.

    python benchmarks/zoo.py      # writes the "models" section of docs/layers.md

Per model: how many parameters each strategy normed in one bk step, and the parameters the generic rule counts
(layer indices folded to N). Exactness is the test suite's (tests/hf/test_zoo.py, against the float64 oracle).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashdp  # noqa: E402
from benchmarks.sections import write_section  # noqa: E402
from tests.hf.zoo import CASES, PEFT_CASES  # noqa: E402

LAYERS_PAGE = ROOT / "docs" / "layers.md"


def strategies(build, loss, dtype) -> dict[str, str]:
    model = build().to(dtype).eval()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(loss(model, slice(None)))
        return engine.strategies


def row(name: str, found: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for strategy in found.values():
        counts[strategy] = counts.get(strategy, 0) + 1
    generic = sorted({re.sub(r"\.\d+\.", ".N.", n) for n, s in found.items() if s == "generic"})
    shown = ", ".join(f"`{n}`" for n in generic) or "none"
    mix = ", ".join(f"{s} {c}" for s, c in sorted(counts.items()))
    return f"| {name} | {len(found)} | {mix} | {shown} |"


def main() -> None:
    torch.manual_seed(0)
    cases = CASES | {f"peft_{name}": case for name, case in PEFT_CASES.items()}
    rows = ["| model | parameters | norms (bk step) | counted by the generic rule |", "|---|---|---|---|"]
    for name in sorted(cases):
        case = cases[name]()
        rows.append(row(name, strategies(case.build, case.loss, case.dtype)))
        print(rows[-1])
    write_section("models", "\n".join(rows), LAYERS_PAGE)


if __name__ == "__main__":
    main()
