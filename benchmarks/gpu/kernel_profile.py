"""Where a steady step's GPU time goes, kernel by kernel: the Llama-shaped model of `step.py`, one step of each mode
under `torch.profiler` after two warm-up steps.

    python benchmarks/gpu/kernel_profile.py --shape 1024x16 --modes non-private bk
    python benchmarks/gpu/kernel_profile.py --device cpu --d 64 --layers 2 --vocab 128 --shape 32x2   # a dry run

Per mode: the step's wall time, the time some kernel ran (the GPU's busy time: below the wall time, the GPU waited
for the host), and the kernels of most total time, with their share of the busy time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashdp
from benchmarks.gpu.step import add_model_arguments, build_model


def one_step(model: torch.nn.Module, mode: str, ids: torch.Tensor):
    """A step function of `mode` on `model` (and the engine, to detach)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    if mode == "non-private":

        def step() -> None:
            flashdp.per_sample_lm_loss(model(ids).logits, ids).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, None
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=len(ids),
        sample_rate=0.01,
    )  # fmt: skip

    def dp_step() -> None:
        engine.backward(flashdp.per_sample_lm_loss(model(ids).logits, ids))
        engine.step()

    return dp_step, engine


def report(model: torch.nn.Module, mode: str, ids: torch.Tensor, rows: int) -> None:
    step, engine = one_step(model, mode, ids)
    try:
        for _ in range(2):
            step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.is_cuda else [])
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        sync()
        with profile(activities=activities) as prof:
            begin = time.perf_counter()
            step()
            sync()
            wall = (time.perf_counter() - begin) * 1e3
    finally:
        if engine is not None:
            engine.detach()
        model.zero_grad(set_to_none=True)
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"] if ids.is_cuda else []
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\n== {mode}: step {wall:.1f} ms wall, GPU busy {busy:.1f} ms ({busy / wall:.0%})")
    print("| kernel | calls | total ms | share of busy |\n|---|---|---|---|")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        ms = e.self_device_time_total / 1e3
        print(f"| {e.key[:90]} | {e.count} | {ms:.2f} | {ms / busy:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--shape", default="1024x16", help="T x B")
    parser.add_argument("--modes", nargs="+", default=["non-private", "bk"])
    parser.add_argument("--rows", type=int, default=25, help="kernels listed per mode")
    args = parser.parse_args()
    seq, batch = (int(x) for x in args.shape.split("x"))
    args.shapes = [(seq, batch)]
    model = build_model(args)
    ids = torch.randint(0, args.vocab, (batch, seq), device=args.device, generator=None)
    for mode in args.modes:
        report(model, mode, ids, args.rows)


if __name__ == "__main__":
    main()
