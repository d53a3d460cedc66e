"""What flashdp's runtime checks cost, and the memory of checkpointed DP training, side by side in one run.

    python benchmarks/checks.py            # writes two sections of docs/benchmarks.md

1. The self-check and the coverage walk, on the suite's Llama-like decoder (d=256, 4 layers, vocab 4096, T=256,
   B=8, SGD): a step with the self-check (self_check=1: every step checked) against one without, interleaved
   rounds in one process; the steady-state overhead at the default interval follows.
2. Activation checkpointing: HF LlamaForCausalLM (d=256, 8 layers, vocab 1024, T=1024, B=4) with
   gradient_checkpointing_enable(),
   non-private vs bk vs ghost, and the same without checkpointing; each in its own subprocess, the peak the second
   step adds above what is allocated when it starts (benchmarks/memory.py).

    python benchmarks/checks.py --only checkpointing   # one of the two
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashdp  # noqa: E402
from benchmarks.harness import build_model, data, per_sample_loss  # noqa: E402
from benchmarks.memory import step_peak_mib  # noqa: E402
from benchmarks.sections import write_section  # noqa: E402
from flashdp._pipeline import coverage  # noqa: E402
from flashdp._pipeline.settings import DEFAULT_SELF_CHECK_INTERVAL  # noqa: E402

#: the checkpointing model: deep enough, and with a vocabulary small enough, that activations dominate memory
CKPT_LAYERS, CKPT_VOCAB = 8, 1024


def _step(mode: str, self_check: int | None):
    model = build_model("llama", "cpu")
    x, y = data("llama", 256, 8, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=8,
        self_check=self_check,
    )  # fmt: skip

    def step() -> None:
        engine.backward(per_sample_loss(model(x), y))
        engine.step()

    return step, model, engine, (x, y)


def self_check_cost(rounds: int) -> str:
    variants = {(mode, check): _step(mode, check)[0] for mode in ("bk", "ghost") for check in (None, 1)}
    times: dict = {key: [] for key in variants}
    for step in variants.values():
        step()
    for _ in range(rounds):
        for key, step in variants.items():
            start = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - start)
    median = {key: statistics.median(t) * 1000 for key, t in times.items()}
    _, model, engine, (x, y) = _step("bk", None)
    engine._attachment.recorder.take()
    out = model(x)
    calls = engine._attachment.recorder.take().calls
    loss, walk = per_sample_loss(out, y), []
    for _ in range(rounds):  # (the walk alone, not the loss it starts from)
        start = time.perf_counter()
        coverage.walk(loss, calls, engine._known.plan, model.named_parameters())
        walk.append(time.perf_counter() - start)
    walk_ms = statistics.median(walk) * 1000
    lines = [
        _header("python benchmarks/checks.py", rounds),
        "",
        "| mode | step without checks | a self-checked step | first-step cost | steady state (1 in "
        f"{DEFAULT_SELF_CHECK_INTERVAL}) |",
        "|---|---|---|---|---|",
    ]
    for mode in ("bk", "ghost"):
        plain, checked = median[(mode, None)], median[(mode, 1)]
        steady = (checked - plain) / DEFAULT_SELF_CHECK_INTERVAL / plain * 100
        lines.append(
            f"| {mode} | {plain:.0f} ms | {checked:.0f} ms | {checked / plain:.2f}x | +{steady:.2f}% per step |"
        )
    lines += [
        "",
        f"The coverage walk (every backward) takes {walk_ms:.2f} ms on this model "
        f"({walk_ms / median[('bk', None)] * 100:.2f}% of a bk step).",
    ]
    return "\n".join(lines)


def _hf_llama(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=CKPT_VOCAB, hidden_size=256, intermediate_size=682, num_hidden_layers=CKPT_LAYERS,
        num_attention_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def worker_memory(mode: str, checkpointing: bool, seq: int, batch: int) -> dict:
    model = _hf_llama(checkpointing)
    ids = torch.randint(0, CKPT_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_of = lambda: flashdp.per_sample_lm_loss(model(ids).logits, ids)  # noqa: E731
    if mode == "non-private":

        def step() -> None:
            loss_of().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    else:
        engine = flashdp.make_private(
            model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=batch,
            self_check=None,
        )  # fmt: skip

        def step() -> None:
            engine.backward(loss_of())
            engine.step()

    step()
    return {"step_mb": step_peak_mib(step, "cpu")}


def checkpointing_memory(seq: int, batch: int) -> str:
    results = {}
    for checkpointing in (True, False):
        for mode in ("non-private", "bk", "ghost"):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run(
                    [sys.executable, __file__, "--worker", mode, str(int(checkpointing)), str(seq), str(batch),
                     "--json", out.name],
                    check=True, cwd=ROOT,
                )  # fmt: skip
                results[(checkpointing, mode)] = json.loads(Path(out.name).read_text())
    lines = [
        f"HF LlamaForCausalLM (d=256, {CKPT_LAYERS} layers, vocab {CKPT_VOCAB}: the layers' activations, not the "
        f"logits, dominate non-private memory), T={seq}, B={batch}, SGD; each configuration in its own "
        "process; the peak the second step adds above what is allocated when it starts (the allocator's own record, "
        "benchmarks/memory.py), ratios to non-private training with the same checkpointing.",
        "",
        "| checkpointing | non-private | bk | ghost |",
        "|---|---|---|---|",
    ]
    for checkpointing in (True, False):
        base = results[(checkpointing, "non-private")]["step_mb"]
        cells = [
            f"{results[(checkpointing, m)]['step_mb']:.0f} MiB ({results[(checkpointing, m)]['step_mb'] / base:.2f}x)"
            for m in ("non-private", "bk", "ghost")
        ]
        lines.append(f"| {'on' if checkpointing else 'off'} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "A layer called inside a checkpointed region keeps its inputs the way autograd keeps saved tensors there "
        "(checkpoint's saved-tensor hooks): they are recomputed in the norm pass, with the region's own "
        "recomputation, not held from the forward to the backward.",
    ]
    return "\n".join(lines)


def _header(command: str, rounds: int) -> str:
    machine = f"{platform.machine()} x{os.cpu_count()} (torch threads {torch.get_num_threads()})"
    return (
        f"Measured by `{command}` on {datetime.date.today().isoformat()}; {machine}; flashdp {flashdp.__version__}. "
        f"Suite's Llama-like decoder, T=256, B=8, median of {rounds} interleaved rounds."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--only", choices=["self-check", "checkpointing"], help="measure one section")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, checkpointing, seq, batch = args.worker
        result = worker_memory(mode, bool(int(checkpointing)), int(seq), int(batch))
        Path(args.json).write_text(json.dumps(result))
        return
    if args.only != "checkpointing":
        write_section("the self-check", "## The self-check\n\n" + self_check_cost(args.rounds))
    if args.only != "self-check":
        memory = checkpointing_memory(args.seq, args.batch)
        write_section("activation checkpointing", "## Activation checkpointing\n\n" + memory)
    print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
