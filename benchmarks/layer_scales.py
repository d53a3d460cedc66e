"""Vision transformers and ConvNets whose blocks hold raw parameters that meet the batch by broadcast (layer
scales, class tokens, position tables): bk and ghost against non-private training, HF models from configs.

    python benchmarks/layer_scales.py                      # the table
    python benchmarks/layer_scales.py --trees <before> .   # bk of several source trees, one process

B=16, CPU; BEiT and DINOv2 ViT-shaped (64 px, patch 8, d=192, 6 layers), ConvNeXt 32 px (widths 32-256, depths
2). Modes in interleaved rounds, median of `--rounds`; "generic" counts the parameters the generic rule re-runs a
module for.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashdp  # noqa: E402
from benchmarks.harness import interleaved_times  # noqa: E402

BATCH, IMAGE = 16, 64
VIT = {"hidden_size": 192, "num_hidden_layers": 6, "num_attention_heads": 3, "intermediate_size": 768,
       "image_size": IMAGE, "patch_size": 8, "num_labels": 10}  # fmt: skip


def models() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as tf

    return {
        "BEiT, layer scale 0.1 (HF's default)": lambda: tf.BeitForImageClassification(
            tf.BeitConfig(**VIT, layer_scale_init_value=0.1, drop_path_rate=0.0)
        ),
        "BEiT, no layer scale": lambda: tf.BeitForImageClassification(
            tf.BeitConfig(**VIT, layer_scale_init_value=0.0, drop_path_rate=0.0)
        ),
        "DINOv2": lambda: tf.Dinov2ForImageClassification(tf.Dinov2Config(**VIT)),
        "ConvNeXt, 32 px": lambda: tf.ConvNextForImageClassification(
            tf.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2], num_labels=10, image_size=32)
        ),
    }


def make_step(build, mode: str, library: ModuleType = flashdp) -> tuple[Callable[[], None], Callable[[], int]]:
    """A step of `mode` on a fresh model, and after it how many parameters the generic rule counted."""
    torch.manual_seed(0)
    model = build()
    side = 32 if "ConvNext" in type(model).__name__ else IMAGE
    x, y = torch.randn(BATCH, 3, side, side), torch.randint(0, 10, (BATCH,))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "non-private":

        def step() -> None:
            F.cross_entropy(model(pixel_values=x).logits, y).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, lambda: 0
    engine = library.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=BATCH,
        sample_rate=0.01,
    )  # fmt: skip

    def dp_step() -> None:
        engine.backward(F.cross_entropy(model(pixel_values=x).logits, y, reduction="none"))
        engine.step()

    return dp_step, lambda: sum(s == "generic" for s in engine.strategies.values())


def _library(tree: str) -> ModuleType:
    for name in [m for m in sys.modules if m == "flashdp" or m.startswith("flashdp.")]:
        del sys.modules[name]
    sys.path.insert(0, str(Path(tree).resolve() / "src"))
    try:
        return importlib.import_module("flashdp")
    finally:
        sys.path.pop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trees", nargs="+", help="source trees whose bk is timed side by side")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # (fixed batches: not Poisson-sampled)
    variants = [(f"bk ({t})", "bk", _library(t)) for t in args.trees] if args.trees else [("bk", "bk", flashdp)]
    variants += [] if args.trees else [("ghost", "ghost", flashdp)]
    print("| model | mode | step (ms) | vs non-private | generic |\n|---|---|---|---|---|")
    for name, build in models().items():
        steps = {"non-private": make_step(build, "non-private")}
        steps |= {label: make_step(build, mode, library) for label, mode, library in variants}
        for step, _ in steps.values():  # warm-up: the first steps verify
            step(), step()
        times = interleaved_times({k: s for k, (s, _) in steps.items()}, args.rounds)
        base = statistics.median(times["non-private"])
        for label, ms in times.items():
            median = statistics.median(ms)
            print(f"| {name} | {label} | {median:.0f} | {median / base:.2f}x | {steps[label][1]()} |")


if __name__ == "__main__":
    main()
