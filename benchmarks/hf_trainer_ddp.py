"""DPTrainer against the non-private Trainer on the same model, on several processes (DDP), side by side in one run.

    torchrun --nproc_per_node 2 benchmarks/hf_trainer_ddp.py            # CPU, gloo
    torchrun --nproc_per_node 2 benchmarks/hf_trainer_ddp.py --gpu      # one GPU per process, NCCL

A GPT-2 (d=--d-model, --layers, T=--seq-len) on the verses of Exodus (examples/hf_trainer.py's data). Rounds
alternate the two trainers from the same initial weights: the non-private Trainer with a fixed global batch of
--batch-size rows, DPTrainer with Poisson batches of --batch-size rows in expectation (bk). Each run's step times
come from a callback (after its first 2 steps); printed by the main process: the median step of each trainer over
all rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from flashdp.integrations.transformers import DPTrainer, PrivacyArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.hf_trainer import exodus_records, gpt2


class StepTimes(TrainerCallback):
    """The wall time of each optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.times.append(time.perf_counter() - self._begin)


def run(private: bool, model: GPT2LMHeadModel, records: list[dict], args: argparse.Namespace) -> list[float]:
    """One training run of --steps steps: its step times after the first 2."""
    world = int(torch.distributed.get_world_size()) if torch.distributed.is_initialized() else 1
    settings = TrainingArguments(
        output_dir="out/hf_trainer_ddp", per_device_train_batch_size=args.batch_size // world,
        max_steps=args.steps, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=not args.gpu,
        disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    timer = StepTimes()
    common = {"model": copy.deepcopy(model), "args": settings, "train_dataset": records, "callbacks": [timer]}
    if private:
        privacy = PrivacyArguments(expected_batch_size=args.batch_size, noise_multiplier=1.0, seed=0)
        DPTrainer(privacy=privacy, **common).train()
    else:
        Trainer(**common).train()
    return timer.times[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="global (expected) batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    records, vocab = exodus_records(args.seq_len)
    model = gpt2(vocab, args.seq_len, args.d_model, args.layers)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for private in (False, True):
            times[private] += run(private, model, records, args)
    distributed = torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        plain, private = (statistics.median(times[k]) * 1e3 for k in (False, True))
        world = torch.distributed.get_world_size() if distributed else 1
        ratio = private / plain
        print(f"{world} process(es): Trainer {plain:.1f} ms/step, DPTrainer {private:.1f} ms/step: {ratio:.2f}x")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
