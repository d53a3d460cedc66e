"""The streamed norm pass (each output gradient handed to its rule as autograd computes it, then freed) gives the
same results, bit for bit in float64, as the held pass that takes every output gradient at once (which the oracle
tests check); and it does free them."""

import gc
import weakref

import pytest
import torch
from torch import nn

import flashdp
from flashdp._pipeline import norm_pass
from tests.conftest import MODES
from tests.hf.zoo import CASES, PEFT_CASES, B

ALL = CASES | {f"peft_{name}": case for name, case in PEFT_CASES.items()}
#: one rule site call at the bottom of the graph, asked of autograd: prompt tuning trains its prompt embedding only
NOTHING_TO_STREAM = {"peft_prompt_tuning"}


def _backward(engine, model, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    norms = engine.backward(loss_of())
    return norms, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def handovers(monkeypatch) -> list[int]:
    """The call indices handed over by a node pre-hook during the pass (streamed, not asked of autograd)."""
    seen: list[int] = []
    original = norm_pass._Handover.__call__

    def counting(self, grad_outputs):
        seen.extend(index for _, index in self.slots)
        return original(self, grad_outputs)

    monkeypatch.setattr(norm_pass._Handover, "__call__", counting)
    return seen


@pytest.fixture
def deterministic():
    """Deterministic kernels: on CUDA an embedding's backward adds its rows with atomics, in another order on each
    pass (the bit-for-bit comparison would be of that order, not of the two passes)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ALL))
def test_streamed_pass_equals_the_held_pass_bit_for_bit(name, mode, handovers, deterministic):
    """The first backward of a forward structure holds every output gradient (it verifies batch independence);
    the next ones stream (the third at the latest: the first may move parameters to the generic rule, which makes
    a new structure). Same norms, same gradients, same strategies."""
    case = ALL[name]()
    model = case.build().to(case.dtype).eval()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1e-2, noise_multiplier=1.0, self_check=None)
    loss_of = lambda: case.loss(model, slice(0, B))  # noqa: E731
    held_norms, held_grads = _backward(engine, model, loss_of)
    held_strategies = engine.strategies
    _backward(engine, model, loss_of)
    handovers.clear()  # (a verification pass streams too)
    streamed_norms, streamed_grads = _backward(engine, model, loss_of)
    assert bool(handovers) == (name not in NOTHING_TO_STREAM)
    assert engine.strategies == held_strategies
    assert torch.equal(streamed_norms, held_norms)
    assert streamed_grads.keys() == held_grads.keys()
    for n, g in held_grads.items():
        assert torch.equal(streamed_grads[n], g), n


class Deep(nn.Module):
    def __init__(self, width: int = 16, depth: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_each_output_gradient_is_freed_before_the_next_layer_is_reached(mode, monkeypatch):
    """When the norm pass (and ghost's second pass) reaches a layer, the output gradients of the layers above it
    are gone (a held pass keeps all eight until the end)."""
    model = Deep().double()
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, self_check=None)
    alive_at_receive: list[int] = []
    grads: list[weakref.ref] = []
    original = flashdp._pipeline.collector.NormCollector.receive

    def watching(self, index, call_grads):
        gc.collect()
        alive_at_receive.append(sum(r() is not None for r in grads))
        grads.extend(weakref.ref(g) for g in call_grads if g is not None)
        original(self, index, call_grads)

    monkeypatch.setattr(flashdp._pipeline.collector.NormCollector, "receive", watching)
    for _ in range(2):
        alive_at_receive.clear()
        engine.backward(model(x).square().sum((1, 2)))
    held, streamed = [], alive_at_receive  # the second backward streamed
    assert len(streamed) == 8 * (2 if mode == "ghost" else 1)
    assert max(streamed) <= 1, streamed
    del held
