"""DPDPOTrainer: TRL's DPOTrainer trained with DP-SGD. Each preference record's loss is TRL's own for a batch of
one; a step equals the oracle's: every record's gradient of TRL's loss taken alone, clipped, summed, averaged."""

import copy

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from transformers import MixtralConfig, MixtralForCausalLM
from trl import DPOConfig

from flashdp import FlashDPError
from flashdp.integrations.transformers import PrivacyArguments
from flashdp.integrations.trl import DPDPOTrainer
from tests.integrations.test_trl import (
    COMPLETIONS,
    PROMPTS,
    assert_two_processes_take_the_steps_of_one,
    llama,
    tokenizer,
    trained,
)

C, LR, EXPECTED = 0.05, 0.1, 4


def preferences() -> Dataset:
    rejected = COMPLETIONS[1:] + COMPLETIONS[:1]
    return Dataset.from_dict({"prompt": PROMPTS * 2, "chosen": COMPLETIONS * 2, "rejected": rejected * 2})


def trainer(out, privacy=None, model=None, dataset=None, **config) -> DPDPOTrainer:
    settings = {
        "output_dir": str(out), "per_device_train_batch_size": 2, "max_steps": 1, "learning_rate": LR,
        "optim": "sgd", "lr_scheduler_type": "constant", "report_to": [], "use_cpu": True, "save_strategy": "no",
        "disable_tqdm": True, "logging_steps": 1, "bf16": False, "max_grad_norm": C, "beta": 0.5, **config,
    }  # fmt: skip
    privacy = privacy or PrivacyArguments(expected_batch_size=EXPECTED, noise_multiplier=0.0, seed=3)
    return DPDPOTrainer(
        model=model or llama(), ref_model=copy.deepcopy(model) if model else llama(), args=DPOConfig(**settings),
        train_dataset=dataset or preferences(),
        processing_class=tokenizer(), privacy=privacy,
    )  # fmt: skip


LOSSES = [
    {"loss_type": ["sigmoid"]},
    {"loss_type": ["hinge"]},
    {"loss_type": ["ipo"]},
    {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5]},
    {"loss_type": ["sigmoid"], "precompute_ref_log_probs": True},
]


def _trained_a_little(dpo: DPDPOTrainer) -> None:
    """The policy moved off the reference (at step 0 they are equal and every log-ratio is 0)."""
    with torch.no_grad():
        for p in dpo.model.parameters():
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize(
    "config",
    LOSSES,
    ids=lambda c: "+".join(c["loss_type"]) + ("-precomputed" if len(c) > 1 and "precompute_ref_log_probs" in c else ""),
)
def test_each_records_loss_is_trls_own_loss_for_a_batch_of_one(tmp_path, config):
    dpo = trainer(tmp_path, **config)
    torch.manual_seed(0)
    _trained_a_little(dpo)
    records = [dpo.train_dataset[i] for i in range(4)]
    ours, users = dpo.engine_losses(dpo.model, dpo.train_collator()(records), None)
    assert users.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and (ours[4:] == 0).all()
    for i, record in enumerate(records):
        theirs = dpo._compute_loss(dpo.model, dpo.data_collator([record]), return_outputs=False)
        torch.testing.assert_close(ours[i], theirs, rtol=1e-5, atol=1e-6)


def test_a_step_equals_the_oracle_on_trls_own_per_record_losses(tmp_path):
    """noise 0: the parameters after one step are `theta - lr * sum_i c_i g_i / expected_batch_size`, with g_i
    the gradient of TRL's loss on record i alone and c_i = min(1, C / ||g_i||), on a copy flashdp never touched."""
    dpo = trainer(tmp_path)
    torch.manual_seed(0)
    _trained_a_little(dpo)
    reference = copy.deepcopy(dpo.model)
    (batch,) = [b for _, b in zip(range(1), dpo.get_train_dataloader(), strict=False)]
    assert len(batch["record_in_batch"]) > 2, "micro-batches of 2: the step spans several"
    oracle = trainer(tmp_path)  # its _compute_loss, on the copy
    params = [p for p in reference.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(batch["record_in_batch"])):
        record = {key: value[i : i + 1] for key, value in batch.items()}
        rows = {
            k: torch.cat([record[f"chosen_{k}"], record[f"rejected_{k}"]])
            for k in ("input_ids", "attention_mask", "completion_mask")
        }
        grads = torch.autograd.grad(oracle._compute_loss(reference, rows, return_outputs=False), params)
        norm = torch.cat([g.flatten() for g in grads]).norm()
        for t, g in zip(total, grads, strict=True):
            t.add_(g * min(1.0, C / (norm.item() + 1e-6)))
    dpo.train()
    for (name, p), start, t in zip(dpo.model.named_parameters(), params, total, strict=True):
        torch.testing.assert_close(p, start - LR * t / EXPECTED, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "setting, name",
    [
        ({"loss_type": ["aot"]}, "loss_type"),
        ({"loss_type": ["sft"]}, "loss_type"),
        ({"f_divergence_type": "js_divergence"}, "f_divergence_type"),
        ({"ld_alpha": 0.5}, "ld_alpha"),
        ({"use_weighting": True}, "use_weighting"),
    ],
)
def test_losses_that_mix_records_or_that_it_does_not_compute_are_refused(tmp_path, setting, name):
    with pytest.raises(FlashDPError, match=f"not supported: {name}"):
        trainer(tmp_path, **setting)


def _dpo_run(rank: int | None, out: str) -> dict:
    """DPDPOTrainer for 3 steps (noise on), alone or (with `rank`) on process `rank` of 2."""
    from tests.distributed import launch

    privacy = PrivacyArguments(expected_batch_size=3, noise_multiplier=0.7, seed=5)
    return trained(
        trainer(out, privacy, max_steps=3, per_device_train_batch_size=1, **launch.as_torchrun_process(rank))
    )


def test_two_processes_take_the_steps_of_one(tmp_path):
    """Records shared across 2 processes, a process without records in a micro-batch running a padding record."""
    assert_two_processes_take_the_steps_of_one(_dpo_run, tmp_path)


def test_reference_columns_in_the_data_are_read_only_when_trl_precomputed_them(tmp_path):
    """A dataset carrying ref_chosen_logps / ref_rejected_logps (saved by an earlier run) without
    precompute_ref_log_probs: TRL scores against its reference model, and so must DPDPOTrainer."""
    stale = preferences().add_column("ref_chosen_logps", [5.0] * 12).add_column("ref_rejected_logps", [-5.0] * 12)
    dpo = trainer(tmp_path, dataset=stale)
    torch.manual_seed(0)
    _trained_a_little(dpo)
    records = [dpo.train_dataset[i] for i in range(3)]
    assert "ref_chosen_logps" in dpo.train_collator()(records), "the collator passes the columns through"
    ours, _ = dpo.engine_losses(dpo.model, dpo.train_collator()(records), None)
    for i, record in enumerate(records):
        theirs = dpo._compute_loss(dpo.model, dpo.data_collator([record]), return_outputs=False)
        torch.testing.assert_close(ours[i], theirs, rtol=1e-5, atol=1e-6)


def test_a_routers_auxiliary_loss_is_refused(tmp_path):
    """TRL adds a mixture-of-experts router's load-balancing loss (a statistic of the batch) wherever the model has
    a router and router_aux_loss_coef != 0, whatever config.output_router_logits says."""
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1,
        router_aux_loss_coef=0.01,
    )  # fmt: skip
    assert not config.output_router_logits
    with pytest.raises(FlashDPError, match="not supported: router_aux_loss_coef"):
        trainer(tmp_path, model=MixtralForCausalLM(config))
