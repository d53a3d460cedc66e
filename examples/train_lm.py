"""Train a small transformer language model with differential privacy, and the same model without, side by side.

    python examples/train_lm.py                       # defaults: about a minute on 2 CPU cores
    python examples/train_lm.py --mode ghost --target-epsilon 3 --steps 400 --seq-len 128

Data: the books of Genesis and Exodus (King James Version, public domain), one verse per line; each verse is one
private record. Model: a Llama-style decoder over characters, built from a transformers config. The private run
uses Poisson sampling, per-sample clipping and Gaussian noise calibrated to the target epsilon; the non-private run
sees the same batches. Writes a PNG of both loss curves and prints a summary.
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import flashdp

DATA = Path(__file__).parent / "data" / "kjv_genesis_exodus.txt.gz"
PAD, BOS = 0, 1
DELTA = 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bk", choices=["bk", "ghost"])
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="at delta = 1e-5")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seq-len", type=int, default=96, help="characters per verse (longer ones are cut)")
    parser.add_argument("--batch-size", type=int, default=64, help="expected Poisson batch size")
    parser.add_argument("--micro-batch", type=int, default=64, help="most samples per backward (bounds memory)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=Path("out/train_lm_loss.png"))
    parser.add_argument("--seed", type=int, default=0, help="model init and data split (the DP noise is not seeded)")
    return parser.parse_args(argv)


def load_verses(seq_len: int) -> tuple[TensorDataset, TensorDataset, list[str]]:
    """Train / validation sets of (ids [N, T], attention mask [N, T]) and the character vocabulary."""
    with gzip.open(DATA, "rt") as f:
        verses = f.read().splitlines()
    chars = sorted(set("".join(verses)))
    index = {c: i + 2 for i, c in enumerate(chars)}
    ids = torch.full((len(verses), seq_len), PAD)
    for row, verse in enumerate(verses):
        encoded = [BOS, *(index[c] for c in verse[: seq_len - 1])]
        ids[row, : len(encoded)] = torch.tensor(encoded)
    mask = (ids != PAD).long()
    order = torch.randperm(len(verses), generator=torch.Generator().manual_seed(0))
    n_val = len(verses) // 10
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(ids[train], mask[train]), TensorDataset(ids[val], mask[val]), chars


def build_model(vocab: int, args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=PAD,
    )
    return LlamaForCausalLM(config)


def sequence_losses(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean next-character loss over each verse's own characters."""
    logits = model(input_ids=ids, attention_mask=mask).logits
    return flashdp.per_sample_lm_loss(logits, ids, attention_mask=mask)


@torch.no_grad()
def validation_loss(model: LlamaForCausalLM, data: TensorDataset) -> float:
    ids, mask = data.tensors
    return sequence_losses(model.eval(), ids, mask).mean().item()


def train(args: argparse.Namespace, private: bool, train_set: TensorDataset, vocab: int) -> dict:
    model = build_model(vocab, args).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sample_rate = args.batch_size / len(train_set)
    loader = flashdp.poisson_loader(train_set, sample_rate, steps=args.steps, seed=args.seed)
    engine = None
    if private:
        engine = flashdp.make_private(
            model,
            mode=args.mode,
            max_grad_norm=args.max_grad_norm,
            noise_multiplier=None,
            target_epsilon=args.target_epsilon,
            target_delta=DELTA,
            steps=args.steps,
            sample_rate=sample_rate,
            expected_batch_size=args.batch_size,
            optimizer=optimizer,
        )
    losses, epsilon = [], 0.0
    start = time.perf_counter()
    bar = tqdm(loader, desc="private" if private else "non-private", unit="step", leave=True)
    for step, (ids, mask) in enumerate(bar, start=1):
        step_losses = []
        for micro_ids, micro_mask in flashdp.micro_batches((ids, mask), args.micro_batch):
            loss = sequence_losses(model, micro_ids, micro_mask)
            step_losses.append(loss.detach())
            if engine is not None:
                engine.backward(loss)
            elif len(loss):
                (loss.sum() / args.batch_size).backward()
        if engine is not None:
            engine.step()
            if step % 50 == 0 or step == args.steps:  # PLD accounting takes about a second
                epsilon = engine.epsilon(DELTA)
        else:
            optimizer.step()
            optimizer.zero_grad()
        batch_loss = torch.cat(step_losses)
        if len(batch_loss):
            losses.append(batch_loss.mean().item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}" if losses else "-", epsilon=f"{epsilon:.2f}" if private else "inf")
    result = {
        "model": model,
        "losses": losses,
        "seconds": time.perf_counter() - start,
        "epsilon": epsilon,
        "sigma": engine.noise_multiplier if engine else 0.0,
    }
    if engine is not None:
        engine.detach()
    return result


def smoothed(values: list[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot(path: Path, private: dict, public: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(smoothed(public["losses"]), label="non-private")
    ax.plot(smoothed(private["losses"]), label=f"flashdp {args.mode}, epsilon={private['epsilon']:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / character, 10-step mean)")
    ax.set_title("Character LM on Genesis and Exodus (KJV)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@torch.no_grad()
def sample_text(model: LlamaForCausalLM, chars: list[str], prompt: str, length: int = 60) -> str:
    ids = torch.tensor([[BOS] + [chars.index(c) + 2 for c in prompt]])
    out = model.eval().generate(ids, max_new_tokens=length, do_sample=False, pad_token_id=PAD)
    return prompt + "".join(chars[i - 2] for i in out[0, ids.shape[1] :].tolist() if i >= 2)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    train_set, val_set, chars = load_verses(args.seq_len)
    vocab = len(chars) + 2
    print(f"{len(train_set)} training verses, {len(val_set)} validation verses, {vocab} symbols")
    private = train(args, True, train_set, vocab)
    public = train(args, False, train_set, vocab)
    plot(args.plot, private, public, args)
    summary = {
        "epsilon": private["epsilon"],
        "delta": DELTA,
        "sigma": private["sigma"],
        "steps": args.steps,
        "val_loss_private": validation_loss(private["model"], val_set),
        "val_loss_non_private": validation_loss(public["model"], val_set),
        "seconds_private": private["seconds"],
        "seconds_non_private": public["seconds"],
    }
    print(
        f"\nDP-SGD ({args.mode}): epsilon = {summary['epsilon']:.2f} at delta = {DELTA:g}, "
        f"sigma = {summary['sigma']:.3f}, {args.steps} steps of expected batch {args.batch_size}"
    )
    print(
        f"validation loss (nats / character): private {summary['val_loss_private']:.3f}, "
        f"non-private {summary['val_loss_non_private']:.3f}"
    )
    print(
        f"training time: private {summary['seconds_private']:.1f}s, non-private {summary['seconds_non_private']:.1f}s"
    )
    print(f"loss curves: {args.plot}")
    print(f"private model:     {sample_text(private['model'], chars, 'And God said')!r}")
    print(f"non-private model: {sample_text(public['model'], chars, 'And God said')!r}")
    return summary


if __name__ == "__main__":
    main()
