"""DPTrainer on 2 processes (DDP, gloo, CPU): every process samples the same logical batch, takes its share of it
and pads where it has no rows, the engine sums the clipped gradients over the processes; the parameters equal those
of the one-process DPTrainer with the same seed (same batches, same noise), and checkpoints resume the accounting."""

import os

import pytest
import torch
from transformers import default_data_collator

import flashdp
from flashdp.integrations.transformers import ENGINE_STATE, DPTrainer, PrivacyArguments
from tests.distributed import launch
from tests.integrations.test_transformers import training_args
from tests.test_hf_models import VOCAB, gpt2

N, T, EXPECTED, SEED, STEPS = 24, 6, 3, 5, 4


def records() -> list[dict]:
    ids = torch.randint(0, VOCAB, (N, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[::3, -2:] = -100
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


def _trainer(
    out: str, privacy: dict | None = None, data: list[dict] | None = None, collator=None, **overrides
) -> DPTrainer:
    torch.manual_seed(0)
    settings = {"expected_batch_size": EXPECTED, "noise_multiplier": 0.8, "seed": SEED, **(privacy or {})}
    args = training_args(out, **{"per_device_train_batch_size": 1, "max_steps": STEPS, **overrides})
    arguments = PrivacyArguments(**settings)
    data = data or records()
    return DPTrainer(model=gpt2(), args=args, train_dataset=data, data_collator=collator, privacy=arguments)


def _train(rank: int | None, out: str, resume: str | None = None, **overrides) -> dict:
    """A DPTrainer run of STEPS steps (on process `rank` of 2, or alone): its parameters, accounting and the
    losses it logged."""
    trainer = _trainer(out, **launch.as_torchrun_process(rank), **overrides)
    trainer.train(resume_from_checkpoint=resume)
    return {
        "params": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
        "steps": trainer.engine.steps,
        "epsilon": trainer.engine.epsilon(1e-5),
        "world": trainer.args.world_size,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }


def _assert_same_run(ranks: list[dict], one: dict) -> None:
    assert [r["world"] for r in ranks] == [2, 2] and one["world"] == 1
    for rank in ranks:
        assert rank["steps"] == one["steps"] and rank["epsilon"] == one["epsilon"]
        for name, p in one["params"].items():
            torch.testing.assert_close(rank["params"][name], p, msg=name)
    # the logged loss is the batch's mean per-sample loss, as on one process (0 for an empty batch)
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)


def test_the_sampled_batches_leave_a_process_without_rows():
    """The premise of the next test (micro-batches of one row): a step of 3 rows (process 0 runs two micro-batches,
    process 1 one and a padding row) and one of at most 1 row (a process with no rows runs a padding row)."""
    loader = flashdp.poisson_loader(records(), EXPECTED / N, collate_fn=default_data_collator, seed=SEED)
    sizes = [len(batch["labels"]) for _, batch in zip(range(STEPS), loader, strict=False)]
    assert 3 in sizes and min(sizes) <= 1, sizes


def test_two_ddp_processes_take_the_steps_of_one(tmp_path):
    one = _train(None, str(tmp_path / "one"))
    _assert_same_run(launch.run(_train, str(tmp_path / "ddp")), one)
    assert one["steps"] == STEPS


def masking_collator(examples: list[dict]) -> dict:
    """A collator that draws, as masked-LM ones do: each label hidden with probability 0.3."""
    batch = default_data_collator(examples)
    batch["labels"] = batch["labels"].masked_fill(torch.rand(batch["labels"].shape) < 0.3, -100)
    return batch


def _train_masked(rank: int | None, out: str) -> dict:
    """Steps from Poisson batches of 1 row in expectation (some empty), through `masking_collator`."""
    return _train(rank, out, privacy={"expected_batch_size": 1}, collator=masking_collator, max_steps=6)


def test_a_collator_that_draws_sees_the_same_draws_on_two_processes(tmp_path):
    """A process with no rows of an empty batch collates a padding row that no other process collates: its draws
    must not shift the draws of later batches (every process collates the next batches alike)."""
    loader = flashdp.poisson_loader(records(), 1 / N, collate_fn=default_data_collator, seed=SEED)
    sizes = [len(batch["labels"]) for _, batch in zip(range(6), loader, strict=False)]
    assert 0 in sizes[:-1] and max(sizes[sizes.index(0) :]) > 0, sizes  # an empty batch, a batch after it
    one = _train_masked(None, str(tmp_path / "one"))
    _assert_same_run(launch.run(_train_masked, str(tmp_path / "ddp")), one)


def _resume(rank: int | None, out: str) -> dict:
    """3 epochs of 2 steps (12 of 24 records a step in expectation) with a checkpoint every step, then runs resumed
    from the checkpoints of steps 2 (an epoch's start) and 3 (inside the second epoch)."""
    settings = {"privacy": {"expected_batch_size": 12}, "max_steps": 6, "per_device_train_batch_size": 4}
    whole = _train(rank, out, save_strategy="steps", save_steps=1, **settings)
    saved = os.path.isfile(os.path.join(out, "checkpoint-2", ENGINE_STATE))
    if rank is not None:
        torch.distributed.barrier()
    resumed = [
        _train(rank, out, resume=os.path.join(out, f"checkpoint-{step}"), save_strategy="no", **settings)
        for step in (2, 3)
    ]
    return {"saved": saved, "whole": whole, "resumed": resumed}


def test_a_run_resumed_past_its_first_epoch_takes_the_steps_of_the_whole_run(tmp_path):
    """The sampler draws each epoch from the seed and the epoch alone: a resumed run draws the batches the whole
    run drew (on one process and on two)."""
    for rank in [_resume(None, str(tmp_path / "one")), *launch.run(_resume, str(tmp_path / "ddp"))]:
        assert rank["saved"]
        for resumed in rank["resumed"]:
            assert resumed["steps"] == 6 and resumed["epsilon"] == rank["whole"]["epsilon"]
            assert resumed["losses"][-2:] == pytest.approx(rank["whole"]["losses"][-2:], rel=1e-5)
            for name, p in rank["whole"]["params"].items():
                torch.testing.assert_close(resumed["params"][name], p, msg=name)


def _train_users(rank: int | None, out: str) -> dict:
    """User-level clipping: 8 users of 3 records, up to 2 of each per step, 2 users a step in expectation."""
    with_users = [{**record, "user": i // 3} for i, record in enumerate(records())]
    privacy = {"user_column": "user", "examples_per_user": 2, "expected_batch_size": 2}
    return _train(rank, out, privacy=privacy, data=with_users, per_device_train_batch_size=2)


def test_user_level_clipping_on_two_processes_takes_the_steps_of_one(tmp_path):
    """Each user whole on one process and in one micro-batch; a process without users runs a padding row."""
    ids = torch.arange(N) // 3
    loader = flashdp.poisson_loader(
        records(), 2 / 8, collate_fn=default_data_collator, seed=SEED, users=ids, examples_per_user=2
    )
    users = [len(set(step_users.tolist())) for _, (_, step_users) in zip(range(STEPS), loader, strict=False)]
    assert min(users) <= 1 and max(users) >= 2, users  # a process without users; users on both processes
    one = _train_users(None, str(tmp_path / "one"))
    _assert_same_run(launch.run(_train_users, str(tmp_path / "ddp")), one)


def _train_secure(rank: int, out: str) -> dict:
    """Batches and noise from the OS CSPRNG: drawn by the main process, the same on both processes."""
    seen = []
    trainer = _trainer(out, {"secure_rng": True, "seed": None}, **launch.as_torchrun_process(rank))
    for batch in trainer.get_train_dataloader():
        seen.append(batch["input_ids"][:, 0].tolist())
        if len(seen) == STEPS:
            break
    trainer.train()
    return {"batches": seen, "params": [p.detach().clone() for p in trainer.model.parameters()]}


def test_secure_sampling_on_two_processes_draws_one_batch_for_both(tmp_path):
    first, second = launch.run(_train_secure, str(tmp_path))
    assert first["batches"] == second["batches"] and any(first["batches"])
    for p, q in zip(first["params"], second["params"], strict=True):
        assert torch.equal(p, q)
