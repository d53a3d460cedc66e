"""Per-step cost of flashdp's every-step checks on a Hugging Face LM fine-tune whose batch changes every step.

A GPT-2 (d=128, 2 layers, vocab 512) trained with Poisson batches (expected size 8) of sequences of random length
(8 to 96 tokens) padded to the longest of each batch: B and T change on every step, as in real fine-tuning. Every
step's wall time is recorded; the steady state is the median of the steps after the first ten.

    python benchmarks/every_step.py                      # this tree, prints the per-step times
    python benchmarks/every_step.py --compare OTHER/src  # interleaved runs of this tree and another source tree

With --compare, each round runs both trees in fresh processes, in alternating order, and the ratio of their steady
medians is reported per round and overall (median over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SKIP = 10  # steps before the steady state (the first structures' verification and self-check)


def run(steps: int, mode: str, seed: int) -> list[float]:
    """Wall time of each step, seconds."""
    import transformers as tf

    import flashdp

    torch.manual_seed(seed)
    config = tf.GPT2Config(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=128)
    model = tf.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 97, (2000,), generator=generator)
    tokens = torch.randint(1, 512, (2000, 96), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=8,
        sample_rate=8 / 2000, seed=seed,
    )  # fmt: skip
    times = []
    for _ in range(steps):
        picked = torch.nonzero(torch.rand(2000, generator=generator) < 8 / 2000).flatten()
        start = time.perf_counter()
        if len(picked) == 0:
            engine.backward_empty()
        else:
            longest = int(lengths[picked].max())
            ids = tokens[picked, :longest]
            mask = (torch.arange(longest)[None] < lengths[picked, None]).long()
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            engine.backward(flashdp.per_sample_lm_loss(logits, ids, attention_mask=mask))
        engine.step()
        times.append(time.perf_counter() - start)
    engine.detach()
    return times


def steady(times: list[float]) -> float:
    return statistics.median(times[SKIP:])


def compare(other: str, rounds: int, steps: int, mode: str) -> dict:
    """Interleaved fresh-process runs of this tree and `other` (a source directory holding `flashdp`)."""
    trees = {"this": str(HERE.parent / "src"), "other": other}
    results: dict[str, list[list[float]]] = {"this": [], "other": []}
    for r in range(rounds):
        for name in ("this", "other") if r % 2 == 0 else ("other", "this"):
            env = {**os.environ, "PYTHONPATH": trees[name]}
            command = [sys.executable, __file__, "--steps", str(steps), "--mode", mode, "--seed", str(r), "--json"]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.splitlines()[-1]))
    ratios = [steady(a) / steady(b) for a, b in zip(results["this"], results["other"], strict=True)]
    return {
        "mode": mode,
        "steps": steps,
        "rounds": rounds,
        "steady_ms": {name: [1e3 * steady(t) for t in runs] for name, runs in results.items()},
        "first_step_ms": {name: [1e3 * t[0] for t in runs] for name, runs in results.items()},
        "steady_ratio_per_round": ratios,
        "steady_ratio": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--mode", default="bk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the step times as one JSON line")
    parser.add_argument("--compare", metavar="SRC", help="another source tree to run side by side")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compare:
        print(json.dumps(compare(args.compare, args.rounds, args.steps, args.mode), indent=1))
        return
    times = run(args.steps, args.mode, args.seed)
    if args.json:
        print(json.dumps(times))
    else:
        print(f"first step {1e3 * times[0]:.1f} ms, steady median {1e3 * steady(times):.2f} ms over {len(times)} steps")


if __name__ == "__main__":
    main()
