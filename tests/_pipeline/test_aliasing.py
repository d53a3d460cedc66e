"""A module returning its own parameter (a learned positional table, `return self.p`), called a varying number of
times per forward: the gradient at a returned parameter is its gradient accumulator, one autograd edge for every
call that returns it, which sums every use of the parameter. Handed to each call, it was counted once per call
(2x on a step with two calls, silently where no self-check ran). Every step is checked against per-sample gradients
taken one sample at a time in float64 (`tests.steps.check_steps`), or refused where it cannot be exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.steps import check_steps

MODES = ["bk", "ghost"]


class Table(nn.Module):
    """A learned positional table, returned whole: the tensor itself, a reshape of it, or a new tensor."""

    def __init__(self, how: str = "itself") -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 3))
        self.how = how

    def forward(self, x=None):
        if x is not None:  # a call that uses the table inside its own forward
            return torch.tanh(x) * self.p
        if self.how == "itself":
            return self.p
        if self.how == "view":
            return self.p.view(4, 3)
        if self.how == "unsqueeze":
            return self.p.unsqueeze(0)
        return self.p.clone()


class Net(nn.Module):
    def __init__(self, how: str = "itself") -> None:
        super().__init__()
        self.pos = Table(how)
        self.q = nn.Linear(3, 2)

    def forward(self, x, calls):  # x [B, 4, 3]; calls: how often the table is looked up
        h = x + self.pos()
        for _ in range(calls - 1):
            h = torch.tanh(h) * self.pos()
        return self.q(torch.tanh(h))


def _loss(model, batch):
    x, calls = batch
    out = model(x, calls)
    return (out.tanh() + out).square().flatten(1).sum(1)


def _sample(batch, i):
    x, calls = batch
    return x[i : i + 1], calls


def _batches(calls_per_step, size=3):
    return [(torch.randn(size, 4, 3, dtype=torch.float64), calls) for calls in calls_per_step], [size] * len(
        calls_per_step
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("self_check", [None, 1])
@pytest.mark.parametrize("how", ["itself", "view", "unsqueeze", "clone"])
@pytest.mark.parametrize("calls", [[1, 2, 2, 1], [2, 2, 3], [3, 1, 2]], ids=["once-first", "twice-first", "thrice"])
def test_a_module_returning_its_parameter_is_exact_on_every_step_however_often_it_is_called(
    calls, how, self_check, mode
):
    torch.manual_seed(0)
    model = Net(how).double()
    batches, sizes = _batches(calls)
    check_steps(model, batches, _loss, _sample, sizes, mode=mode, self_check=self_check, max_grad_norm=1e3)


def test_a_batch_of_one_then_larger_batches_with_more_calls_is_exact():
    torch.manual_seed(0)
    model = Net().double()
    batches = [(torch.randn(b, 4, 3, dtype=torch.float64), c) for b, c in [(1, 2), (3, 1), (2, 3), (4, 2)]]
    check_steps(model, batches, _loss, _sample, [1, 3, 2, 4], max_grad_norm=0.5)


class TwoViews(nn.Module):
    """One call returning a tensor and a reshape of it: two outputs, one gradient edge (the reshape's base)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        h = x @ self.w
        return h, h.reshape(h.shape[0], -1)


class TwoViewsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = TwoViews()
        self.q = nn.Linear(12, 2)

    def forward(self, x, calls=1):
        a, b = self.t(x)
        return self.q(torch.tanh(b) + a.reshape(a.shape[0], -1).square())


@pytest.mark.parametrize("mode", MODES)
def test_one_call_returning_a_tensor_and_a_reshape_of_it_is_exact(mode):
    torch.manual_seed(0)
    model = TwoViewsNet().double()
    batches, sizes = _batches([1, 1, 1])
    check_steps(model, batches, _loss, _sample, sizes, mode=mode, max_grad_norm=1e3)


class TiedTables(nn.Module):
    """Two modules holding one (tied) table, each returning it: every call's output is the same gradient edge."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Table(), Table()
        self.b.p = self.a.p
        self.q = nn.Linear(3, 2)

    def forward(self, x, calls=1):
        return self.q(torch.tanh((x + self.a()) * self.b()))


@pytest.mark.parametrize("mode", MODES)
def test_tied_tables_each_returning_the_parameter_are_exact(mode):
    torch.manual_seed(0)
    model = TiedTables().double()
    batches, sizes = _batches([1, 1, 1])
    check_steps(model, batches, _loss, _sample, sizes, mode=mode, max_grad_norm=1e3)


class Gate(nn.Module):
    """Scales its input on some calls, returns it as is on others (a module passing a tensor through)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(3))

    def forward(self, x, on):
        return x * self.g if on else x


class GateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.q = nn.Linear(3, 2)

    def forward(self, x, calls):
        h = self.gate(x, True)
        for _ in range(calls - 1):  # each later call returns its input, the earlier call's output, as is
            h = self.gate(h, False)
        return self.q(torch.tanh(h))


@pytest.mark.parametrize("mode", MODES)
def test_a_module_returning_its_input_as_is_on_later_calls_is_exact(mode):
    torch.manual_seed(0)
    model = GateNet().double()
    batches, sizes = _batches([1, 2, 3, 1])
    check_steps(model, batches, _loss, _sample, sizes, mode=mode, max_grad_norm=1e3)


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3) / 2)

    def forward(self, x, depth):
        h = torch.tanh(x @ self.w)
        return self(h, depth - 1) if depth else h  # the enclosing call returns its child's output as is


class RecursiveNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.r = Recursive()
        self.q = nn.Linear(3, 2)

    def forward(self, x, nested):
        return self.q(self.r(x, 1 if nested else 0))


class UsedInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Table()
        self.q = nn.Linear(3, 2)

    def forward(self, x, inside):
        h = x + self.pos()
        if inside:  # another call of the table's module uses the table inside its own forward
            h = self.pos(h)
        return self.q(torch.tanh(h))


class Cached(nn.Module):
    """Computes its table on the first call of a forward and returns the same tensor on the next ones."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 3))
        self.cached = None

    def forward(self, fresh):
        if fresh:
            self.cached = torch.tanh(self.p * 2.0)
        return self.cached


class CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Cached()
        self.q = nn.Linear(3, 2)

    def forward(self, x, again):
        h = x + self.pos(True)
        if again:
            h = torch.tanh(h) * self.pos(False)
        return self.q(torch.tanh(h))


@pytest.mark.parametrize("self_check", [None, 1])
@pytest.mark.parametrize(
    ("model_of", "match"),
    [
        (UsedInside, "returns its parameter 'pos.p' itself"),
        (CachedNet, "returns the same tensor on two calls"),
        (RecursiveNet, "returns the same tensor on two calls"),
    ],
    ids=["returned-and-used-inside-another-call", "cached", "nested-call-returning-its-child's-output"],
)
def test_a_gradient_edge_that_would_be_counted_twice_is_refused_on_the_step_it_appears(model_of, match, self_check):
    """Exact while the pattern is absent; refused, with nothing added to .grad, on every step it is present."""
    torch.manual_seed(0)
    model = model_of().double()
    reference = copy.deepcopy(model)  # (no optimizer step: the parameters stay)
    engine = flashdp.make_private(model, max_grad_norm=1e3, noise_multiplier=0.0, self_check=self_check)
    try:
        for step, present in enumerate([False, True, False, True]):
            x = torch.randn(3, 4, 3, dtype=torch.float64)
            model.zero_grad(set_to_none=True)
            if present:
                with pytest.raises(FlashDPError, match=match):
                    engine.backward(_loss(model, (x, present)))
                assert all(p.grad is None for p in model.parameters()), f"step {step}"
            else:
                norms = engine.backward(_loss(model, (x, present)))
                expected = torch.stack(
                    [
                        torch.cat([g.flatten() for g in torch.autograd.grad(
                            _loss(reference, (x[i : i + 1], present))[0], list(reference.parameters())
                        )]).norm()
                        for i in range(3)
                    ]
                )  # fmt: skip
                torch.testing.assert_close(norms.double(), expected, rtol=1e-5, atol=1e-6)
    finally:
        engine.detach()


def test_the_self_check_agrees_with_one_call_then_two():
    """The step that calls the table twice is neither refused by the self-check nor counted twice."""
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    engine = flashdp.make_private(model, max_grad_norm=1e3, noise_multiplier=0.0, self_check=1)
    try:
        for calls in (1, 2, 2):
            x = torch.randn(3, 4, 3, dtype=torch.float64)
            model.zero_grad(set_to_none=True)
            engine.backward(_loss(model, (x, calls)))
            expected = sum(
                torch.autograd.grad(_loss(reference, (x[i : i + 1], calls))[0], reference.pos.p)[0] for i in range(3)
            )
            torch.testing.assert_close(model.pos.p.grad, expected, rtol=1e-7, atol=1e-9)
    finally:
        engine.detach()


def test_a_cross_entropy_loss_as_in_the_report():
    """The reported model: the table called once on step 0, twice after; cross-entropy per sample."""
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    engine = flashdp.make_private(model, max_grad_norm=1e3, noise_multiplier=0.0, self_check=None)
    try:
        for calls in (1, 2, 2):
            x, y = torch.randn(3, 4, 3, dtype=torch.float64), torch.randint(0, 2, (3,))
            model.zero_grad(set_to_none=True)
            norms = engine.backward(F.cross_entropy(model(x, calls).sum(1), y, reduction="none"))
            per_sample = [
                torch.autograd.grad(
                    F.cross_entropy(reference(x[i : i + 1], calls).sum(1), y[i : i + 1]), list(reference.parameters())
                )
                for i in range(3)
            ]
            expected = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per_sample])
            torch.testing.assert_close(norms.double(), expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(model.pos.p.grad, sum(gs[0] for gs in per_sample), rtol=1e-7, atol=1e-9)
    finally:
        engine.detach()
