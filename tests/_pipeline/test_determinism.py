"""Ghost's and flash's two backwards run under torch's deterministic kernels where kernels may differ between runs
(CUDA): on an H100, cuDNN's convolutions and the atomics of flash attention and index_add_ made the second pass's
gradients differ from the norm pass's, and every CNN's sums were refused. On the CPU the device check is forced."""

import os

import pytest
import torch
from torch import nn
from torch._prims_common import alert_not_deterministic

import flashdp
from flashdp import FlashDPError
from flashdp._pipeline import determinism
from tests.conftest import requires_triton

MODES = ["bk", "ghost", pytest.param("flash", marks=requires_triton)]


@pytest.fixture
def kernels_may_differ(monkeypatch):
    monkeypatch.setattr(determinism, "needs_identical_passes", lambda device: True)


class Recording(nn.Module):
    """Two Linears; records, on every backward through them, whether deterministic kernels were asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.seen = nn.Linear(3, 4), nn.Linear(4, 1), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: self.seen.append(torch.are_deterministic_algorithms_enabled()))
        return self.b(torch.tanh(h))[:, 0]


def _user_settings() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


@pytest.mark.parametrize("mode", MODES)
def test_two_passes_run_under_deterministic_kernels_and_the_users_settings_come_back(mode, kernels_may_differ):
    model = Recording()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    before = _user_settings()
    for batch in (4, 3):
        engine.backward(model(torch.randn(batch, 3)))
        assert _user_settings() == before
    assert model.seen, "the hook ran"
    assert all(model.seen) == (mode != "bk") and any(model.seen) == (mode != "bk"), model.seen


def test_a_users_warn_only_deterministic_mode_is_restored(kernels_may_differ):
    model = Recording()
    engine = flashdp.make_private(model, mode="ghost", max_grad_norm=1.0, noise_multiplier=0.0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        engine.backward(model(torch.randn(4, 3)))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class NoDeterministicBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        alert_not_deterministic("a_custom_scatter_backward")
        return grad


def test_a_backward_without_a_deterministic_kernel_is_refused_naming_it_and_bk(kernels_may_differ):
    layer = nn.Linear(3, 1)
    engine = flashdp.make_private(layer, mode="ghost", max_grad_norm=1.0, noise_multiplier=0.0)
    before = _user_settings()
    with pytest.raises(FlashDPError, match=r"a_custom_scatter_backward.*mode='bk'"):
        engine.backward(NoDeterministicBackward.apply(layer(torch.randn(4, 3)))[:, 0])
    assert _user_settings() == before
    assert all(p.grad is None for p in layer.parameters())
