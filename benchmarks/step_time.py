"""Step time of flashdp (bk, ghost) relative to non-private training, side by side in one run.

    python benchmarks/step_time.py --seq 256 --batch 8
    python benchmarks/step_time.py --modes non-private,bk,bk-users,ghost,ghost-users --rows-per-user 4

Modes: non-private, bk, ghost, flash; "<mode>-users" clips by user (`engine.backward(loss, users=ids)`), each user
owning `--rows-per-user` consecutive rows of the batch.

A Llama-like decoder built from a transformers config (d=256, 4 layers, vocab 4096, untied head), SGD. The modes
are timed in interleaved rounds (non-private, bk, ghost, non-private, ...) so that drift on a shared machine hits
them alike; the median over rounds is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import flashdp


def build_model(vocab: int, d: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=int(d * 8 / 3),
        num_hidden_layers=layers,
        num_attention_heads=max(d // 64, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def per_sample_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1]
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def make_step(mode: str, model: nn.Module, batch: int, rows_per_user: int = 1):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "non-private":

        def step(ids):
            per_sample_lm_loss(model, ids).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    users = torch.arange(batch) // rows_per_user if mode.endswith("-users") else None
    engine = flashdp.make_private(
        model,
        mode=mode.removesuffix("-users"),
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        optimizer=optimizer,
        expected_batch_size=batch,
        sample_rate=0.01,
    )

    def step(ids):
        engine.backward(per_sample_lm_loss(model, ids), users=users)
        engine.step()

    step.engine = engine
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="non-private,bk,ghost")
    parser.add_argument("--rows-per-user", type=int, default=4, help="of the '-users' modes")
    args = parser.parse_args()

    modes = args.modes.split(",")
    models = {m: build_model(args.vocab, args.d, args.layers) for m in modes}
    steps = {m: make_step(m, models[m], args.batch, args.rows_per_user) for m in modes}
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {m: [] for m in modes}
    for m in modes:  # warm-up
        steps[m](ids)
    for _ in range(args.rounds):
        for m in modes:
            start = time.perf_counter()
            steps[m](ids)
            times[m].append(time.perf_counter() - start)
    base = statistics.median(times[modes[0]])
    print(
        f"T={args.seq} B={args.batch} d={args.d} layers={args.layers} vocab={args.vocab} "
        f"threads={torch.get_num_threads()} rows per user={args.rows_per_user}"
    )
    for m in modes:
        median = statistics.median(times[m])
        engine = getattr(steps[m], "engine", None)
        extra = f"  strategies: {', '.join(sorted(set(engine.strategies.values())))}" if engine else ""
        print(f"{m:12s} {median * 1000:8.1f} ms  {median / base:5.2f}x{extra}")


if __name__ == "__main__":
    main()
