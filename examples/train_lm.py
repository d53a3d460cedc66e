"""Private fine-tuning after public pre-training, the way DP training is done in practice, on a small language model.

    python examples/train_lm.py                       # defaults: about a minute on 2 CPU cores
    python examples/train_lm.py --mode ghost --target-epsilon 3 --steps 300

Data: the King James Version (public domain), one verse per line. Genesis plays the PUBLIC corpus: a Llama-style
character model is pre-trained on it without privacy. The verses of Exodus are the PRIVATE records, each verse one
record (10% held out for validation). Three fine-tunes of the same length on the private records:

    private fine-tune        the pre-trained model, DP-SGD (Poisson sampling, per-sample clipping, Gaussian noise)
    private from scratch     a fresh model, DP-SGD with the same epsilon
    non-private fine-tune    the pre-trained model, plain training on the same batches: the gap DP costs

plus the private fine-tune again at each epsilon of `--sweep-epsilons` (default 2): what a smaller budget costs.

Epsilon is on every step of the private progress bars (RDP accounting by default: instant at every step; the
tighter PLD accountant, `--accountant pld`, takes about 0.15 s a step). Writes a PNG of the loss curves.

The fine-tuning settings (expected batch 128, 75 steps, Adam at 1.5e-3) were chosen by a small sweep at epsilon 8
(docs/benchmarks.md, "The demo's settings"): at the same compute, larger batches and a lower learning rate than
non-private training took the private fine-tune from 1.60 to 1.47 nats per character (public model alone: 1.65,
non-private fine-tune: 1.20). The noise added to a step's mean gradient shrinks as the batch grows.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import flashdp

DATA = Path(__file__).parent / "data" / "kjv_genesis_exodus.txt.gz"
#: the verses of Genesis come first in the file (Genesis 1:1 to 50:26)
GENESIS_VERSES = 1533
PAD, BOS = 0, 1
DELTA = 1e-5


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bk", choices=["bk", "ghost"])
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="at delta = 1e-5")
    parser.add_argument("--accountant", default="rdp", choices=["rdp", "pld"])
    parser.add_argument("--sweep-epsilons", default="2", help="more private fine-tunes, comma-separated ('' none)")
    parser.add_argument("--pretrain-steps", type=int, default=200, help="non-private steps on Genesis")
    parser.add_argument("--pretrain-batch-size", type=int, default=64)
    parser.add_argument("--pretrain-lr", type=float, default=3e-3)
    parser.add_argument("--steps", type=int, default=75, help="steps of each fine-tune on Exodus")
    parser.add_argument("--seq-len", type=int, default=96, help="characters per verse (longer ones are cut)")
    parser.add_argument("--batch-size", type=int, default=128, help="expected Poisson batch size of the fine-tunes")
    parser.add_argument("--micro-batch", type=int, default=64, help="most samples per backward (bounds memory)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1.5e-3, help="Adam's learning rate in the fine-tunes")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=Path("out/train_lm_loss.png"))
    parser.add_argument("--seed", type=int, default=0, help="model init and data split (the DP noise is not seeded)")
    return parser.parse_args(argv)


@dataclass
class Corpus:
    public: TensorDataset  # Genesis: (ids [N, T], attention mask [N, T])
    private_train: TensorDataset  # Exodus, 90%
    private_val: TensorDataset  # Exodus, 10%
    chars: list[str]


def encode_verses(seq_len: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Every verse of the file in order, as character ids `[N, T]` (BOS first, PAD after) and its attention mask
    `[N, T]`, with the characters (id `i + 2` is `chars[i]`)."""
    with gzip.open(DATA, "rt") as f:
        verses = f.read().splitlines()
    chars = sorted(set("".join(verses)))
    index = {c: i + 2 for i, c in enumerate(chars)}
    ids = torch.full((len(verses), seq_len), PAD)
    for row, verse in enumerate(verses):
        encoded = [BOS, *(index[c] for c in verse[: seq_len - 1])]
        ids[row, : len(encoded)] = torch.tensor(encoded)
    return ids, (ids != PAD).long(), chars


def load_corpus(seq_len: int) -> Corpus:
    """Genesis as public text, Exodus as private records; one character vocabulary over both."""
    ids, mask, chars = encode_verses(seq_len)
    private = GENESIS_VERSES + torch.randperm(len(ids) - GENESIS_VERSES, generator=torch.Generator().manual_seed(0))
    n_val = len(private) // 10
    val, train = private[:n_val], private[n_val:]
    public = torch.arange(GENESIS_VERSES)
    return Corpus(
        TensorDataset(ids[public], mask[public]),
        TensorDataset(ids[train], mask[train]),
        TensorDataset(ids[val], mask[val]),
        chars,
    )


def build_model(vocab: int, args: Namespace) -> LlamaForCausalLM:
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


def with_settings(args: Namespace, **settings: object) -> Namespace:
    """`args` with some settings replaced (pre-training's batch and learning rate, a sweep's epsilon)."""
    return Namespace(**{**vars(args), **settings})


def train(model: LlamaForCausalLM, data: TensorDataset, args: Namespace, steps: int, private: bool, label: str) -> dict:
    """`steps` Poisson-sampled steps on `data`; with DP-SGD calibrated to the target epsilon when private."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sample_rate = args.batch_size / len(data)
    engine = None
    if private:
        engine = flashdp.make_private(
            model,
            mode=args.mode,
            max_grad_norm=args.max_grad_norm,
            target_epsilon=args.target_epsilon,
            target_delta=DELTA,
            steps=steps,
            accountant=args.accountant,
            sample_rate=sample_rate,
            expected_batch_size=args.batch_size,
            optimizer=optimizer,
        )
        loader = engine.data_loader(data, steps=steps)
    else:  # the same sampling, so that the runs differ only in clipping and noise
        loader = flashdp.poisson_loader(data, sample_rate, steps=steps, seed=args.seed)
    losses = []
    start = time.perf_counter()
    bar = tqdm(loader, desc=label, unit="step", leave=True)
    for ids, mask in bar:
        step_losses = []
        for micro_ids, micro_mask in flashdp.micro_batches((ids, mask), args.micro_batch):
            if len(micro_ids) == 0:  # an empty Poisson batch: HF models cannot run a forward on zero rows
                if engine is not None:
                    engine.backward_empty()
                continue
            loss = sequence_losses(model, micro_ids, micro_mask)
            step_losses.append(loss.detach())
            if engine is not None:
                engine.backward(loss)
            else:
                (loss.sum() / args.batch_size).backward()
        if engine is not None:
            engine.step()
        else:
            optimizer.step()
            optimizer.zero_grad()
        if step_losses:
            losses.append(torch.cat(step_losses).mean().item())
        shown = {"loss": f"{losses[-1]:.3f}" if losses else "-"}
        if engine is not None:
            shown["epsilon"] = f"{engine.epsilon(DELTA):.2f}"
        bar.set_postfix(shown)
    result = {
        "model": model,
        "losses": losses,
        "seconds": time.perf_counter() - start,
        "epsilon": engine.epsilon(DELTA) if engine else None,
        "sigma": engine.noise_multiplier if engine else None,
    }
    if engine is not None:
        engine.detach()
    return result


def smoothed(values: list[float], window: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def plot(path: Path, runs: dict[str, dict], epsilon: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, run in runs.items():
        ax.plot(smoothed(run["losses"]), label=label)
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("training loss (nats / character, 10-step mean)")
    ax.set_title(f"Exodus verses as private records (KJV); DP at epsilon {epsilon:.2f} unless labelled")
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
    corpus = load_corpus(args.seq_len)
    vocab = len(corpus.chars) + 2
    print(
        f"public: {len(corpus.public)} verses of Genesis; private: {len(corpus.private_train)} verses of Exodus "
        f"(+{len(corpus.private_val)} held out); {vocab} symbols"
    )
    pretrained = build_model(vocab, args)
    public = with_settings(args, batch_size=args.pretrain_batch_size, lr=args.pretrain_lr)
    pretraining = train(pretrained, corpus.public, public, args.pretrain_steps, False, "pre-train (public)")
    runs = {
        "private fine-tune": train(
            copy.deepcopy(pretrained), corpus.private_train, args, args.steps, True, "DP fine-tune"
        ),
        "private from scratch": train(
            build_model(vocab, args), corpus.private_train, args, args.steps, True, "DP scratch"
        ),
        "non-private fine-tune": train(
            copy.deepcopy(pretrained), corpus.private_train, args, args.steps, False, "non-DP fine-tune"
        ),
    }
    for sweep in [float(e) for e in args.sweep_epsilons.split(",") if e.strip()]:
        budget = with_settings(args, target_epsilon=sweep)
        runs[f"private fine-tune, epsilon {sweep:g}"] = train(
            copy.deepcopy(pretrained), corpus.private_train, budget, args.steps, True, f"DP fine-tune (eps {sweep:g})"
        )
    epsilon = runs["private fine-tune"]["epsilon"]
    plot(args.plot, runs, epsilon)
    val = {label: validation_loss(run["model"], corpus.private_val) for label, run in runs.items()}
    val["public pre-training only"] = validation_loss(pretrained, corpus.private_val)
    summary = {
        "epsilon": epsilon,
        "delta": DELTA,
        "sigma": runs["private fine-tune"]["sigma"],
        "steps": args.steps,
        "val_loss": val,
        "epsilons": {label: run["epsilon"] for label, run in runs.items() if run["epsilon"] is not None},
        "seconds": {"pre-train": pretraining["seconds"], **{k: r["seconds"] for k, r in runs.items()}},
    }
    print(
        f"\nDP-SGD ({args.mode}, {args.accountant} accounting): epsilon = {epsilon:.2f} at delta = {DELTA:g}, "
        f"sigma = {summary['sigma']:.3f}, {args.steps} steps of expected batch {args.batch_size}"
    )
    print("validation loss on held-out Exodus verses (nats / character):")
    width = max(map(len, val))
    for label, loss in val.items():
        print(f"  {label:<{width}} {loss:.3f}")
    print("time: " + ", ".join(f"{label} {seconds:.1f}s" for label, seconds in summary["seconds"].items()))
    print(f"loss curves: {args.plot}")
    for label, run in runs.items():
        print(f"{label + ':':<{width + 1}} {sample_text(run['model'], corpus.chars, 'And Moses said')!r}")
    return summary


if __name__ == "__main__":
    main()
