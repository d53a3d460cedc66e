"""Non-finite per-sample gradients never reach a parameter; float32 overflow of a squared norm is not one."""

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests import oracle
from tests.conftest import MODES


def _model(dtype=torch.float32, activation=nn.Tanh):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4, bias=False), activation(), nn.Linear(4, 2)).to(dtype)


def _sqrt_loss(out):
    """Finite everywhere; its gradient is NaN for a sample whose output is 0 (sqrt'(0) * 0)."""
    return (out - out[:, :1].detach() * 0).square().sum(1).sqrt()


def _batch_with_a_nan_gradient():
    x = torch.randn(5, 3)
    x[3] = 0  # with no bias in the first layer, tanh(0) = 0 and the head's output is its bias: set it to 0
    return x


def _engine(model, **kwargs):
    args = {"max_grad_norm": 1.0, "noise_multiplier": 0.0, "expected_batch_size": 5, "self_check": None}
    return flashdp.make_private(model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), **(args | kwargs))


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_gradient_is_refused_naming_the_sample_and_nothing_reaches_grad(mode):
    model = _model()
    nn.init.zeros_(model[2].bias)
    engine = _engine(model, mode=mode)
    with pytest.raises(FlashDPError, match=r"sample 3 is not finite .* batch of 5.*nonfinite='skip'"):
        engine.backward(_sqrt_loss(model(_batch_with_a_nan_gradient())))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(FlashDPError, match=r"no engine\.backward"):  # the refused backward does not count for a step
        engine.step()


@pytest.mark.parametrize("self_check", [None, 1])
@pytest.mark.parametrize("mode", MODES)
def test_skip_gives_non_finite_samples_a_zero_contribution_and_the_others_their_exact_clipped_sum(mode, self_check):
    """In every mode: ghost's and flash's second pass sums the kept samples' rows only (a backward of the weighted
    losses would carry the skipped sample's NaN into every parameter)."""
    model = _model()
    nn.init.zeros_(model[2].bias)
    x = _batch_with_a_nan_gradient()
    engine = _engine(model, mode=mode, nonfinite="skip", self_check=self_check)
    norms = engine.backward(_sqrt_loss(model(x)))
    engine.detach()

    reference = _model(torch.float64)
    reference.load_state_dict(model.state_dict())
    keep = [0, 1, 2, 4]
    per_sample = oracle.per_sample_grads(reference, lambda s: _sqrt_loss(reference(x[keep][s].double())), len(keep))
    expected_norms, expected = oracle.clip(per_sample, "flat", 1.0)
    assert torch.isnan(norms[3]) and engine.skipped_samples == 1
    torch.testing.assert_close(norms[keep].double(), expected_norms, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backwards", [1, 2], ids=["held pass", "streamed pass"])
@pytest.mark.parametrize("mode", MODES)
def test_a_norm_beyond_float32_squares_is_clipped_to_c_not_dropped(mode, backwards):
    """A per-sample norm of about 1e20 squares to 1e40, beyond float32: the sample must still contribute C. The
    streamed pass (a second backward) no longer has the contributions: bk recomputes from its plans, ghost and
    flash from a second norm pass."""
    model = _model(activation=nn.ReLU)  # (tanh would saturate)
    x = torch.randn(3, 3)
    x[1] *= 1e20
    engine = _engine(model, mode=mode)
    for _ in range(backwards):
        model.zero_grad()
        norms = engine.backward(model(x).sum(1))
    engine.detach()

    reference = _model(torch.float64, nn.ReLU)
    reference.load_state_dict(model.state_dict())
    per_sample = oracle.per_sample_grads(reference, lambda s: reference(x[s].double()).sum(1), 3)
    expected_norms, expected = oracle.clip(per_sample, "flat", 1.0)
    assert expected_norms[1] > 1e19
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-5, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[name], rtol=1e-4, atol=1e-6)


def test_skip_drops_a_sample_from_a_convolution_summed_by_its_own_weight_gradient():
    """bk sums a ghost-norm convolution by the layer's weight gradient from row weights (no factors kept): a
    sample whose output gradient is NaN (its loss a square root at 0) must add exactly nothing, though NaN * 0 is
    NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 8, 3, bias=False), nn.Flatten())
    x = torch.randn(4, 2, 3, 3)
    x[1] = 0
    engine = _engine(model, mode="bk", nonfinite="skip", norm_strategy="ghost", expected_batch_size=4)
    norms = engine.backward(model(x).square().sum(1).sqrt())
    engine.detach()

    reference = nn.Sequential(nn.Conv2d(2, 8, 3, bias=False), nn.Flatten()).double()
    reference.load_state_dict(model.state_dict())
    keep = [0, 2, 3]
    per_sample = oracle.per_sample_grads(reference, lambda s: reference(x[keep][s].double()).square().sum(1).sqrt(), 3)
    expected_norms, expected = oracle.clip(per_sample, "flat", 1.0)
    assert torch.isnan(norms[1]) and engine.skipped_samples == 1
    torch.testing.assert_close(norms[keep].double(), expected_norms, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["ghost", pytest.param("flash", marks=MODES[2].marks)])
def test_skip_is_refused_where_the_second_pass_is_autograds_own(mode):
    """Under FSDP2 (an adapter that reshards after the forward and allows a second pass) ghost's and flash's second
    pass is autograd's backward of the weighted losses, which would carry a skipped sample's NaN everywhere."""
    from types import SimpleNamespace

    from flashdp._pipeline.clipped_sums import clipped_sums_for
    from flashdp._pipeline.settings import EngineSettings

    settings = EngineSettings(mode=mode, max_grad_norm=1.0, nonfinite="skip")
    fsdp2_like = SimpleNamespace(allows_second_pass=True, reshards_after_forward=True)
    with pytest.raises(FlashDPError, match="nonfinite='skip' with mode='ghost' or 'flash' under FSDP2"):
        clipped_sums_for(settings, fsdp2_like, grad_writes=None)


@pytest.mark.parametrize("ratio", [0.75e-45, 2.2e-45, 3.6e-45])
@pytest.mark.parametrize("mode", MODES)
def test_a_coefficient_in_float32s_subnormal_range_never_rounds_up(mode, ratio):
    """(A breaker's finding: a finite float32 gradient of norm 1.2e39 at C = `ratio` times it has a float32
    subnormal coefficient, and its cast rounded up: the sample added up to 1.86 C.) Coefficients round toward 0."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randn(16, 16).sign())
    x, v = torch.randn(3, 16).sign(), torch.full((3, 16), 0.1)
    x[0], v[0] = x[0] * 1e19, 1e19

    def loss_of(m, rows):
        return (v[rows].to(m.weight.dtype) * torch.sin(m(x[rows].to(m.weight.dtype)))).sum(-1)

    reference = nn.Linear(16, 16, bias=False).double()
    reference.load_state_dict(model.state_dict())
    per_sample = oracle.per_sample_grads(reference, lambda s: loss_of(reference, s), 3)
    norms = per_sample["weight"].flatten(1).norm(dim=1)
    c = ratio * float(norms[0])
    rest = sum(min(1.0, c / (float(n) + 1e-6)) * g for n, g in zip(norms[1:], per_sample["weight"][1:], strict=True))
    engine = _engine(model, mode=mode, max_grad_norm=c, expected_batch_size=3)
    engine.backward(loss_of(model, slice(None)))
    added = float((model.weight.grad.double() - rest).norm())
    assert 0 < added <= c * (1 + 1e-6)
