"""The self-check fires on planted bugs that no rule can see, at the documented schedule, and can be turned off.
(It runs by default in every oracle test of the suite, where it must stay silent on correct models.)"""

from unittest import mock

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError
from flashdp._pipeline import blocks
from tests.oracle import check_against_oracle
from tests.strategies import per_sample_loss

NOT_SEPARABLE = "Self-check failed: the gradient of these layers' outputs is not separable by sample"
DIFFERS = r"Self-check failed for sample \d+: what flashdp counted differs from autograd's"


def _engine(model, **kwargs):
    return flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0, **kwargs)


class Affine(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_rule_that_drops_a_parameter_is_caught(mode):
    class Dropping(Affine):
        pass

    def drops_bias(module, inputs, grad_output, trainable):
        (x,) = inputs
        return {"weight": (x * grad_output).flatten(1, -2).sum(1), "bias": torch.zeros_like(grad_output).sum(1)}

    flashdp.register_rule(Dropping, drops_bias)
    model = nn.Sequential(nn.Linear(3, 3), Dropping(3))
    with _engine(model, mode=mode) as engine, pytest.raises(FlashDPError, match=rf"(?s){DIFFERS}.*'1.bias'"):
        engine.backward(per_sample_loss(model(torch.randn(4, 5, 3))))


class TimeMajor(nn.Module):
    """The inner Linear sees [T, B, d]: its dim 0 is time."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):  # x [B, T, d]
        return self.out(self.inner(x.transpose(0, 1)).transpose(0, 1).tanh())


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("steps", [4, 5], ids=["T==B", "T!=B"])
def test_a_time_major_linear_is_exact(steps, mode):
    """Its output [T, B, d]: with T != B the batch is found in dim 1; with T == B, dim 0 fails the verification
    (its rows are not samples), and dim 1 passes it."""
    model = TimeMajor().double()
    x = torch.randn(4, steps, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: model(x[s]).square().sum((1, 2)), 4, mode=mode)
    model.zero_grad()
    with _engine(model, mode=mode) as engine:
        engine.backward(model(x).square().sum((1, 2)))
        assert "generic" not in engine.strategies.values()


def test_rows_permuted_inside_the_forward_are_caught():
    class Permuting(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            order = torch.arange(x.shape[0]).flip(0)
            return self.out(self.inner(x[order])[order].tanh())

    model = Permuting()
    with _engine(model) as engine, pytest.raises(FlashDPError, match=rf"{NOT_SEPARABLE}: 'inner' \(Linear\)"):
        engine.backward(per_sample_loss(model(torch.randn(4, 3))))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_loss_using_the_batch_mean_is_caught(mode):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    out = model
    with _engine(model, mode=mode) as engine, pytest.raises(FlashDPError, match=r"(?s)loss.* mix samples"):
        out = model(torch.randn(5, 3))
        engine.backward((out - out.mean(0)).square().sum(1))


def test_a_contrastive_loss_over_the_batch_is_caught():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
    with _engine(model) as engine, pytest.raises(FlashDPError, match=r"(?s)loss.* mix samples"):
        z = nn.functional.normalize(model(torch.randn(5, 3)), dim=1)
        engine.backward(nn.functional.cross_entropy(z @ z.T / 0.1, torch.arange(5), reduction="none"))


def test_a_wrong_norm_is_caught():
    """A bug in a norm computation (here: the embedding's segment sums off by 20%) is caught by the comparison."""
    model = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 2))
    wrong = mock.patch.object(blocks, "token_norm_sq", lambda block, _f=blocks.token_norm_sq: 0.8 * _f(block))
    with wrong, _engine(model) as engine, pytest.raises(FlashDPError, match=rf"(?s){DIFFERS}.*'0.weight'"):
        engine.backward(per_sample_loss(model(torch.randint(0, 9, (3, 6)))))


class SometimesPermuting(nn.Module):
    """Correct until `permute` is set: a data-dependent bug the self-check meets only when it runs."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)
        self.permute = False

    def forward(self, x):
        order = torch.arange(x.shape[0]).flip(0) if self.permute else torch.arange(x.shape[0])
        return self.out(self.inner(x[order])[order].tanh())


def test_the_self_check_runs_first_then_every_interval():
    model = SometimesPermuting()
    x = torch.randn(4, 3)
    with _engine(model, self_check=3) as engine:
        engine.backward(per_sample_loss(model(x)))  # call 0: checked, correct
        model.permute = True
        for _ in range(2):  # calls 1 and 2 are not checked: the bug goes through (the documented trade-off)
            model.zero_grad()
            engine.backward(per_sample_loss(model(x)))
        model.zero_grad()
        with pytest.raises(FlashDPError, match=NOT_SEPARABLE):  # call 3 is
            engine.backward(per_sample_loss(model(x)))


def test_the_self_check_can_be_turned_off():
    """Off, it no longer compares per-sample gradients: a wrong rule goes through (the layout check, one extra pass
    on every new forward structure, stays)."""

    class Dropping(Affine):
        pass

    flashdp.register_rule(Dropping, lambda m, inputs, g, trainable: {"weight": g.sum(1) * 0, "bias": g.sum(1) * 0})
    model = Dropping(3)
    with _engine(model, self_check=None) as engine:
        engine.backward(per_sample_loss(model(torch.randn(4, 5, 3))))


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "always"])
def test_a_bad_self_check_interval_is_refused(value):
    with pytest.raises(FlashDPError, match=r"self_check is the number of backward calls between two self-checks"):
        _engine(nn.Linear(2, 2), self_check=value)
