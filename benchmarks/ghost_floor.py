"""Ghost clipping against its floor: a non-private forward, a backward without weight gradients (the norm pass
computes only the gradients at the layers' outputs) and a full backward (the second pass), side by side in one run.

    python benchmarks/ghost_floor.py --model vitsmall --seq 64 --batch 16

Prints each part (median of rounds after two warm-ups), the floor as a ratio to a non-private step, and ghost's
step against both. Models from `benchmarks/harness.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import build_model, data, make_step, per_sample_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vitsmall")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence, or image side in pixels")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    model = build_model(args.model, "cpu")
    x, y = data(args.model, args.seq, args.batch, "cpu")
    outputs: dict[str, torch.Tensor] = {}
    if x.is_floating_point():
        x = x.clone().requires_grad_()  # the gradient at the input: every layer's input gradient
    else:  # token ids: the gradient at the embedding's output, every layer's above it
        embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
        embedding.register_forward_hook(lambda module, inputs, out: outputs.__setitem__("first", out))
    steps = {mode: make_step(args.model, mode, args.seq, args.batch) for mode in ("non-private", "flashdp-ghost")}
    times: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "input gradients", *steps)}
    for _ in range(args.rounds + 2):
        start = time.perf_counter()
        loss = per_sample_loss(model(x), y).mean()
        middle = time.perf_counter()
        loss.backward()
        times["forward"].append(middle - start)
        times["backward"].append(time.perf_counter() - middle)
        model.zero_grad()
        loss = per_sample_loss(model(x), y).mean()
        start = time.perf_counter()
        torch.autograd.grad(loss, [x if x.is_floating_point() else outputs["first"]])
        times["input gradients"].append(time.perf_counter() - start)
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - start)
    ms = {k: statistics.median(v[2:]) * 1000 for k, v in times.items()}
    floor = ms["forward"] + ms["input gradients"] + ms["backward"]
    base, ghost = ms["non-private"], ms["flashdp-ghost"]
    print(
        f"{args.model} B={args.batch}: forward {ms['forward']:.0f} ms, backward {ms['backward']:.0f} ms, input "
        f"gradients only {ms['input gradients']:.0f} ms; floor {floor:.0f} ms = {floor / base:.2f}x a non-private "
        f"step ({base:.0f} ms); ghost {ghost:.0f} ms = {ghost / base:.2f}x, {ghost / floor:.2f}x its floor"
    )


if __name__ == "__main__":
    main()
