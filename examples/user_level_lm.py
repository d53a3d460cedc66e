"""User-level DP fine-tuning of a small language model, where each user contributes many records.

    python examples/user_level_lm.py                 # about 20 seconds on 2 CPU cores
    python examples/user_level_lm.py --examples-per-user 8 --target-epsilon 4

The private records of `examples/train_lm.py` (the verses of Exodus) are given authors: each run of
`--verses-per-user` consecutive verses is one user's (Exodus 1:1-10 are user 0's, and so on; 10% of the users are
held out for validation). Example-level DP protects one verse, but a user's 10 verses could enter a step up to 10
times; user-level DP protects the user. Each step samples USERS at rate q, takes up to `--examples-per-user` of each
sampled user's verses, and clips each user's summed gradient to C:

    engine = flashdp.make_private(model, ..., sample_rate=q, expected_batch_size=q * number_of_users)
    for (ids, mask), users in engine.data_loader(records, users=user_of_record, examples_per_user=k):
        for (micro_ids, micro_mask), micro_users in flashdp.micro_batches(((ids, mask), users), 32, users=users):
            engine.backward(per_verse_losses(model, micro_ids, micro_mask), users=micro_users)
        engine.step()

Both fine-tunes below start from the same public pre-training (Genesis, non-private) and are calibrated to the same
epsilon, one per verse and one per user: the printout shows what the stronger unit costs at equal epsilon.
"""

from __future__ import annotations

import argparse
import copy
import sys
from argparse import Namespace
from pathlib import Path

import torch
from torch.utils.data import TensorDataset
from tqdm import tqdm

import flashdp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (the data and model of examples/train_lm.py)
import train_lm


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bk", choices=["bk", "ghost"])
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="at delta = 1e-5")
    parser.add_argument("--verses-per-user", type=int, default=10)
    parser.add_argument("--examples-per-user", type=int, default=4, help="k: most verses of one user in a step")
    parser.add_argument("--users-per-step", type=int, default=24, help="expected sampled users per step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pretrain-steps", type=int, default=120)
    parser.add_argument("--pretrain-batch-size", type=int, default=64)
    parser.add_argument("--pretrain-lr", type=float, default=3e-3)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=32, help="most rows per backward (users kept whole)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--d-model", type=int, default=48)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def user_records(
    ids: torch.Tensor, mask: torch.Tensor, verses_per_user: int
) -> tuple[TensorDataset, torch.Tensor, TensorDataset]:
    """(the training verses of Exodus, the user of each, the held-out users' verses), from every verse's ids and
    mask (`train_lm.encode_verses`)."""
    private = torch.arange(train_lm.GENESIS_VERSES, len(ids))
    users = (private - train_lm.GENESIS_VERSES) // verses_per_user
    held_out = users % 10 == 9  # every tenth user
    train, val = private[~held_out], private[held_out]
    return TensorDataset(ids[train], mask[train]), users[~held_out], TensorDataset(ids[val], mask[val])


def fine_tune(
    model, records: TensorDataset, users: torch.Tensor, k: int, expected: int, args: Namespace, label: str
) -> dict:
    """DP fine-tuning at the target epsilon, each user's (up to `k`) verses clipped together, `expected` users a
    step. A verse of its own user (`users` all distinct, k = 1) is example-level DP-SGD."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = flashdp.make_private(
        model, mode=args.mode, max_grad_norm=args.max_grad_norm, target_epsilon=args.target_epsilon,
        target_delta=train_lm.DELTA, steps=args.steps, sample_rate=expected / flashdp.data.count_users(users),
        expected_batch_size=expected, optimizer=optimizer,
    )  # fmt: skip
    loader = engine.data_loader(records, users=users, examples_per_user=k, steps=args.steps)
    model.train()
    for (ids, mask), who in tqdm(loader, desc=label, unit="step", total=args.steps):
        for (micro_ids, micro_mask), micro_users in flashdp.micro_batches(
            ((ids, mask), who), args.micro_batch, users=who
        ):
            if len(micro_ids) == 0:  # an empty Poisson batch: HF models cannot run a forward on zero rows
                engine.backward_empty()
                continue
            engine.backward(train_lm.sequence_losses(model, micro_ids, micro_mask), users=micro_users)
        engine.step()
    result = {"epsilon": engine.epsilon(train_lm.DELTA), "sigma": engine.noise_multiplier}
    engine.detach()
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ids, mask, chars = train_lm.encode_verses(args.seq_len)
    records, users, held_out = user_records(ids, mask, args.verses_per_user)
    print(
        f"private: {len(records)} verses of Exodus by {flashdp.data.count_users(users)} users "
        f"({args.verses_per_user} consecutive verses each; {len(held_out)} verses of held-out users for validation)"
    )
    public = TensorDataset(ids[: train_lm.GENESIS_VERSES], mask[: train_lm.GENESIS_VERSES])
    pretrained = train_lm.build_model(len(chars) + 2, args)
    pretraining = train_lm.with_settings(args, batch_size=args.pretrain_batch_size, lr=args.pretrain_lr)
    train_lm.train(pretrained, public, pretraining, args.pretrain_steps, False, "pre-train (public)")
    summary = {"val_loss": {"public pre-training only": train_lm.validation_loss(pretrained, held_out)}}
    k = args.examples_per_user
    verses_per_step = args.users_per_step * min(k, args.verses_per_user)
    units = {  # the same expected verses a step
        "user": (users, k, args.users_per_step),
        "verse": (torch.arange(len(records)), 1, verses_per_step),
    }
    for unit, (unit_users, unit_k, expected) in units.items():
        model = copy.deepcopy(pretrained)
        run = fine_tune(model, records, unit_users, unit_k, expected, args, f"DP per {unit}")
        label = f"DP fine-tune, one {unit} protected"
        summary["val_loss"][label] = train_lm.validation_loss(model, held_out)
        summary[f"sigma per {unit}"], summary["epsilon"] = run["sigma"], run["epsilon"]
    print(f"\nvalidation loss (nats per character) on held-out users' verses, epsilon {summary['epsilon']:.2f}:")
    for label, loss in summary["val_loss"].items():
        print(f"  {label:<40} {loss:.3f}")
    print(
        f"noise multiplier: {summary['sigma per user']:.2f} per user ({args.users_per_step} users a step), "
        f"{summary['sigma per verse']:.2f} per verse (the same verses a step, sampled one by one)"
    )
    return summary


if __name__ == "__main__":
    main()
