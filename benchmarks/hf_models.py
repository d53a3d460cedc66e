"""Step time on HF ViT-Base and T5-small shapes (randomly initialised from configs), flashdp and Opacus against
non-private training, side by side in one process; and on the workloads DP is benchmarked on.

    python benchmarks/hf_models.py                  # writes the "HF models" section of docs/benchmarks.md
    python benchmarks/hf_models.py --rounds 3 --no-write
    python benchmarks/hf_models.py --models mixtral --no-write   # the mixture-of-experts table
    python benchmarks/hf_models.py --workloads      # WRN-16-4, small ViT, BERT, GPT-2, Llama-like: their section

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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashdp  # noqa: E402
from benchmarks.harness import interleaved_times, make_step, unavailable  # noqa: E402
from benchmarks.sections import write_section  # noqa: E402

#: model -> (seq: tokens per sequence or image side, batch)
SHAPES = {"vit": (224, 4), "t5": (128, 4), "mixtral": (128, 8), "wrn": (32, 16), "vitsmall": (64, 16),
          "bert": (128, 16), "gpt2": (256, 16), "llama": (256, 8)}  # fmt: skip
NAMES = {
    "vit": "ViT-Base/16 (224 px, 86M parameters)",
    "t5": "T5-small (T=128 in and out, 60M parameters)",
    "mixtral": "Mixtral-shaped (d=256, 4 layers, 8 experts top-2, eager experts, T=128, B=8)",
    "wrn": "WideResNet-16-4, GroupNorm, 32 px (2.7M parameters), B=16",
    "vitsmall": "HF ViT, 64 px, patch 8, d=192, 6 layers, B=16",
    "bert": "HF BERT classifier, d=256, 4 layers, T=128 padded, B=16",
    "gpt2": "HF GPT-2 LM, d=256, 4 layers, T=256, tied head, B=16",
    "llama": "Llama-like decoder, d=256, 4 layers, T=256, B=8",
}
WORKLOADS = "wrn,vitsmall,bert,gpt2,llama"
MODES = ("non-private", "flashdp-bk", "flashdp-ghost", "opacus-hooks", "opacus-ghost")


def time_modes(model: str, rounds: int, device: str = "cpu") -> dict[str, list[float] | str]:
    seq, batch = SHAPES[model]
    steps, results = {}, {}
    for mode in MODES:
        reason = unavailable(mode)
        if reason:
            results[mode] = reason
            continue
        try:
            steps[mode] = make_step(model, mode, seq, batch, device)
            steps[mode]()  # warm-up
        except Exception as error:  # a library that cannot train this model: say why
            results[mode] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            steps.pop(mode, None)
    return results | interleaved_times(steps, rounds, device)


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
    parser.add_argument("--workloads", action="store_true", help=f"the models {WORKLOADS}, in their own section")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (with --no-write: the sections are CPU's)")
    args = parser.parse_args()
    models = WORKLOADS if args.workloads else args.models
    found = {model: time_modes(model, args.rounds, args.device) for model in models.split(",")}
    text = table(found)
    print(text)
    if not args.no_write:
        machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
        command = "python benchmarks/hf_models.py" + (" --workloads" if args.workloads else "")
        header = (
            f"Models from configs (randomly initialised), SGD, CPU ({machine}); flashdp {flashdp.__version__}; "
            f"{datetime.date.today()}; `{command}`. Modes timed in interleaved rounds in one process, median of "
            f"{args.rounds}."
        )
        if args.workloads:
            write_section("DP workloads", f"## The workloads DP is benchmarked on\n\n{header}\n\n{text}")
        else:
            write_section("HF models", f"## HF ViT-Base and T5-small\n\n{header} Batch 4.\n\n{text}")


if __name__ == "__main__":
    main()
