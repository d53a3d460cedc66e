"""Ghost's and flash's second pass: the norm pass again, whose sums are taken from the gradients its norms were
measured from, and refused (nothing added, named at the next backward) where the backward gives other ones."""

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import flashdp
from flashdp import FlashDPError
from tests.conftest import requires_triton

TWO_PASSES = ["ghost", pytest.param("flash", marks=requires_triton)]


class HookedHead(nn.Module):
    """Two Linears; a hook on the output's gradient that, once `changing`, returns another gradient on each run of
    the backward over one graph (100 times the first, or a random scaling)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.kind, self.changing = nn.Linear(4, 4), nn.Linear(4, 1), kind, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x)))
        runs = [0]

        def hook(grad: torch.Tensor) -> torch.Tensor:
            runs[0] += 1
            if not self.changing or runs[0] == 1:
                return grad
            return 100 * grad if self.kind == "count" else grad * torch.randn_like(grad).exp()

        y.register_hook(hook)
        return y.sum((1, 2))


def _grad_norm(model: nn.Module) -> float:
    return float(torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None)))


@pytest.mark.parametrize("kind", ["count", "noise"])
@pytest.mark.parametrize("mode", TWO_PASSES)
def test_a_hook_returning_another_gradient_when_run_again_adds_nothing_and_is_named(mode, kind):
    """(A breaker's finding: a hook whose gradient changed on the second pass made one sample add 76 C in ghost and
    flash, bk 1 C.) The second pass's gradients are checked against the norm pass's fingerprints: where they
    differ, the parameters' sums are not added, and the next backward says so."""
    torch.manual_seed(0)
    model = HookedHead(kind)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, norm_strategy="ghost")
    only_first = torch.tensor([1.0, 1e-20, 1e-20])  # (sample 0's gradient; every sample reaches every layer)
    engine.backward(model(torch.randn(3, 2, 4)) * only_first)
    assert _grad_norm(model) <= 1.0 + 1e-5
    model.zero_grad()
    model.changing = True
    engine.backward(model(torch.randn(3, 2, 4)) * only_first)
    assert _grad_norm(model) <= 1.0 + 1e-5
    model.changing = False
    with pytest.raises(FlashDPError, match=r"second pass .* received other output gradients than its norm pass for"):
        engine.backward(model(torch.randn(3, 2, 4)) * only_first)


@pytest.mark.parametrize("end", ["with", "detach"])
@pytest.mark.parametrize("mode", TWO_PASSES)
def test_the_last_backwards_refused_sums_are_named_when_the_engine_is_detached(mode, end):
    """No backward follows a run's last one: its refused sums are named when the engine is detached (at the end of
    a `with` block, or by `detach()`), once the hooks are gone; an error already on its way out is left alone."""
    torch.manual_seed(0)
    model = HookedHead("count")
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, norm_strategy="ghost")
    refused = r"second pass .* received other output gradients than its norm pass for"
    engine.backward(model(torch.randn(3, 2, 4)))  # (the first backward's checks run the hook more than twice)
    model.changing = True
    with pytest.raises(FlashDPError, match=refused):
        if end == "detach":
            engine.backward(model(torch.randn(3, 2, 4)))
            engine.detach()
        else:
            with engine:
                engine.backward(model(torch.randn(3, 2, 4)))
    with pytest.raises(FlashDPError, match="This engine was detached"):
        engine.backward(model(torch.randn(3, 2, 4)))
    other = flashdp.make_private(HookedHead("count"), mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    other.backward(other.model(torch.randn(3, 2, 4)))
    other.model.changing = True
    with pytest.raises(KeyError), other:
        other.backward(other.model(torch.randn(3, 2, 4)))
        raise KeyError("the user's own error")


class WritesAGradWhenRunAgain(nn.Module):
    """A hook on an activation that, on the backward's second run over one graph, adds into a parameter's `.grad`."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        runs = [0]

        def hook(grad: torch.Tensor) -> None:
            runs[0] += 1
            if runs[0] == 2 and self.first.weight.grad is not None:
                self.first.weight.grad.add_(7.0)

        h.register_hook(hook)
        return self.last(h.tanh()).sum(1)


@pytest.mark.parametrize("mode", TWO_PASSES)
def test_a_grad_written_during_the_second_pass_is_refused(mode):
    """(The second pass was autograd's backward, watched for foreign `.grad` writes; the pass of flashdp's own sums
    must be watched too.) A write by anything but flashdp's sums is refused, naming the parameter."""
    torch.manual_seed(0)
    model = WritesAGradWhenRunAgain()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, norm_strategy="ghost")
    engine.backward(model(torch.randn(3, 3)))  # (an earlier micro-batch: the hook finds a .grad to add into)
    with pytest.raises(FlashDPError, match=r"wrote to the \.grad of 'first\.weight'"):
        engine.backward(model(torch.randn(3, 3)))


@pytest.mark.parametrize("mode", TWO_PASSES)
def test_a_hook_swapping_two_samples_gradients_when_run_again_adds_nothing_and_is_named(mode):
    """(A breaker's finding: the fingerprint was the sum and norm of each whole gradient, which a swap of two
    samples' rows keeps: ghost and flash added 2464 C to 7269 C for one sample, bk 1 C.) Fingerprints are taken
    row by row, along the batch."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    only_first = torch.tensor([1.0, 1e-20, 1e-20]) * 100

    def loss(swapping: bool) -> torch.Tensor:
        out, runs = model(torch.randn(3, 4) * 5), [0]

        def swap_on_the_second_run(grad: torch.Tensor) -> torch.Tensor:
            runs[0] += 1
            return grad[[1, 0, 2]] if swapping and runs[0] == 2 else grad

        out.register_hook(swap_on_the_second_run)
        return out.square().sum(1) * only_first

    engine.backward(loss(swapping=False))
    model.zero_grad()
    engine.backward(loss(swapping=True))
    assert _grad_norm(model) <= 1.0 + 1e-5
    with pytest.raises(FlashDPError, match=r"received other output gradients than its norm pass for '(weight|bias)'"):
        engine.backward(loss(swapping=False))


class CheckpointedDropout(nn.Module):
    """A Linear after a dropout, checkpointed without its random state: each pass recomputes another mask."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout, self.linear = nn.Dropout(0.0), nn.Linear(16, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = lambda x: self.linear(self.dropout(x))  # noqa: E731
        return checkpoint(block, x, use_reentrant=False, preserve_rng_state=False).square().sum(1)


@pytest.mark.parametrize("mode", TWO_PASSES)
def test_inputs_a_checkpoint_recomputes_otherwise_in_the_second_pass_add_nothing(mode):
    """(A breaker's finding: a checkpointed dropout without its random state drew another mask in the second pass:
    the norm from one input, the sum from another, 3.3 C, while the output gradients matched.) The inputs of calls
    a checkpoint recomputes are fingerprinted too."""
    torch.manual_seed(0)
    model = CheckpointedDropout()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    only_first, refused = torch.tensor([1.0, 1e-20, 1e-20]) * 100, 0
    engine.backward(model(torch.randn(3, 16)) * only_first)
    model.dropout.p = 0.5  # (after the first, checked, step)
    for _ in range(12):
        model.zero_grad()
        try:
            engine.backward(model(torch.randn(3, 16)) * only_first)
        except FlashDPError as error:
            assert "received other output gradients than its norm pass" in str(error)
            refused += 1
            continue
        assert _grad_norm(model) <= 1.0 + 1e-5
    assert refused


@pytest.mark.parametrize("mode", TWO_PASSES)
def test_a_swap_of_samples_in_a_time_major_attention_when_run_again_is_named(mode):
    """(A breaker's finding: attention's output is recorded through the `[L * B, E]` tensor it views, and its rows
    were fingerprinted along dim 1 of that, its features: a swap of two samples passed, 8-10 C per sample.) The
    gradients are fingerprinted in the output's own shape."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(4, 1)  # (time-major: [L, B, E])
    engine = flashdp.make_private(attention, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    weights = torch.randint(-3, 4, (4, 3, 4)).float()  # (integer coefficients: sums exact in any order)

    def loss(swapping: bool) -> torch.Tensor:
        x = torch.randn(4, 3, 4) * torch.tensor([100.0, 1.0, 1.0]).view(1, 3, 1)
        out = attention(x, x, x, need_weights=False)[0]
        _changed_on_the_second_run(
            out, lambda g: g.index_select(1, torch.tensor([1, 0, 2], device=g.device)) if swapping else g
        )
        return (out * weights).sum((0, 2)) * torch.tensor([1.0, 1e-20, 1e-20])

    _adds_at_most_c_and_is_named(engine, attention, loss)


@pytest.mark.parametrize(
    "first, second, inputs",
    [
        ([1.0, 5.0, 6.0], [2.0, 3.0, 7.0], [1.0, -5.0, 4.0]),  # the same sum and norm, other values: 15 C
        ([1e6, 0.0], [1e6, 0.03], [1e-7, 1e4]),  # a change below the float32 sum's rounding: 300 C
    ],
    ids=["same sum and norm", "below rounding"],
)
@pytest.mark.parametrize("mode", TWO_PASSES)
def test_a_row_whose_values_change_unseen_by_sums_when_run_again_adds_nothing(mode, first, second, inputs):
    """(A breaker's finding: rows were fingerprinted by the float32 sum and norm of their values, which other values
    can share, and a change below their rounding keeps: a sample added 15 C and 300 C.) The rows' bits are
    summed as integers, exactly."""
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    engine = flashdp.make_private(layer, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.tensor(inputs).view(1, -1, 1).repeat(3, 1, 1)

    def changed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, :, 0] = torch.tensor(second)
        return grad

    def loss(changing: bool) -> torch.Tensor:
        out = layer(x)
        _changed_on_the_second_run(out, changed if changing else lambda g: g)
        return (out[..., 0] * torch.tensor(first)).sum(1) * torch.tensor([1.0, 1e-20, 1e-20])

    _adds_at_most_c_and_is_named(engine, layer, loss)


def _changed_on_the_second_run(out: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A hook on `out`'s gradient that applies `change` the second time it runs (ghost's second pass)."""
    runs = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return change(grad) if runs[0] == 2 else grad

    out.register_hook(hook)


def _adds_at_most_c_and_is_named(engine, model: nn.Module, loss: Callable[[bool], torch.Tensor]) -> None:
    """A backward as recorded; one whose second pass changes (`loss(True)`), which adds at most C; the next names
    it."""
    engine.backward(loss(False))
    model.zero_grad()
    engine.backward(loss(True))
    assert _grad_norm(model) <= 1.0 + 1e-5
    with pytest.raises(FlashDPError, match="received other output gradients than its norm pass"):
        engine.backward(loss(False))


@pytest.mark.parametrize("dim", [0, 1])
def test_fingerprints_of_a_transposed_layout_tell_rows_apart_and_read_them_in_place(dim):
    """An output gradient stored transposed (a loss reading logits `[B, T, V]` through `.transpose(1, 2)` leaves
    theirs so) is fingerprinted row by row along its batch dim without being copied, and still tells a swap of two
    rows or one changed element apart."""
    from flashdp._pipeline.collector import _rows_in_memory_order, fingerprint

    grad = torch.randn(4, 6, 5).transpose(1, 2)  # [4, 5, 6], stored as [4, 6, 5]
    grad = grad if dim == 0 else grad.transpose(0, 1)  # the batch in dim 1: [5, 4, 6]
    assert _rows_in_memory_order(grad, dim).data_ptr() == grad.data_ptr() and not grad.is_contiguous()
    swapped = grad.index_select(dim, torch.tensor([1, 0, 2, 3]))
    changed = grad.clone()
    changed.select(dim, 2)[1, 1] += 1e-6
    found = fingerprint([(grad, dim)])
    assert torch.equal(found, fingerprint([(grad.clone(), dim)]))
    assert not torch.equal(found, fingerprint([(swapped, dim)]))
    assert not torch.equal(found, fingerprint([(changed, dim)]))


class _NoneWhenRunAgain(torch.autograd.Function):
    """The identity; its backward returns None from its second run on (`runs`: a one-element counter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, runs: list) -> torch.Tensor:
        ctx.runs = runs
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        ctx.runs[0] += 1
        return (grad if ctx.runs[0] == 1 else None), None


@pytest.mark.parametrize("mode", TWO_PASSES)
def test_a_call_the_second_pass_does_not_reach_adds_nothing_and_is_named(mode):
    """(A breaker's finding: a layer called twice on one input, once through a Function whose backward returns None
    when run again: its per-sample gradients cancel, norm 0, but the second pass received only the other call's
    part, which nothing fingerprinted as missing: one sample moved the sum by 239 C.) A call the norm pass
    fingerprinted and the second pass did not reach leaves its parameters' sums out, and is named."""
    torch.manual_seed(0)
    layer, other = nn.Linear(3, 2).double(), nn.Linear(3, 1).double()
    model = nn.ModuleList([layer, other])
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)

    def loss(cutting: bool) -> torch.Tensor:
        x = torch.randn(4, 3, dtype=torch.float64) * 100
        runs = [0 if cutting else -(10**9)]
        cancelled = (layer(x) - _NoneWhenRunAgain.apply(layer(x), runs)).sum(1)
        only_first = torch.tensor([1.0, 1e-20, 1e-20, 1e-20], dtype=torch.float64)
        return (cancelled + other(torch.tanh(x))[:, 0]) * only_first

    _adds_at_most_c_and_is_named(engine, model, loss)
    assert layer.weight.grad is None or float(layer.weight.grad.norm()) == 0.0
