"""DPSFTTrainer: TRL's SFTTrainer trained with DP-SGD, on prompt-completion records (completion-only labels),
step for step equal to flashdp's own loop on the same batches, each record's loss TRL's own for a batch of one."""

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig

import flashdp
from flashdp import FlashDPError
from flashdp.integrations.transformers import PrivacyArguments
from flashdp.integrations.trl import DPSFTTrainer

CHARS = "abcdefghijklmnopqrstuvwxyz ?."
PROMPTS = ["what is a?", "say b.", "hi there?", "who?", "name it.", "why not?"]
COMPLETIONS = [" a is a.", " b", " hello there", " me", " it", " because"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built here (no download): <pad> 0, <eos> 1, then the characters."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    model.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>")


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(CHARS) + 2, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def records() -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS * 3, "completion": COMPLETIONS * 3})


def trainer(out, model=None, privacy=None, peft_config=None, **config) -> DPSFTTrainer:
    settings = {
        "output_dir": str(out), "per_device_train_batch_size": 2, "max_steps": 3, "learning_rate": 0.1,
        "optim": "sgd", "lr_scheduler_type": "constant", "report_to": [], "use_cpu": True, "save_strategy": "no",
        "disable_tqdm": True, "logging_steps": 1, "bf16": False, **config,
    }  # fmt: skip
    arguments = privacy or PrivacyArguments(expected_batch_size=4, noise_multiplier=0.8, seed=11)
    return DPSFTTrainer(
        model=model or llama(), args=SFTConfig(**settings), train_dataset=records(), processing_class=tokenizer(),
        privacy=arguments, peft_config=peft_config,
    )  # fmt: skip


def test_dp_sft_takes_the_same_steps_as_flashdps_own_loop(tmp_path):
    sft = trainer(tmp_path)
    own = llama()  # the same weights (a deepcopy of sft.model would share the forward SFTTrainer wrapped)
    batches = [batch for _, batch in zip(range(3), sft.get_train_dataloader(), strict=False)]
    assert any((b["labels"] == -100).any() and (b["labels"] != -100).any() for b in batches), "completion-only labels"
    sft.train()

    optimizer = torch.optim.SGD(own.parameters(), lr=0.1)
    engine = flashdp.make_private(
        own, max_grad_norm=1.0, noise_multiplier=0.8, optimizer=optimizer, expected_batch_size=4,
        sample_rate=4 / len(records()), seed=11,
    )  # fmt: skip
    for batch in batches:
        for micro in flashdp.micro_batches(batch, 2):
            if len(micro["labels"]) == 0:
                engine.backward_empty()
                continue
            logits = own(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
            engine.backward(flashdp.per_sample_lm_loss(logits, micro["labels"]))
        engine.step()
    for (name, p), q in zip(sft.model.named_parameters(), own.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert sft.engine.steps == 3 and sft.engine.epsilon(1e-5) == engine.epsilon(1e-5)


def test_each_records_loss_is_trls_own_loss_for_a_batch_of_one(tmp_path):
    sft = trainer(tmp_path)
    collated = sft.data_collator([sft.train_dataset[i] for i in range(len(PROMPTS))])
    per_sample = sft.per_sample_loss(sft.model, dict(collated))
    for i in range(len(PROMPTS)):
        one = sft.data_collator([sft.train_dataset[i]])
        torch.testing.assert_close(per_sample[i], sft.compute_loss(sft.model, dict(one)), rtol=1e-5, atol=1e-6)


def test_a_lora_adapter_is_all_that_trains(tmp_path):
    base = llama()
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    sft = trainer(tmp_path, model=base, peft_config=lora)
    sft.train()
    trained = {name for name, p in sft.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    for name, p in sft.model.get_base_model().named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            torch.testing.assert_close(p, before[key], rtol=0, atol=0, msg=name)
    assert sft.engine.steps == 3


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"loss_type": "dft"}, "would be ignored: loss_type"),
        ({"label_smoothing_factor": 0.2}, "would be ignored: label_smoothing_factor"),
    ],
)
def test_settings_of_a_loss_dpsft_does_not_compute_are_refused(tmp_path, setting, message):
    with pytest.raises(FlashDPError, match=message):
        trainer(tmp_path, **setting)


@pytest.mark.parametrize("option", ["packing", "padding_free"])
def test_several_records_in_one_row_are_refused(tmp_path, option):
    with pytest.raises(FlashDPError, match=f"{option}=True\\) puts several training records in one row"):
        trainer(tmp_path, **{option: True}, **({"max_length": None} if option == "padding_free" else {}))


def test_activation_offloading_is_refused(tmp_path):
    """(SFTTrainer itself builds offloading only on CUDA: the check is called on a trainer built without it.)"""
    sft = trainer(tmp_path)
    sft.args.activation_offloading = True
    with pytest.raises(FlashDPError, match=r"activation_offloading=True\) is not supported"):
        sft._check_arguments()


def trained(trainer) -> dict:
    """Train; the parameters and the logged losses."""
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, "losses": losses}


def assert_two_processes_take_the_steps_of_one(run, tmp_path) -> None:
    """`run(rank, out)` alone (rank None) and on 2 gloo processes: equal logged losses and parameters."""
    from tests.distributed import launch

    one = run(None, str(tmp_path / "one"))
    for rank in launch.run(run, str(tmp_path / "ddp")):
        assert rank["losses"] == pytest.approx(one["losses"], rel=1e-5)
        for name, p in one["params"].items():
            torch.testing.assert_close(rank["params"][name], p, msg=name)


def _sft_run(rank: int | None, out: str) -> dict:
    """DPSFTTrainer for 3 steps, alone or (with `rank`) on process `rank` of 2."""
    from tests.distributed import launch

    return trained(trainer(out, per_device_train_batch_size=1, **launch.as_torchrun_process(rank)))


def test_two_processes_take_the_steps_of_one(tmp_path):
    assert_two_processes_take_the_steps_of_one(_sft_run, tmp_path)
