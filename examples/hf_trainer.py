"""Private fine-tuning with the Hugging Face Trainer: DPTrainer on a small GPT-2 over the verses of Exodus.

    python examples/hf_trainer.py                    # about a minute on 2 CPU cores
    python examples/hf_trainer.py --target-epsilon 3 --max-steps 200
    torchrun --nproc_per_node 2 examples/hf_trainer.py                # 2 processes, DDP (gloo on CPU)
    accelerate launch --num_processes 2 --cpu examples/hf_trainer.py  # the same, launched by accelerate
    accelerate launch --num_processes 2 examples/hf_trainer.py --gpu  # 2 GPUs, DDP (NCCL)

Each verse is one private record (characters as tokens; padding labelled -100, so it is not learnt). DPTrainer
samples every step's batch with Poisson sampling, clips each verse's gradient, adds the noise, logs epsilon with
the loss and saves the engine's state with each checkpoint (`--resume` continues from the last one). On several
processes every process samples the same batch and trains on its share of it (docs/guides/hf-transformers.md).
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from flashdp.integrations.transformers import DPTrainer, PrivacyArguments

DATA = Path(__file__).parent / "data" / "kjv_genesis_exodus.txt.gz"
GENESIS_VERSES = 1533  # Exodus follows
PAD = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="at delta = 1e-5")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64, help="expected Poisson batch size")
    parser.add_argument("--micro-batch", type=int, default=32, help="per_device_train_batch_size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("out/hf_trainer"))
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU(s), not the CPU")
    return parser.parse_args(argv)


def exodus_records(seq_len: int) -> tuple[list[dict], int]:
    """One record per verse: input_ids [T] and labels [T] (-100 on padding); the vocabulary size."""
    with gzip.open(DATA, "rt") as f:
        verses = f.read().splitlines()[GENESIS_VERSES:]
    chars = sorted(set("".join(verses)))
    index = {c: i + 1 for i, c in enumerate(chars)}
    records = []
    for verse in verses:
        ids = torch.full((seq_len,), PAD)
        encoded = torch.tensor([index[c] for c in verse[:seq_len]])
        ids[: len(encoded)] = encoded
        records.append({"input_ids": ids, "labels": ids.masked_fill(ids == PAD, -100)})
    return records, len(chars) + 1


def gpt2(vocab: int, seq_len: int, d_model: int, layers: int) -> GPT2LMHeadModel:
    """A small GPT-2 over the characters, seeded (every process builds the same)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq_len, n_embd=d_model, n_layer=layers, n_head=4,
        bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def main(argv: list[str] | None = None) -> DPTrainer:
    args = parse_args(argv)
    records, vocab = exodus_records(args.seq_len)
    trainer = DPTrainer(
        model=gpt2(vocab, args.seq_len, args.d_model, args.layers),
        args=TrainingArguments(
            output_dir=str(args.output_dir),
            per_device_train_batch_size=args.micro_batch,
            max_steps=args.max_steps,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,  # the per-sample clipping bound C
            logging_steps=max(1, args.max_steps // 10),
            save_steps=max(1, args.max_steps // 2),
            report_to=[],
            use_cpu=not args.gpu,
        ),
        train_dataset=records,
        privacy=PrivacyArguments(expected_batch_size=args.batch_size, target_epsilon=args.target_epsilon, delta=1e-5),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        print(f"epsilon {trainer.engine.epsilon(1e-5):.2f} at delta 1e-5 after {trainer.engine.steps} steps")
    return trainer


if __name__ == "__main__":
    main()
