"""A short private-training run: a small CNN on the handwritten digits shipped in examples/data.

    python examples/quickstart.py

Trains with DP-SGD (book-keeping mode, flat clipping, Poisson sampling) and reports accuracy and epsilon.
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import flashdp

DATA = Path(__file__).parent / "data" / "digits.csv.gz"


def load_digits(test_fraction: float = 0.2):
    """(x_train [N, 1, 8, 8], y_train [N], x_test, y_test), pixels scaled to [0, 1], a fixed shuffle."""
    with gzip.open(DATA, "rt") as f:
        table = torch.from_numpy(np.loadtxt(f, delimiter=","))
    table = table[torch.randperm(len(table), generator=torch.Generator().manual_seed(0))]
    x = (table[:, :64] / 16.0).float().view(-1, 1, 8, 8)
    y = table[:, 64].long()
    n_test = int(len(table) * test_fraction)
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bk", choices=["bk", "ghost"])
    parser.add_argument("--epsilon", type=float, default=3.0, help="target epsilon at delta = 1e-5")
    parser.add_argument("--epochs", type=float, default=8.0)
    parser.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) batch size")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1.0)
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = load_digits()
    n = len(x_train)
    sample_rate = args.batch_size / n
    steps = int(args.epochs / sample_rate)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Tanh(), nn.Flatten(), nn.Linear(16 * 64, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    engine = flashdp.make_private(
        model,
        mode=args.mode,
        max_grad_norm=args.max_grad_norm,
        noise_multiplier=None,
        target_epsilon=args.epsilon,
        target_delta=1e-5,
        steps=steps,
        optimizer=optimizer,
        expected_batch_size=args.batch_size,
        sample_rate=sample_rate,
    )
    print(
        f"{n} training images, {steps} steps of expected batch {args.batch_size}, sigma={engine.noise_multiplier:.3f}"
    )

    start = time.perf_counter()
    # Poisson sampling at the engine's rate, as its epsilon assumes: batch sizes vary and may be 0
    loader = engine.data_loader(TensorDataset(x_train, y_train), steps=steps)
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.cross_entropy(model(x), y, reduction="none")
        engine.backward(loss)  # (this model runs on zero rows; one that cannot calls engine.backward_empty())
        engine.step()
        if step % 50 == 0 or step == steps:
            mean_loss = loss.mean().item() if len(loss) else float("nan")
            print(f"step {step:4d}  loss {mean_loss:.3f}  epsilon {engine.epsilon(1e-5):.2f}")

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(
        f"test accuracy {accuracy:.3f} at epsilon {engine.epsilon(1e-5):.2f} (delta 1e-5), "
        f"{time.perf_counter() - start:.1f}s"
    )
    engine.detach()


if __name__ == "__main__":
    main()
