"""An empty Poisson batch with any model: one call, noise still added, the step accounted (HF GPT-2 and Llama,
which cannot run a forward on zero rows)."""

import pytest
import torch
from torch.utils.data import TensorDataset

import flashdp
from flashdp import FlashDPError
from tests.test_hf_models import VOCAB, gpt2, llama, lm_loss, positions


@pytest.mark.parametrize("build", [gpt2, lambda: llama(tied=False)], ids=["gpt2", "llama"])
def test_empty_batches_are_noised_and_accounted(build):
    model = build()
    ids = torch.randint(0, VOCAB, (20, 6))
    sigma, q, steps = 0.5, 0.05, 12
    engine = flashdp.make_private(
        model,
        max_grad_norm=1.0,
        noise_multiplier=sigma,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        expected_batch_size=1,
        sample_rate=q,
        seed=1,
    )
    empty_steps_changed = []
    for (batch,) in engine.data_loader(TensorDataset(ids), steps=steps):
        before = [p.detach().clone() for p in model.parameters()]
        if len(batch) == 0:
            engine.backward_empty()
        else:
            engine.backward(lm_loss(model(batch, position_ids=positions(batch)).logits, batch))
        engine.step()
        if len(batch) == 0:
            empty_steps_changed.append(
                all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
            )
    assert empty_steps_changed, "q = 0.05 over 20 samples and this seed draw empty batches"
    assert all(empty_steps_changed), "every parameter gets noise on an empty step"
    assert engine.steps == steps
    assert engine.epsilon(1e-5) == flashdp.get_epsilon(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=1e-5)


def test_backward_empty_refuses_a_recorded_forward_and_step_still_needs_a_backward():
    model = torch.nn.Linear(3, 2)
    engine = flashdp.make_private(
        model,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        expected_batch_size=4,
        sample_rate=0.1,
    )
    with pytest.raises(FlashDPError, match=r"no engine\.backward"):
        engine.step()
    model(torch.randn(2, 3))
    with pytest.raises(FlashDPError, match="a forward was recorded"):
        engine.backward_empty()
    engine.backward_empty()  # the refused forward was dropped
    engine.step()
    assert engine.steps == 1


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_padding_backward_adds_nothing_and_counts_no_sample(mode):
    """engine.backward_padding: the stand-in rows a rank without samples runs (DDP, FSDP) change no gradient and
    are not counted in the step's batch."""
    model = gpt2()
    ids = torch.randint(0, VOCAB, (3, 6))
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=0.5, noise_multiplier=0.0)
    engine.backward(lm_loss(model(ids, position_ids=positions(ids)).logits, ids))
    clipped = [p.grad.clone() for p in model.parameters()]
    stand_in = ids[:1]
    engine.backward_padding(lm_loss(model(stand_in, position_ids=positions(stand_in)).logits, stand_in))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), clipped, strict=True))
    assert engine.noisy_step._samples_since_step == 3


def test_a_padding_backward_of_a_user_level_engine_records_no_user():
    """With users=, the stand-in rows take part in the ranks' exchange of users with none: the id they carry may
    still come as a real user later in the step."""
    model = gpt2()
    ids = torch.randint(0, VOCAB, (3, 6))
    engine = flashdp.make_private(model, max_grad_norm=0.5, noise_multiplier=0.0)
    stand_in = ids[:1]
    loss = lm_loss(model(stand_in, position_ids=positions(stand_in)).logits, stand_in)
    engine.backward_padding(loss, users=torch.tensor([7]))
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    engine.backward(lm_loss(model(ids, position_ids=positions(ids)).logits, ids), users=torch.tensor([7, 7, 8]))
    assert engine.noisy_step._samples_since_step == 2  # the step's users: 7 and 8
