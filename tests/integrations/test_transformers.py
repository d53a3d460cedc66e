"""DPTrainer: the HF Trainer path end to end on tiny configs, step for step equal to flashdp's own loop."""

import copy
import os

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

import flashdp
from flashdp import FlashDPError
from flashdp.integrations.transformers import ENGINE_STATE, DPTrainer, PrivacyArguments
from tests.test_hf_models import VOCAB, gpt2

N, T = 24, 6


def lm_records() -> list[dict]:
    ids = torch.randint(0, VOCAB, (N, T))
    labels = ids.clone()
    labels[::3, -2:] = -100  # padding of some records: ignored
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


def training_args(out, **overrides) -> TrainingArguments:
    settings = {
        "output_dir": str(out),
        "per_device_train_batch_size": 3,
        "max_steps": 4,
        "learning_rate": 0.1,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return TrainingArguments(**{**settings, **overrides})


def test_dptrainer_takes_the_same_steps_as_flashdps_own_loop(tmp_path):
    model, data = gpt2(), lm_records()
    own = copy.deepcopy(model)
    privacy = PrivacyArguments(expected_batch_size=5, noise_multiplier=0.8, seed=7)
    trainer = DPTrainer(model=model, args=training_args(tmp_path), train_dataset=data, privacy=privacy)
    trainer.train()

    optimizer = torch.optim.SGD(own.parameters(), lr=0.1)
    engine = flashdp.make_private(
        own,
        max_grad_norm=1.0,  # TrainingArguments' default, per sample
        noise_multiplier=0.8,
        optimizer=optimizer,
        expected_batch_size=5,
        sample_rate=5 / N,
        seed=7,
    )
    batches = flashdp.poisson_loader(data, 5 / N, collate_fn=trainer.data_collator, seed=7)
    for step, batch in enumerate(batches):
        if step == 4:
            break
        for micro in flashdp.micro_batches(batch, 3):
            if len(micro["labels"]) == 0:
                engine.backward_empty()
                continue
            logits = own(input_ids=micro["input_ids"]).logits
            engine.backward(flashdp.per_sample_lm_loss(logits, micro["labels"]))
        engine.step()
    for (name, p), q in zip(model.named_parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert trainer.engine.steps == 4
    logged = [entry["epsilon"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 4 and logged == sorted(logged) and logged[-1] == pytest.approx(engine.epsilon(1e-5))


def test_user_level_dptrainer_takes_the_same_steps_as_flashdps_own_loop(tmp_path):
    """user_column: users sampled (8 users of 3 records each), up to 2 records each, each user's records clipped
    together, in micro-batches that keep users whole; the user column never reaches the collator."""
    model, data = gpt2(), [{**record, "user": i % 8} for i, record in enumerate(lm_records())]
    own = copy.deepcopy(model)
    privacy = PrivacyArguments(expected_batch_size=3, noise_multiplier=0.8, seed=7, user_column="user",
                               examples_per_user=2)  # fmt: skip
    trainer = DPTrainer(model=model, args=training_args(tmp_path), train_dataset=data, privacy=privacy)
    trainer.train()

    optimizer = torch.optim.SGD(own.parameters(), lr=0.1)
    engine = flashdp.make_private(own, max_grad_norm=1.0, noise_multiplier=0.8, optimizer=optimizer,
                                  expected_batch_size=3, sample_rate=3 / 8, seed=7)  # fmt: skip
    records = [{k: v for k, v in r.items() if k != "user"} for r in data]
    users = [r["user"] for r in data]
    loader = engine.data_loader(records, collate_fn=trainer.data_collator, users=users, examples_per_user=2)
    epochs = []
    for epoch in range(2):  # (epochs of ceil(8 / 3) = 3 steps; Trainer sets each epoch's draws, as here)
        loader.set_epoch(epoch)
        epochs += list(loader)
    sizes = []
    for step, (batch, ids) in enumerate(epochs):
        if step == 4:
            break
        sizes.append(len(ids))
        for micro, who in flashdp.micro_batches((batch, ids), 3, users=ids):
            if len(who) == 0:
                engine.backward_empty()
                continue
            logits = own(input_ids=micro["input_ids"]).logits
            engine.backward(flashdp.per_sample_lm_loss(logits, micro["labels"]), users=who)
        engine.step()
    assert max(sizes) > 3  # (some micro-batch held several users)
    for (name, p), q in zip(model.named_parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert trainer.engine.epsilon(1e-5) == flashdp.get_epsilon(
        noise_multiplier=0.8, sample_rate=3 / 8, steps=4, delta=1e-5
    )


def test_classification_losses_are_per_sample_cross_entropy(tmp_path):
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    data = [{"input_ids": torch.randint(0, VOCAB, (T,)), "labels": torch.tensor(i % 3)} for i in range(N)]
    privacy = PrivacyArguments(expected_batch_size=6, target_epsilon=4.0, delta=1e-4)
    trainer = DPTrainer(model=model, args=training_args(tmp_path), train_dataset=data, privacy=privacy)
    batch = {
        key: value.to(model.device) for key, value in trainer.data_collator(data[:5]).items()
    }  # (Trainer moved it)
    expected = nn.functional.cross_entropy(
        model(input_ids=batch["input_ids"]).logits, batch["labels"], reduction="none"
    )
    torch.testing.assert_close(trainer.per_sample_loss(model, batch), expected)
    trainer.train()
    assert trainer.engine.steps == 4
    assert (
        0.99 * 4.0
        <= flashdp.get_epsilon(noise_multiplier=trainer.engine.noise_multiplier, sample_rate=6 / N, steps=4, delta=1e-4)
        <= 4.0
    ), "sigma calibrated for the run's max_steps"


def test_a_resumed_run_continues_the_accounting(tmp_path):
    data = lm_records()
    privacy = PrivacyArguments(expected_batch_size=5, noise_multiplier=0.8, seed=3)
    args = training_args(tmp_path, save_strategy="steps", save_steps=2)
    whole = DPTrainer(model=gpt2(), args=args, train_dataset=data, privacy=privacy)
    whole.train()
    checkpoint = os.path.join(tmp_path, "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, ENGINE_STATE))
    resumed = DPTrainer(model=gpt2(), args=args, train_dataset=data, privacy=privacy)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.engine.steps == 4
    assert resumed.engine.epsilon(1e-5) == whole.engine.epsilon(1e-5)
    os.remove(os.path.join(checkpoint, ENGINE_STATE))
    with pytest.raises(FlashDPError, match="privacy already spent is unknown"):
        DPTrainer(model=gpt2(), args=args, train_dataset=data, privacy=privacy).train(resume_from_checkpoint=checkpoint)


def test_a_second_train_call_continues_with_the_same_engine(tmp_path):
    privacy = PrivacyArguments(expected_batch_size=5, noise_multiplier=0.8)
    trainer = DPTrainer(model=gpt2(), args=training_args(tmp_path), train_dataset=lm_records(), privacy=privacy)
    trainer.train()
    engine = trainer.engine
    trainer.train()  # Trainer builds a scheduler again: over the torch optimizer, not the engine's step
    assert trainer.engine is engine and engine.steps == 8
    assert engine.epsilon(1e-5) == flashdp.get_epsilon(noise_multiplier=0.8, sample_rate=5 / N, steps=8, delta=1e-5)


@pytest.mark.parametrize(
    ("overrides", "privacy", "message"),
    [
        ({"gradient_accumulation_steps": 2}, {}, "gradient_accumulation_steps=1"),
        ({"max_grad_norm": 0.5}, {"max_grad_norm": 2.0}, "Two clipping bounds"),
        ({"max_grad_norm": 0.0}, {}, "clipping bound"),
        ({}, {"expected_batch_size": 1000}, "exceeds"),
        ({}, {"user_column": "input_ids"}, "needs both PrivacyArguments.user_column and examples_per_user"),
        ({}, {"user_column": "input_ids", "examples_per_user": 2}, r"one integer user id per example; example 0 has"),
        ({}, {"user_column": "user", "examples_per_user": 2}, "the training examples have no such column"),
        ({"label_smoothing_factor": 0.1}, {}, "would be ignored: label_smoothing_factor"),
    ],
)
def test_settings_dp_cannot_honour_are_refused(tmp_path, overrides, privacy, message):
    arguments = PrivacyArguments(**{"expected_batch_size": 4, "noise_multiplier": 1.0, **privacy})
    with pytest.raises(FlashDPError, match=message):
        DPTrainer(
            model=gpt2(), args=training_args(tmp_path, **overrides), train_dataset=lm_records(), privacy=arguments
        )


def test_a_loss_per_sample_loss_would_not_compute_is_refused_unless_it_is_overridden(tmp_path):
    privacy = PrivacyArguments(expected_batch_size=4, noise_multiplier=1.0)
    with pytest.raises(FlashDPError, match="would be ignored: compute_loss_func"):
        DPTrainer(
            model=gpt2(), args=training_args(tmp_path), train_dataset=lm_records(), privacy=privacy,
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
        )  # fmt: skip
    mixture = gpt2()
    mixture.config.output_router_logits = True
    with pytest.raises(FlashDPError, match=r"auxiliary \(load-balancing\) loss is a statistic of the whole batch"):
        DPTrainer(model=mixture, args=training_args(tmp_path), train_dataset=lm_records(), privacy=privacy)

    class Smoothed(DPTrainer):
        def per_sample_loss(self, model, inputs):
            return super().per_sample_loss(model, inputs)  # (a user's own loss would apply the smoothing)

    args = training_args(tmp_path, label_smoothing_factor=0.1)
    Smoothed(model=gpt2(), args=args, train_dataset=lm_records(), privacy=privacy)  # accepted


class _ScaledLoss(DPTrainer):
    """Trainer's way to change the loss: DPTrainer never calls compute_loss, so the update was plain DPTrainer's."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 100 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_a_compute_loss_override_is_refused_unless_per_sample_loss_is_overridden(tmp_path):
    privacy = PrivacyArguments(expected_batch_size=4, noise_multiplier=1.0)
    with pytest.raises(FlashDPError, match="_ScaledLoss overrides compute_loss, which DPTrainer never calls"):
        _ScaledLoss(model=gpt2(), args=training_args(tmp_path), train_dataset=lm_records(), privacy=privacy)

    class Both(_ScaledLoss):
        def per_sample_loss(self, model, inputs):
            return 100 * super().per_sample_loss(model, inputs)

    Both(model=gpt2(), args=training_args(tmp_path), train_dataset=lm_records(), privacy=privacy)  # accepted


def test_users_with_more_examples_a_step_than_a_micro_batch_holds_are_refused_when_built(tmp_path):
    data = [{**record, "user": i // 4} for i, record in enumerate(lm_records())]
    privacy = PrivacyArguments(expected_batch_size=2, noise_multiplier=1.0, user_column="user", examples_per_user=4)
    with pytest.raises(FlashDPError, match="examples_per_user=4 exceeds per_device_train_batch_size=3"):
        DPTrainer(model=gpt2(), args=training_args(tmp_path), train_dataset=data, privacy=privacy)
