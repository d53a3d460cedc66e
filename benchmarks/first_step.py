"""What a first DP step costs against a steady one, and how much of it is the forward hooks' rule checks.

    python benchmarks/first_step.py --model gpt2-12          # HF GPT-2, d=64, 12 layers, B=4, T=32
    python benchmarks/first_step.py --model gpt2 --seq 256   # benchmarks/harness.py's GPT-2, d=256, 4 layers

A first forward checks each duck-typed module (HF GPT-2's `Conv1D`, RMSNorm-like layers) against its rule's
forward; a first backward verifies the layout and runs the self-check. Each run is a fresh process (a first step is
once per process): compare trees by running this alternately with `PYTHONPATH=<tree>/src`. Printed: the first
forward, the time inside the recorder's forward hooks during it, and the first bk step (forward, backward, step)
against the fastest of the next three.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch

import flashdp
from benchmarks.harness import build_model, data, per_sample_loss
from flashdp._pipeline import recorder


def _hook_timer() -> list[float]:
    """Seconds spent in the recorder's forward hook, accumulated into the returned list's one entry."""
    spent, record = [0.0], recorder.Recorder.record

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return record(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    recorder.Recorder.record = timed
    return spent


def _workload(model_name: str, seq: int, batch: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    if model_name == "gpt2-12":
        import transformers

        config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=12, n_head=4, n_positions=max(64, seq))
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 512, (batch, seq))
        return model, lambda: per_sample_loss(model(ids).logits, ids)
    model = build_model(model_name, "cpu")
    x, y = data(model_name, seq, batch, "cpu")
    return model, lambda: per_sample_loss(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-12")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    model, loss_of = _workload(args.model, args.seq, args.batch)
    with torch.no_grad():
        loss_of()  # the process's own first-use costs, outside the first step
    engine = flashdp.make_private(
        model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0, optimizer=torch.optim.SGD(model.parameters()),
        expected_batch_size=args.batch, sample_rate=0.01,
    )  # fmt: skip
    hooks = _hook_timer()
    steps, forwards, hook_seconds = [], [], []
    for _ in range(4):
        hooks[0] = 0.0
        start = time.perf_counter()
        loss = loss_of()
        forwards.append(time.perf_counter() - start)
        hook_seconds.append(hooks[0])
        engine.backward(loss)
        engine.step()
        steps.append(time.perf_counter() - start)
    steady = min(steps[1:])
    print(
        f"{args.model} B={args.batch} T={args.seq}: first forward {forwards[0] * 1e3:.0f} ms (hooks "
        f"{hook_seconds[0] * 1e3:.0f} ms; steady {min(forwards[1:]) * 1e3:.0f} ms), first step {steps[0] * 1e3:.0f} "
        f"ms, steady {steady * 1e3:.0f} ms ({steps[0] / steady:.1f}x)"
    )


if __name__ == "__main__":
    main()
