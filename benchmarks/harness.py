"""One training step per mode, built the same way for every library, so that modes are timed side by side.

`make_step(model_name, mode, seq, batch)` returns a zero-argument callable doing forward, per-sample loss,
backward and optimizer step (with noise for the DP modes) on fixed data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import flashdp
from benchmarks.models import LlamaLike, SmallCNN

MODES = ("non-private", "flashdp-bk", "flashdp-ghost", "flashdp-flash", "opacus-ghost", "opacus-hooks")
VOCAB = 4096


def unavailable(mode: str) -> str | None:
    """Why a mode cannot run on this machine, or None."""
    if mode == "flashdp-flash" and not torch.cuda.is_available():
        return "flash needs a GPU (on CPU its kernels run only in Triton's interpreter, a correctness tool)"
    if mode.startswith("opacus"):
        try:
            import opacus  # noqa: F401
        except ImportError:
            return "opacus is not installed (pip install opacus)"
    return None


def data(model_name: str, seq: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    if model_name == "llama":
        ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator)
        return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)  # Opacus views the ids
    images = torch.randn(batch, 3, seq, seq, generator=generator)
    return images.to(device), torch.randint(0, 10, (batch,), generator=generator).to(device)


def build_model(model_name: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return (LlamaLike() if model_name == "llama" else SmallCNN()).to(device)


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B]: mean cross entropy over each sequence's tokens (or the one label of an image)."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
    return F.cross_entropy(logits, targets, reduction="none")


def make_step(model_name: str, mode: str, seq: int, batch: int, device: str = "cpu") -> Callable[[], None]:
    model = build_model(model_name, device)
    x, y = data(model_name, seq, batch, device)
    if mode.startswith("opacus"):
        return _opacus_step(model, mode, x, y, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "non-private":

        def step() -> None:
            per_sample_loss(model(x), y).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    engine = flashdp.make_private(
        model, mode=mode.removeprefix("flashdp-"), max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer,
        expected_batch_size=batch, sample_rate=0.01,
    )  # fmt: skip

    def dp_step() -> None:
        engine.backward(per_sample_loss(model(x), y))
        engine.step()

    return dp_step


def _opacus_step(model, mode, x, y, batch) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "expected_batch_size": batch, "loss_reduction": "mean"}
    if mode == "opacus-hooks":
        module = GradSampleModule(model, loss_reduction="mean")
        optimizer = DPOptimizer(sgd, **dp)

        def hooks_step() -> None:
            per_sample_loss(module(x), y).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return hooks_step
    module = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(sgd, **dp)
    criterion = DPLossFastGradientClipping(module, optimizer, torch.nn.CrossEntropyLoss(reduction="mean"))

    def ghost_step() -> None:
        logits = module(x)
        if logits.dim() == 3:
            loss = criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape[:2])
        else:
            loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return ghost_step
