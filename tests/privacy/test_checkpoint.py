"""Checkpoints: no noise secret unless the user chose a seed, and load_state_dict all or nothing."""

import pickle

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError


def _build(seed=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6))
    engine = flashdp.make_private(
        model,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        expected_batch_size=1,
        sample_rate=0.01,
        seed=seed,
    )
    return model, engine


def _noise_of_next_step(model, engine):
    """With an empty batch the update is the noise itself."""
    before = model[0].weight.detach().clone()
    engine.backward(model(torch.zeros(0, 8)).sum(1))
    engine.step()
    return before - model[0].weight.detach()


def _state_bytes(state) -> bytes:
    return pickle.dumps(state)


def test_an_unseeded_checkpoint_holds_no_noise_secret_and_a_resumed_run_draws_fresh_noise():
    model, engine = _build()
    _noise_of_next_step(model, engine)
    state, weights = engine.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert state["noise"] == {"kind": "secret"}  # no seed, no generator state
    saved_generators = [g.get_state() for g in engine.noisy_step.noise._generators.values()]
    assert not any(bytes(s.numpy()) in _state_bytes(state) for s in saved_generators)

    continued = _noise_of_next_step(model, engine)
    model_b, resumed = _build()
    model_b.load_state_dict(weights)
    resumed.load_state_dict(state)
    assert resumed.steps == 1
    assert not torch.equal(_noise_of_next_step(model_b, resumed), continued)


def test_a_seeded_checkpoint_resumes_the_same_noise_stream():
    model, engine = _build(seed=5)
    _noise_of_next_step(model, engine)
    state, weights = engine.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert state["noise"]["kind"] == "seeded"
    continued = _noise_of_next_step(model, engine)
    model_b, resumed = _build(seed=5)
    model_b.load_state_dict(weights)
    resumed.load_state_dict(state)
    assert torch.equal(_noise_of_next_step(model_b, resumed), continued)


def test_a_seeded_checkpoint_resumed_without_a_seed_is_private_again():
    model, engine = _build(seed=5)
    _noise_of_next_step(model, engine)
    state, weights = engine.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    continued = _noise_of_next_step(model, engine)
    model_b, resumed = _build()
    model_b.load_state_dict(weights)
    resumed.load_state_dict(state)
    assert not torch.equal(_noise_of_next_step(model_b, resumed), continued)
    assert resumed.state_dict()["noise"] == {"kind": "secret"}


@pytest.mark.parametrize("missing", ["accountant", "noise", "sample_rate"])
def test_a_checkpoint_missing_a_key_is_refused_naming_it_and_nothing_is_loaded(missing):
    model, engine = _build()
    _noise_of_next_step(model, engine)
    state = engine.state_dict()
    del state[missing]
    _, fresh = _build()
    with pytest.raises(FlashDPError, match=f"lacks '{missing}'"):
        fresh.load_state_dict(state)
    assert fresh.steps == 0


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda s: s["noise"].update(kind="other"), "noise state is not one flashdp wrote"),
        (lambda s: s["accountant"].update(history=[[1.0, 0.01, "3"]]), "history is not a list"),
        (lambda s: s["accountant"].pop("history"), "lacks 'kind' or 'history'"),
        (lambda s: s["accountant"].update(kind="rdp"), "used the 'rdp' accountant"),
    ],
)
def test_a_corrupt_part_leaves_the_engine_as_it_was(corrupt, match):
    model, engine = _build(seed=1)
    _noise_of_next_step(model, engine)
    state = engine.state_dict()
    corrupt(state)
    _, fresh = _build(seed=2)
    expected = fresh.state_dict()
    with pytest.raises(FlashDPError, match=match):
        fresh.load_state_dict(state)
    assert fresh.steps == 0
    assert _state_bytes(fresh.state_dict()) == _state_bytes(expected)
