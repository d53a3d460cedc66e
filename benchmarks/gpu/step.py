"""A full training step of a Llama-shaped model, side by side in one process: non-private vs bk vs ghost vs flash.

    python benchmarks/gpu/step.py --out step.jsonl                      # d=2048, 16 layers, vocab 32k, bf16
    python benchmarks/gpu/step.py --device cpu --d 64 --layers 2 --vocab 128 --shapes 32x2   # a dry run

One model for every mode (same weights, hooks removed between modes by `engine.detach()`); per mode and shape:
the median step time over `--steps` timed steps after two warm-up steps, and the peak memory allocated over the
whole run of that mode, its first step included (weights counted). A mode may name the engine's kernels and
norm strategy: `bk:torch`, `ghost:triton`, `bk@ghost` (default "auto"). One JSON line per row is appended to
`--out` as soon as it is measured, so that a run cut short keeps its figures. `--profile-mode bk` prints flashdp's
per-phase breakdown of two more steps of that mode at the first shape (to stderr); the non-private rows also give
the forward and the backward timed apart. `--deterministic`: every mode under
`torch.use_deterministic_algorithms(True)` (cuBLAS's workspace set for it): ghost and flash refuse a step whose
second pass met other gradients than their norm pass, and on CUDA the attention's backward (flash attention's atomic
dQ) differs from run to run otherwise (on an H200 they ran under the flag at 2.12-2.15x: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import time

import torch

import flashdp

MODES = ("non-private", "bk", "ghost", "flash")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d,
        intermediate_size=int(args.d * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.d // 128),
        max_position_embeddings=max(t for t, _ in args.shapes),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def measure(model: torch.nn.Module, mode: str, ids: torch.Tensor, steps: int, profile: bool) -> dict:
    """Median step time (ms) and the peak memory (GiB) of `steps` timed steps after two warm-ups."""
    device = ids.device
    _reset_memory(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    engine = None
    if mode != "non-private":
        spec, _, strategy = mode.partition("@")
        name, _, kernels = spec.partition(":")
        engine = flashdp.make_private(
            model, mode=name, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=opt,
            expected_batch_size=len(ids), sample_rate=0.01, kernels=kernels or "auto", norm_strategy=strategy or "auto",
        )  # fmt: skip

    def step() -> None:
        loss = flashdp.per_sample_lm_loss(model(ids).logits, ids)
        if engine is None:
            loss.mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            engine.backward(loss)
            engine.step()

    try:
        first = _timed(_profiled(step, f"first {mode} step") if profile else step, device)
        _timed(step, device)
        times = [_timed(step, device) for _ in range(steps)]
        peak = _peak_gib(device)
        if profile and engine is not None:
            engine._timer.enabled = True  # the per-phase breakdown of two more steps, on stderr
            for _ in range(2):
                step()
        strategies = engine.strategies if engine is not None else {}
        phases = _phases(model, ids, opt, device) if engine is None else {}
    finally:
        if engine is not None:
            engine.detach()
        model.zero_grad(set_to_none=True)
    return {
        "first_step_ms": first,
        "step_ms": statistics.median(times),
        "step_ms_all": times,
        "peak_gib": peak,
        "strategies": _count(strategies),
        **phases,
    }


def _phases(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer, device: torch.device) -> dict:
    """A non-private step's forward (with the loss) and backward, timed apart (median of 3): what flashdp's
    per-phase profile of a private step compares with."""
    forward, backward = [], []
    for _ in range(3):
        loss = None

        def run_forward() -> None:
            nonlocal loss
            loss = flashdp.per_sample_lm_loss(model(ids).logits, ids).mean()

        forward.append(_timed(run_forward, device))
        backward.append(_timed(loss.backward, device))
        opt.zero_grad(set_to_none=True)
    return {"forward_ms": statistics.median(forward), "backward_ms": statistics.median(backward)}


def _profiled(step, title: str):
    """`step` under cProfile: the 25 functions of most own time, printed to stderr (where the first step's host
    time goes: recording, the forward check's probes, the layout verification, the self-check)."""

    def run() -> None:
        profile = cProfile.Profile()
        profile.runcall(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(f"== {title}", file=sys.stderr)
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)

    return run


def _count(strategies: dict) -> dict:
    counts: dict[str, int] = {}
    for name in strategies.values():
        counts[name] = counts.get(name, 0) + 1
    return counts


def _timed(step, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    step()
    return (time.perf_counter() - begin) * 1e3


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def _shape(text: str) -> tuple[int, int]:
    t, b = text.split("x")
    return int(t), int(b)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The Llama-shaped model's options (`build_model`) and its device."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[(2048, 8), (1024, 16), (4096, 4), (8192, 2)])
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile-mode", default="bk")
    parser.add_argument("--out", default="step.jsonl")
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (read when cuBLAS starts: before any product)
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device)
    model = build_model(args)
    for index, (t, b) in enumerate(args.shapes):
        ids = torch.randint(0, args.vocab, (b, t), device=device)
        base = None
        for mode in args.modes:
            try:
                row = measure(model, mode, ids, args.steps, profile=index == 0 and mode == args.profile_mode)
            except torch.OutOfMemoryError:
                row = {"error": "OOM"}
            except Exception as error:  # a failing mode is a finding; the other modes still run
                row = {"error": f"{type(error).__name__}: {error}"[:2000]}
            row.update(mode=mode, T=t, B=b, d=args.d, layers=args.layers, vocab=args.vocab)
            if "step_ms" in row:
                base = base or row
                row["time_ratio"] = row["step_ms"] / base["step_ms"]
                row["memory_ratio"] = row["peak_gib"] / base["peak_gib"]
                row["tokens_per_s"] = b * t / row["step_ms"] * 1e3
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")
            summary = {k: v for k, v in row.items() if k != "step_ms_all"}
            print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
