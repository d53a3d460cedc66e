"""Host time flashdp adds per recorded layer call: a deep model of tiny layers, where compute is nothing.

    python benchmarks/host_overhead.py            # median step times and microseconds per call
    python benchmarks/host_overhead.py --profile  # where a bk step's host time goes (cProfile)
    python benchmarks/host_overhead.py --device cuda   # on a GPU: each step ends with a synchronisation
    python benchmarks/host_overhead.py --trees <before> .   # bk and ghost of several source trees in one process
    python benchmarks/host_overhead.py --ops      # torch ops per recorded call (each a kernel launch on a GPU)

64 blocks of LayerNorm(8) + Linear(8, 8), B=4, T=8, one thread: 128 recorded calls a step. The modes run in
interleaved rounds (non-private, hooks floor, bk, ghost); reported, the median step time of each and
`(step - non-private step) / 128` in microseconds. "hooks floor" is the least any design with a Python hook per
layer call costs: a forward hook keeps each input, a tensor hook each output gradient, then per-sample gradients,
norms, clipped sums and noise in a few torch ops per layer, none of flashdp's checks (the same norms for this model,
nothing else: not a DP implementation). On a GPU a step of a large model launches its kernels
asynchronously, so this host time is what the GPU waits for when it exceeds the kernels' time (Llama-3-8B at T=512 on
an H100: about 0.1 ms of kernels per recorded call).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import flashdp

BLOCKS, BATCH, LENGTH, WIDTH = 64, 4, 8, 8
CALLS = 2 * BLOCKS
MODES = ("non-private", "hooks floor", "bk", "ghost")


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(BLOCKS) for layer in (nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))])


def make_step(mode: str, device: str = "cpu", library: ModuleType = flashdp):
    """A step of `mode` on a fresh model; `library`: the flashdp module to train with (another tree's)."""
    model, x = build().to(device), torch.randn(BATCH, LENGTH, WIDTH, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "hooks floor":
        return hooks_floor_step(model, x, optimizer)
    if mode == "non-private":

        def step() -> None:
            model(x).square().mean((1, 2)).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    engine = library.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=BATCH,
        sample_rate=0.01, seed=0,
    )  # fmt: skip

    def step() -> None:
        engine.backward(model(x).square().mean((1, 2)))
        engine.step()

    return step


def hooks_floor_step(model: nn.Sequential, x: torch.Tensor, optimizer: torch.optim.Optimizer):
    """A step of the least per-call work: each layer's input kept by a forward hook, its output gradient `[B, T, d]`
    by a tensor hook; per-sample gradients `[B, ...]`, their norms, the clipped sums and the noise after the
    backward (which computes input gradients only, as flashdp's norm pass does)."""
    kept: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: kept.append((module, args[0], grad)))

    for layer in model:
        layer.register_forward_hook(keep)
    x = x.clone().requires_grad_()

    def per_sample(module: nn.Module, inputs: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        if isinstance(module, nn.Linear):
            return [torch.bmm(grad.transpose(1, 2), inputs), grad.sum(1)]
        normalised = F.layer_norm(inputs, module.normalized_shape, eps=module.eps)
        return [(grad * normalised).sum(1), grad.sum(1)]

    def step() -> None:
        kept.clear()
        torch.autograd.grad(model(x).square().mean((1, 2)).sum(), x)
        with torch.no_grad():
            grads = [(module, per_sample(module, inputs, grad)) for module, inputs, grad in kept]
            norm_sq = sum(g.flatten(1).square().sum(1) for _, pair in grads for g in pair)
            coef = (1.0 / norm_sq.sqrt().clamp_min(1e-6)).clamp(max=1.0)
            for module, (weight, bias) in grads:
                module.weight.grad = torch.einsum("b,b...->...", coef, weight)
                module.bias.grad = coef @ bias
            for param in model.parameters():
                param.grad.add_(torch.randn_like(param))
        optimizer.step()
        optimizer.zero_grad()

    return step


def measure(steps: dict[str, Callable[[], None]], rounds: int, device: str) -> dict[str, float]:
    """Median milliseconds per step of each, in interleaved rounds."""
    for step in steps.values():
        for _ in range(3):  # the first step verifies and self-checks
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def trees_steps(trees: list[str], device: str) -> dict[str, Callable[[], None]]:
    """bk and ghost steps of each tree's flashdp (its `src` imported in turn), with this one's non-private step and
    hooks floor: one process, so that the trees share the machine's state at every round."""
    steps = {mode: make_step(mode, device) for mode in ("non-private", "hooks floor")}
    for tree in trees:
        for name in [m for m in sys.modules if m == "flashdp" or m.startswith("flashdp.")]:
            del sys.modules[name]
        sys.path.insert(0, str(Path(tree).resolve() / "src"))
        library = importlib.import_module("flashdp")
        sys.path.pop(0)
        steps |= {f"{mode} ({tree})": make_step(mode, device, library) for mode in ("bk", "ghost")}
    return steps


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.all = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.all += 1
        self.kernels += not func.is_view  # (a view launches nothing on a GPU)
        return func(*args, **(kwargs or {}))


def ops_per_call(device: str) -> None:
    print("| mode | torch ops per recorded call | of which not views |\n|---|---|---|")
    for mode in MODES:
        step = make_step(mode, device)
        for _ in range(3):
            step()
        with _Ops() as ops:
            step()
        print(f"| {mode} | {ops.all / CALLS:.1f} | {ops.kernels / CALLS:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--trees", nargs="+", help="source trees whose bk and ghost are timed side by side")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # (fixed batches: not Poisson-sampled)
    if args.ops:
        return ops_per_call(args.device)
    if args.profile:
        step = make_step("bk", args.device)
        for _ in range(3):
            step()
        profile = cProfile.Profile()
        profile.runcall(lambda: [step() for _ in range(10)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        return
    steps = trees_steps(args.trees, args.device) if args.trees else {m: make_step(m, args.device) for m in MODES}
    ms = measure(steps, args.rounds, args.device)
    print("| mode | step time (ms) | host time per recorded call over non-private (us) |\n|---|---|---|")
    for name, step_ms in ms.items():
        print(f"| {name} | {step_ms:.1f} | {(step_ms - ms['non-private']) / CALLS * 1e3:.0f} |")


if __name__ == "__main__":
    main()
