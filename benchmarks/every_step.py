"""Per-step cost of flashdp's every-step checks on a Hugging Face LM fine-tune whose batch changes every step.

A GPT-2 (d=128, 2 layers, vocab 512) trained with Poisson batches (expected size 8) of sequences of random length
(8 to 96 tokens) padded to the longest of each batch: B and T change on every step, as in real fine-tuning.

    python benchmarks/every_step.py                      # this tree: first and steady step times
    python benchmarks/every_step.py --compare OTHER/src  # this tree against another source tree, step by step

With --compare, the other tree's flashdp is imported under another name in the same process, and two copies of the
model (same weights, same batches, same noise seed) train side by side: each step runs on both, in alternating
order, so that both see the same load. Reported: the median over steps of the per-step time ratio after the first
`SKIP` steps (the steady state), the first step of each, and the steps on which this tree verified a structure.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

SKIP = 10  # steps before the steady state (the first structures' verification and self-check)
DATASET, VOCAB, EXPECTED = 2000, 512, 8


def build_model() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=128))


def batches(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Poisson batches of the dataset, each padded to its longest sequence (None: an empty batch)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 97, (DATASET,), generator=generator)
    tokens = torch.randint(1, VOCAB, (DATASET, 96), generator=generator)
    out = []
    for _ in range(steps):
        picked = torch.nonzero(torch.rand(DATASET, generator=generator) < EXPECTED / DATASET).flatten()
        longest = int(lengths[picked].max()) if len(picked) else 0
        mask = (torch.arange(longest)[None] < lengths[picked, None]).long()
        out.append((tokens[picked, :longest], mask) if len(picked) else None)
    return out


class Trainer:
    """One model and its engine from one flashdp package; `step(batch)` times one DP-SGD step."""

    def __init__(self, flashdp: ModuleType, model: torch.nn.Module, mode: str) -> None:
        self.flashdp, self.model = flashdp, model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        self.engine = flashdp.make_private(
            model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer,
            expected_batch_size=EXPECTED, sample_rate=EXPECTED / DATASET, seed=0,
        )  # fmt: skip

    def step(self, batch: tuple[torch.Tensor, torch.Tensor] | None) -> float:
        start = time.perf_counter()
        if batch is None:
            self.engine.backward_empty()
        else:
            ids, mask = batch
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            self.engine.backward(self.flashdp.per_sample_lm_loss(logits, ids, attention_mask=mask))
        self.engine.step()
        return time.perf_counter() - start


def baseline_package(source: Path, into: Path) -> ModuleType:
    """The flashdp package of another source tree, imported as `flashdp_baseline` (its imports rewritten)."""
    target = into / "flashdp_baseline"
    shutil.copytree(source / "flashdp", target)
    for path in target.rglob("*.py"):
        text = re.sub(r"\b(from|import) flashdp\b", r"\1 flashdp_baseline", path.read_text())
        path.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module("flashdp_baseline")


def compare(other: Path, steps: int, mode: str, seed: int) -> dict:
    import flashdp

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model()
        trainers = {"this": Trainer(flashdp, model, mode)}
        trainers["other"] = Trainer(baseline_package(other, Path(tmp)), copy.deepcopy(model), mode)
        times: dict[str, list[float]] = {"this": [], "other": []}
        verified = []
        for index, batch in enumerate(batches(steps, seed)):
            known = len(trainers["this"].engine._known.verified)
            for name in ("this", "other") if index % 2 == 0 else ("other", "this"):
                times[name].append(trainers[name].step(batch))
            if len(trainers["this"].engine._known.verified) > known:
                verified.append(index)
    ratios = [a / b for a, b in zip(times["this"][SKIP:], times["other"][SKIP:], strict=True)]
    return {
        "mode": mode,
        "steps": steps,
        "seed": seed,
        "steady_ms": {name: 1e3 * statistics.median(t[SKIP:]) for name, t in times.items()},
        "first_step_ms": {name: 1e3 * t[0] for name, t in times.items()},
        "steady_ratio": statistics.median(ratios),
        "steady_ratio_quartiles": statistics.quantiles(ratios, n=4),
        "steps_verifying_a_structure": verified,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--mode", default="bk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", metavar="SRC", type=Path, help="another source tree, run side by side")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare:
        print(json.dumps(compare(args.compare, args.steps, args.mode, args.seed), indent=1))
        return
    import flashdp

    trainer = Trainer(flashdp, build_model(), args.mode)
    times = [trainer.step(batch) for batch in batches(args.steps, args.seed)]
    print(f"first step {1e3 * times[0]:.1f} ms, steady median {1e3 * statistics.median(times[SKIP:]):.2f} ms")


if __name__ == "__main__":
    main()
