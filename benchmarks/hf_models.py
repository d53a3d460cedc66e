"""Step time on HF ViT-Base and T5-small shapes (randomly initialised from configs), flashdp and Opacus against
non-private training, side by side in one process.

    python benchmarks/hf_models.py                  # writes the "HF models" section of docs/benchmarks.md
    python benchmarks/hf_models.py --rounds 3 --no-write
    python benchmarks/hf_models.py --models mixtral --no-write   # the mixture-of-experts table

Per model, every mode is built in one process and timed in interleaved rounds (non-private, flashdp bk, ...), so
drift on a shared machine hits them alike; the median is reported with its ratio to non-private training. A mode
that fails to build or step is reported with its error.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashdp  # noqa: E402
from benchmarks.harness import make_step, unavailable  # noqa: E402
from benchmarks.sections import write_section  # noqa: E402

#: model -> (seq: tokens per sequence or image side, batch)
SHAPES = {"vit": (224, 4), "t5": (128, 4), "mixtral": (128, 8)}
NAMES = {
    "vit": "ViT-Base/16 (224 px, 86M parameters)",
    "t5": "T5-small (T=128 in and out, 60M parameters)",
    "mixtral": "Mixtral-shaped (d=256, 4 layers, 8 experts top-2, eager experts, T=128, B=8)",
}
MODES = ("non-private", "flashdp-bk", "flashdp-ghost", "opacus-hooks", "opacus-ghost")


def time_modes(model: str, rounds: int) -> dict[str, list[float] | str]:
    seq, batch = SHAPES[model]
    steps, results = {}, {}
    for mode in MODES:
        reason = unavailable(mode)
        if reason:
            results[mode] = reason
            continue
        try:
            steps[mode] = make_step(model, mode, seq, batch)
            steps[mode]()  # warm-up
        except Exception as error:  # a library that cannot train this model: say why
            results[mode] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            steps.pop(mode, None)
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(rounds):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            times[mode].append((time.perf_counter() - start) * 1000)
    return results | times


def table(found: dict[str, dict[str, list[float] | str]]) -> str:
    rows = ["| model | mode | step (ms, median) | vs non-private |", "|---|---|---|---|"]
    for model, results in found.items():
        base = statistics.median(results["non-private"])
        for mode in MODES:
            value = results.get(mode)
            if isinstance(value, list):
                median = statistics.median(value)
                rows.append(f"| {NAMES[model]} | {mode} | {median:.0f} | {median / base:.2f}x |")
            else:
                rows.append(f"| {NAMES[model]} | {mode} | - | {value} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="vit,t5")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    found = {model: time_modes(model, args.rounds) for model in args.models.split(",")}
    text = table(found)
    print(text)
    if not args.no_write:
        machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        header = (
            f"HF models from configs (randomly initialised), batch 4, SGD, CPU ({machine}); flashdp "
            f"{flashdp.__version__}; {datetime.date.today()}; `python benchmarks/hf_models.py`. Modes timed in "
            f"interleaved rounds in one process, median of {args.rounds}."
        )
        write_section("HF models", f"## HF ViT-Base and T5-small\n\n{header}\n\n{text}")


if __name__ == "__main__":
    main()
