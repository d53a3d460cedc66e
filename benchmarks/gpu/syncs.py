"""Host-device synchronisations of a steady-state flashdp step on CUDA, as the CUDA runtime reports them (needs a GPU).

    python benchmarks/gpu/syncs.py

Runs the model of `tests/test_syncs.py` (a layer of every dedicated rule kind) on `cuda:0` in bk, ghost and flash,
and counts the warnings `torch.cuda.set_sync_debug_mode("warn")` gives during the fourth backward and step. The CPU
test enforces the budget: two per backward, none per step; a count above it here is a bug to report.
"""

from __future__ import annotations

import sys
import warnings

import torch

import flashdp


def count(mode: str) -> tuple[int, int]:
    from tests.test_syncs import Wide

    torch.manual_seed(0)
    model = Wide().cuda()
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=torch.optim.SGD(model.parameters()),
        expected_batch_size=4, sample_rate=0.1,
    )  # fmt: skip
    ids = torch.randint(0, 50, (4, 6), device="cuda")
    for _ in range(3):
        engine.backward(model(ids))
        engine.step()
    loss = model(ids)
    counts = []
    for run in (lambda: engine.backward(loss), engine.step):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            run()
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "called a synchronizing" in str(w.message)]  # not the "prototype" notice
        for w in syncs:  # where each came from: the Python line that called the syncing operation
            print(f"  {mode}: {w.filename}:{w.lineno}: {str(w.message)[:120]}", file=sys.stderr)
        counts.append(len(syncs))
    return counts[0], counts[1]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/syncs.py needs a CUDA device; tests/test_syncs.py counts the same on the CPU.")
    print("| mode | syncs in a steady backward | syncs in a step |\n|---|---|---|")
    for mode in ("bk", "ghost", "flash"):
        backward, step = count(mode)
        print(f"| {mode} | {backward} | {step} |")


if __name__ == "__main__":
    main()
