"""Regression tests (float64 oracle, over sequences of steps, self_check=None): what a parameter's uses are is
decided on every backward, not once per forward structure; a layer calling itself, a parameter read past the
generic rule's swap, and an output shared across the batch that feeds another output of the same call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.steps import check_steps

MODES = ["bk", "ghost"]
DOUBLE = torch.float64


def _rows(batch, i):
    x, flag = batch
    return x[i : i + 1], flag


def _loss(model, batch):
    x, flag = batch
    return model(x, flag).square().flatten(1).sum(1)


def _batches(flags, batch=3, shape=(4, 3)):
    return [(torch.randn(batch, *shape, dtype=DOUBLE), flag) for flag in flags]


# --- coverage on every backward ---------------------------------------------------------------------------------


class SometimesOutside(nn.Module):
    """lin.weight also used outside lin on some steps only: the same layers called, with the same sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.q = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x, outside):
        h = torch.tanh(self.lin(x))
        if outside:
            h = h + F.linear(x, self.lin.weight)
        return self.q(h)


class SometimesOutsideBelow(nn.Module):
    """The outside use below the layer: it feeds the layer's own input (the walk leaves lin at its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.q = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x, outside):
        if outside:
            x = x + 0.5 * F.linear(x, self.lin.weight).tanh()
        return self.q(torch.tanh(self.lin(x)))


class MovedOutside(nn.Module):
    """lin2 shares lin1's weight. On some steps lin2's own output is left unused and its parameters are used
    outside it instead: the weight has two uses in the loss's graph on every step, the calls and sizes are the
    same, only where one use lies changes (a count of each parameter's uses would not see it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.q = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)
        self.lin2.weight = self.lin1.weight

    def forward(self, x, outside):
        a = self.lin1(x)
        b = self.lin2(x)
        if outside:
            b = F.linear(x, self.lin2.weight, self.lin2.bias)
        return self.q(torch.tanh(a) * b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", [SometimesOutside, SometimesOutsideBelow, MovedOutside])
@pytest.mark.parametrize("flags", [(False, True, True, False), (True, False, True)])
def test_a_use_outside_the_layer_on_some_steps_is_counted_on_every_step(model_type, flags, mode):
    torch.manual_seed(0)
    model = model_type().double()
    check_steps(model, _batches(flags), _loss, _rows, [3] * len(flags), mode=mode, max_grad_norm=1e6)


def test_a_use_outside_the_model_on_a_later_step_is_refused_on_that_step():
    """A use outside every recorded call, from the second step on: refused there (nothing could count it), not
    counted as if the structure verified on the first step still described it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(3, 4, 3, dtype=DOUBLE)

    def loss(outside):
        out = model(x)
        if outside:
            out = out + F.linear(x, model[0].weight)[..., :2]
        return out.square().flatten(1).sum(1)

    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    try:
        engine.backward(loss(False))
        model.zero_grad()
        with pytest.raises(FlashDPError, match=r"'0\.weight' reaches the loss through"):
            engine.backward(loss(True))
    finally:
        engine.detach()


class LeaksOtherOutput(nn.Module):
    """A generic layer returning one output of a node (`chunk`) and leaking the node's other output, which its
    parent uses: a path entering the node through that other output is not inside the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 6) / 2)

    def forward(self, x):
        a, b = (x @ self.w).chunk(2, -1)
        self.leaked = b
        return a


class UsesLeak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split, self.q = LeaksOtherOutput(), nn.Linear(3, 2)

    def forward(self, x, flag):
        h = self.split(x)
        return self.q(h + self.split.leaked.square() if flag else h)


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_leaked_through_another_output_of_a_layers_node_is_counted(mode):
    torch.manual_seed(0)
    flags = (False, True, True)
    check_steps(UsesLeak().double(), _batches(flags), _loss, _rows, [3] * 3, mode=mode, max_grad_norm=1e6)


# --- recursion --------------------------------------------------------------------------------------------------


class Recursive(nn.Module):
    """A layer without a rule calling itself: its generic rule re-runs the outer call, the inner one included."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3) / 2)

    def forward(self, x, depth=1):
        h = torch.tanh(x @ self.w)
        return self(h, depth - 1) * 1.0 if depth else h


class Reused(nn.Module):
    """The same layer without a rule called twice in a row by its parent (not nested)."""

    def __init__(self, recursive: bool) -> None:
        super().__init__()
        self.r, self.q, self.recursive = Recursive(), nn.Linear(3, 2), recursive

    def forward(self, x, flag):
        if self.recursive:
            return self.q(self.r(x))
        return self.q(self.r(self.r(x, 0), 0))


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_calling_itself_is_refused_on_every_step(mode):
    torch.manual_seed(0)
    _refused_on_every_step(Reused(recursive=True).double(), mode, "called inside its own forward")


def _refused_on_every_step(model: nn.Module, mode: str, message: str) -> None:
    """Two steps, each refused with `message` before anything reaches `.grad`."""
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    try:
        for batch in _batches([False, False]):
            model.zero_grad(set_to_none=True)
            with pytest.raises(FlashDPError, match=message):
                engine.backward(_loss(model, batch))
            assert all(p.grad is None for p in model.parameters())
    finally:
        engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_called_twice_in_a_row_is_exact(mode):
    torch.manual_seed(0)
    flags = (False, False, False)
    check_steps(Reused(recursive=False).double(), _batches(flags), _loss, _rows, [3] * 3, mode=mode)


# --- parameters read past the generic rule's swap ---------------------------------------------------------------


class ReturnsAlias(nn.Module):
    """Reads its parameter through a plain list: functional_call's swap does not reach it. `product` multiplies
    the batch by it (a matrix product: the generic rule's re-run counts it), else it is added to the batch (counted
    where it meets the batch, from autograd's own graph: no re-run, no swap)."""

    def __init__(self, product: bool = True) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 3) if product else torch.randn(4, 3))
        self.alias, self.product = [self.p], product

    def forward(self, x):
        return x @ self.alias[0] if self.product else x + self.alias[0]


class ReadsThroughClosure(nn.Module):
    """`ReturnsAlias`, the parameter read in a closure; its broadcast use scales the batch elementwise."""

    def __init__(self, product: bool = True) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 3) if product else torch.randn(4, 3))
        p = self.p
        self.scale = (lambda x: torch.tanh(x) @ p) if product else (lambda x: torch.tanh(x) * p)

    def forward(self, x):
        return self.scale(x)


class ReadsItsAttribute(nn.Module):
    """The control: reads its parameter from the module (swapped), also returning it."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.tanh(x) * self.p


class WithTable(nn.Module):
    def __init__(self, table_type, **options) -> None:
        super().__init__()
        self.t, self.q = table_type(**options), nn.Linear(3, 2)

    def forward(self, x, flag):
        return self.q(torch.tanh(self.t(x)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("table_type", [ReturnsAlias, ReadsThroughClosure])
def test_a_parameter_read_past_the_generic_rules_swap_is_refused(table_type, mode):
    torch.manual_seed(0)
    _refused_on_every_step(WithTable(table_type).double(), mode, "read 'p' without the swap")


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_read_past_the_swap_that_meets_the_batch_by_broadcast_is_exact(mode):
    """(Not the closure: the oracle's deep copy of the model would read the original's parameter. After a Linear:
    added to the raw data, which autograd does not track, it is left to the generic rule.)"""
    torch.manual_seed(0)
    flags = (False, False)
    model = WithTable(ReturnsAlias, product=False).double()
    model.t = nn.Sequential(nn.Linear(3, 3), model.t).double()
    check_steps(model, _batches(flags), _loss, _rows, [3, 3], mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_read_from_the_module_is_exact(mode):
    torch.manual_seed(0)
    flags = (False, False)
    check_steps(WithTable(ReadsItsAttribute).double(), _batches(flags), _loss, _rows, [3, 3], mode=mode)


# --- an output shared across the batch feeding another output of the same call ---------------------------------


class _Table(nn.Module):
    """A module holding a [4, 3] table, which its forward returns or uses in shared outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 3))


class SharedFeedsOutput(_Table):
    """Returns (b, h): b = table * 1.0 has no batch dim (shared), h = tanh(x + b) is computed from it."""

    def forward(self, x):
        b = self.table * 1.0
        return b, torch.tanh(x + b)


class ParamFeedsOutput(_Table):
    """Returns (table, h) with h computed from the table: the shared output is the parameter itself."""

    def forward(self, x):
        return self.table, torch.tanh(x) * self.table


class TwoSharedOutputs(_Table):
    """Returns (b, b2, h): two shared outputs, b2 computed from b, h from both."""

    def forward(self, x):
        b = self.table * 1.0
        b2 = (2.0 * b).sin()
        return b, b2, torch.tanh(x + b) * b2


class UsesShared(nn.Module):
    """Uses the shared outputs outside the call too (flag: b only inside, on steps where it is True)."""

    def __init__(self, table_type) -> None:
        super().__init__()
        self.t, self.q = table_type(), nn.Linear(3, 2)

    def forward(self, x, inside_only):
        *shared, h = self.t(x)
        out = torch.tanh(h)
        for k, b in enumerate(shared):
            if not (inside_only and k == 0):
                out = out * b + b.cos()
        return self.q(out)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("table_type", [SharedFeedsOutput, ParamFeedsOutput, TwoSharedOutputs])
def test_a_shared_output_feeding_another_output_of_its_call_is_counted_once(table_type, mode):
    torch.manual_seed(0)
    flags = (False, True, False)
    check_steps(UsesShared(table_type).double(), _batches(flags), _loss, _rows, [3] * 3, mode=mode, max_grad_norm=1e6)
