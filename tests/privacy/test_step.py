"""engine.step(): noise once per step on every trainable parameter, averaging, the optimizer, accounting."""

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.oracle import seeded
from tests.privacy.test_accounting import agrees_with_dp_accounting


def _engine(model, **kwargs):
    args = {
        "mode": "bk",
        "max_grad_norm": 1.0,
        "noise_multiplier": 1.0,
        "optimizer": torch.optim.SGD(model.parameters(), lr=1.0),
        "expected_batch_size": 4,
        "sample_rate": 0.01,
    } | kwargs
    return flashdp.make_private(model, **args)


def _noise_after_one_step(model, engine, **_) -> torch.Tensor:
    """The update of a step whose clipped sum is zero: -lr * noise / expected_batch_size."""
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(model(torch.zeros(0, model[0].in_features)).sum(1))  # an empty Poisson batch
    engine.step()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)])


def test_noise_std_is_sigma_c_over_batch_size_and_fresh_every_step():
    model = nn.Sequential(nn.Linear(300, 200))  # 60,200 coordinates
    sigma, c, batch = 1.3, 0.7, 8
    engine = _engine(model, noise_multiplier=sigma, max_grad_norm=c, expected_batch_size=batch)
    first, second = _noise_after_one_step(model, engine), _noise_after_one_step(model, engine)
    expected_std = sigma * c / batch
    for noise in (first, second):
        assert noise.numel() >= 50_000
        assert abs(noise.std().item() / expected_std - 1) < 0.03
        assert abs(noise.mean().item()) < 0.03 * expected_std
    assert abs(torch.corrcoef(torch.stack([first, second]))[0, 1].item()) < 0.02


def test_no_noise_on_frozen_parameters():
    model = nn.Sequential(nn.Linear(50, 40), nn.Linear(40, 3))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    engine = _engine(model)
    engine.backward(model(torch.randn(3, 50)).sum(1))
    engine.step()
    assert torch.equal(model[0].weight, frozen) and model[0].weight.grad is None
    assert not torch.equal(model[1].weight.grad if model[1].weight.grad is not None else model[1].weight, frozen)


def test_step_without_noise_is_the_clipped_mean():
    model = nn.Sequential(nn.Linear(3, 2))
    engine = _engine(model, noise_multiplier=0.0, expected_batch_size=5, max_grad_norm=100.0)
    x = torch.randn(4, 3)
    before = model[0].weight.detach().clone()
    engine.backward(model(x).sum(1))
    engine.step()
    # unclipped (C is large): the update is -lr * sum_i g_i / expected_batch_size
    expected = before - x.sum(0).expand(2, 3) / 5
    torch.testing.assert_close(model[0].weight.detach(), expected)
    assert model[0].weight.grad is None  # zero_grad() after the step


def test_noise_is_reproducible_with_a_seed_and_differs_without():
    def run(seed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 10))
        return _noise_after_one_step(model, _engine(model, seed=seed))

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(None), run(None))


def test_secure_rng_noise_has_the_right_std():
    model = nn.Sequential(nn.Linear(300, 200))
    engine = _engine(model, secure_rng=True, noise_multiplier=2.0, expected_batch_size=1)
    noise = _noise_after_one_step(model, engine)
    assert abs(noise.std().item() / 2.0 - 1) < 0.03
    with pytest.raises(FlashDPError, match="cannot be seeded"):
        _engine(nn.Sequential(nn.Linear(2, 2)), secure_rng=True, seed=1)


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_any_optimizer_with_param_groups_and_scheduler(optimizer):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = optimizer([{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters()}], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = _engine(model, optimizer=opt)
    for _ in range(3):
        engine.backward(model(torch.randn(4, 4)).square().sum(1))
        engine.step()
        scheduler.step()
    assert engine.steps == 3 and opt.param_groups[1]["lr"] == pytest.approx(1e-3 / 8)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_epsilon_agrees_with_dp_accounting_for_the_same_events(kind):
    model = nn.Sequential(nn.Linear(2, 2))
    engine = _engine(model, noise_multiplier=0.9, sample_rate=0.05, accountant=kind)
    for _ in range(30):
        engine.backward(model(torch.randn(2, 2)).sum(1))
        engine.step()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(0.9)), 30
    )
    reference = (pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant()).compose(event)
    assert agrees_with_dp_accounting(kind, engine.epsilon(1e-5), reference.get_epsilon(1e-5))


@pytest.mark.parametrize("kind", ["pld", "rdp"])
@pytest.mark.parametrize("budget", [{"steps": 200}, {"epochs": 2}])
def test_calibration_reaches_the_target_from_below_within_one_percent(kind, budget):
    q, delta, target = 0.02, 1e-5, 2.0
    engine = _engine(
        nn.Sequential(nn.Linear(2, 2)),
        noise_multiplier=None,
        target_epsilon=target,
        target_delta=delta,
        sample_rate=q,
        accountant=kind,
        **budget,
    )
    steps = budget.get("steps") or int(budget["epochs"] / q)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(engine.noise_multiplier)), steps
    )
    epsilon = (pld.PLDAccountant() if kind == "pld" else rdp.RdpAccountant()).compose(event).get_epsilon(delta)
    assert 0.99 * target <= epsilon <= target


def test_checkpoint_and_resume_equal_an_uninterrupted_run():
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
        return model, _engine(model, seed=3, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    data = [torch.randn(4, 6, generator=seeded(i)) for i in range(6)]

    def train(model, engine, batches):
        for x in batches:
            engine.backward(model(x).square().sum(1))
            engine.step()

    model_a, engine_a = build()
    train(model_a, engine_a, data)

    model_b, engine_b = build()
    train(model_b, engine_b, data[:3])
    checkpoint = {"model": model_b.state_dict(), "engine": engine_b.state_dict()}
    model_c, engine_c = build()
    model_c.load_state_dict(checkpoint["model"])
    engine_c.load_state_dict(checkpoint["engine"])
    train(model_c, engine_c, data[3:])

    for a, c in zip(model_a.parameters(), model_c.parameters(), strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    assert engine_c.steps == 6 and engine_c.epsilon(1e-5) == engine_a.epsilon(1e-5)


def test_resume_with_other_settings_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    first = _engine(model)
    state = first.state_dict()
    first.detach()  # (an engine lives until detached)
    with pytest.raises(FlashDPError, match=r"checkpoint has noise_multiplier=1\.0, this engine 2\.0"):
        _engine(model, noise_multiplier=2.0).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"noise_multiplier": None}, "Give exactly one of noise_multiplier"),
        ({"target_epsilon": 1.0}, "Give exactly one of noise_multiplier"),
        ({"sample_rate": 0.0}, r"sample_rate is the Poisson sampling probability q, in \(0, 1\]"),
        ({"sample_rate": 1.5}, r"in \(0, 1\]\. Received 1\.5"),
        ({"expected_batch_size": 0}, "expected_batch_size must be a positive int"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite number >= 0"),
        ({"accountant": "gdp"}, "accountant must be one of"),
        ({"noise_multiplier": True}, "noise_multiplier must be a finite number >= 0. Received True"),
        ({"sample_rate": True}, r"in \(0, 1\]\. Received True"),
        ({"expected_batch_size": True}, "expected_batch_size must be a positive int"),
        ({"max_grad_norm": True}, "max_grad_norm must be a positive finite number"),
        ({"seed": True}, "seed must be an int or None"),
        ({"nonfinite": "ignore"}, "nonfinite must be one of"),
        (
            {"noise_multiplier": None, "target_epsilon": True, "target_delta": 1e-5, "steps": 5},
            "target_epsilon must be a positive finite number",
        ),
        (
            {"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 1e-5, "steps": True},
            "steps must be a positive int",
        ),
        ({"noise_multiplier": None, "target_epsilon": 1.0, "steps": 10}, "needs target_delta"),
        (
            {"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 1e-5},
            "needs exactly one of steps and epochs",
        ),
        (
            {"noise_multiplier": None, "target_epsilon": 1.0, "target_delta": 1e-5, "steps": 5, "sample_rate": None},
            "needs sample_rate",
        ),
    ],
)
def test_bad_privacy_arguments(kwargs, match):
    with pytest.raises(FlashDPError, match=match):
        _engine(nn.Sequential(nn.Linear(2, 2)), **kwargs)


def test_step_needs_an_optimizer_a_batch_size_and_a_backward():
    model = nn.Sequential(nn.Linear(2, 2))
    with (
        _engine(model, optimizer=None) as engine,
        pytest.raises(FlashDPError, match=r"needs an optimizer: make_private\(\.\.\., optimizer=opt\)"),
    ):
        engine.step()
    with _engine(model, expected_batch_size=None) as engine:
        engine.backward(model(torch.randn(2, 2)).sum(1))
        with pytest.raises(FlashDPError, match="needs expected_batch_size"):
            engine.step()
    model.zero_grad()
    with _engine(model) as engine, pytest.raises(FlashDPError, match=r"no engine\.backward\(\) since the last step"):
        engine.step()


def test_optimizer_over_foreign_parameters_is_refused():
    model, other = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    with pytest.raises(FlashDPError, match=r"holds 2 parameter\(s\) that are not the model's"):
        _engine(model, optimizer=torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))


def test_epsilon_needs_a_sample_rate_and_a_valid_delta():
    engine = _engine(nn.Sequential(nn.Linear(2, 2)), sample_rate=None)
    with pytest.raises(FlashDPError, match=r"epsilon\(\) needs the Poisson sampling rate"):
        engine.epsilon(1e-5)
    with pytest.raises(FlashDPError, match=r"delta must be in \(0, 1\)"):
        _engine(nn.Sequential(nn.Linear(2, 2))).epsilon(0.0)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("noise_multiplier", float("nan"), "noise_multiplier must be a finite number >= 0"),
        ("noise_multiplier", -1.0, "noise_multiplier must be a finite number >= 0"),
        ("noise_multiplier", "1.0", "noise_multiplier must be a finite number >= 0"),
        ("sample_rate", float("nan"), r"sample_rate is the Poisson sampling probability q, in \(0, 1\]"),
        ("sample_rate", -0.5, r"sample_rate is the Poisson sampling probability q, in \(0, 1\]"),
        ("expected_batch_size", 0, "expected_batch_size must be a positive int"),
    ],
)
def test_privacy_settings_assigned_later_are_checked_as_at_make_private(name, value, match):
    """A breaker's: a NaN or negative sigma assigned to the engine added no noise (`std > 0` false) and reported
    epsilon 0 (RDP); a NaN sample rate epsilon 0; a batch size of 0 made the parameters NaN."""
    model = nn.Sequential(nn.Linear(2, 2))
    with _engine(model) as engine:
        with pytest.raises(FlashDPError, match=match):
            setattr(engine, name, value)
        assert getattr(engine, name) == {"noise_multiplier": 1.0, "sample_rate": 0.01, "expected_batch_size": 4}[name]
        with pytest.raises(AttributeError):
            engine.noisy_step.max_grad_norm = 0.01  # (C is the clipping's too: fixed at make_private)
