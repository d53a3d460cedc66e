"""Gradients reach the optimizer only through engine.backward: anything else is refused before it is stepped."""

import gc

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.strategies import per_sample_loss


def _setup(mode="bk"):
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer, expected_batch_size=4
    )
    return model, optimizer, engine


def _loss(model):
    return per_sample_loss(model(torch.randn(4, 4)))


def test_an_opacus_style_loop_is_refused_at_the_optimizer_step():
    """loss.mean().backward(); optimizer.step() would train with no clipping and no noise."""
    model, optimizer, engine = _setup()
    _loss(model).mean().backward()
    with pytest.raises(FlashDPError, match=r"optimizer\.step\(\) was called directly after make_private"):
        optimizer.step()
    engine.detach()
    optimizer.step()  # a detached engine leaves the optimizer alone


def test_an_opacus_style_loop_with_an_optimizer_not_given_to_make_private_is_refused():
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    optimizer = torch.optim.Adam(model[2].parameters())  # built after make_private, over part of the model
    _loss(model).mean().backward()
    with pytest.raises(FlashDPError, match=r"directly after make_private, on an optimizer holding 2 of the model's"):
        optimizer.step()
    del engine
    gc.collect()  # a dropped engine lives until detach(): the step stays refused
    with pytest.raises(FlashDPError, match=r"directly after make_private"):
        optimizer.step()


def test_make_private_as_a_statement_keeps_the_model_private():
    """The engine returned by make_private is not kept (an Opacus habit): plain training stays refused."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    flashdp.make_private(model, optimizer=optimizer, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    gc.collect()
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model).mean().backward()
    with pytest.raises(FlashDPError, match=r"directly after make_private"):
        optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_an_optimizer_over_another_model_steps_freely():
    _, _, engine = _setup()
    other = nn.Linear(3, 3)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.randn(2, 3)).sum().backward()
    before = other.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, other.weight)
    engine.detach()


def test_an_optimizer_over_frozen_parameters_only_steps_freely():
    model, _, engine = _setup()
    model[0].requires_grad_(False)
    torch.optim.SGD(model[0].parameters(), lr=0.1).step()
    engine.detach()


def test_skipping_engine_step_is_refused():
    model, optimizer, engine = _setup()
    engine.backward(_loss(model))
    with pytest.raises(FlashDPError, match=r"adds no noise and is not accounted"):
        optimizer.step()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_plain_backward_between_engine_backward_and_step_is_refused(mode):
    model, _, engine = _setup(mode)
    engine.backward(_loss(model))
    _loss(model).sum().backward()
    with pytest.raises(FlashDPError, match=r"changed between engine\.backward and engine\.step: a plain"):
        engine.step()


def test_post_processing_the_clipped_sum_before_the_noise_is_refused():
    model, _, engine = _setup()
    engine.backward(_loss(model))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.raises(FlashDPError, match=r"post-processing them before the noise breaks the privacy guarantee"):
        engine.step()


def test_a_plain_backward_between_micro_batches_is_refused():
    model, _, engine = _setup()
    engine.backward(_loss(model))
    _loss(model).sum().backward()
    with pytest.raises(FlashDPError, match=r"changed between engine\.backward and engine\.backward"):
        engine.backward(_loss(model))


def test_a_stale_gradient_before_the_first_backward_is_refused():
    model = nn.Sequential(nn.Linear(4, 2))
    _loss(model).sum().backward()  # e.g. a non-private warm-up step that forgot zero_grad
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        with pytest.raises(FlashDPError, match=r"'0.weight', '0.bias' already have a gradient that engine\.backward"):
            engine.backward(_loss(model))
        model.zero_grad()
        engine.backward(_loss(model))


def test_cleared_gradients_are_not_refused():
    """zero_grad removes signal, never adds any: clipping-only uses (norms for data valuation) may clear."""
    model, _, engine = _setup()
    engine.backward(_loss(model))
    model.zero_grad(set_to_none=False)
    engine.backward(_loss(model))
    model.zero_grad()
    engine.backward(_loss(model))
    engine.step()


def test_a_normal_loop_steps():
    model, _, engine = _setup("ghost")
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        engine.backward(_loss(model))
        engine.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
