"""PEFT LoRA: only the adapters are private (and trained), exact against the oracle; HF methods keep working."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

import flashdp
from tests.oracle import check_against_oracle
from tests.test_hf_models import VOCAB, llama, positions


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_lora_adapters_exact_against_the_oracle(mode):
    model = get_peft_model(llama(tied=False), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    model = model.double().eval()
    with torch.no_grad():  # LoRA's B starts at zero; give the adapters a real gradient path
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.randint(0, VOCAB, (3, 6))

    def loss_of(s):
        out = model(input_ids=ids[s], position_ids=positions(ids[s]))
        return flashdp.per_sample_lm_loss(out.logits, ids[s])

    check_against_oracle(model, loss_of, 3, mode=mode, rtol=1e-7)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_save_pretrained_and_generate_after_make_private(tmp_path):
    model = get_peft_model(llama(tied=True), LoraConfig(r=2, target_modules=["q_proj"])).eval()
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0):
        model.save_pretrained(tmp_path)
        out = model.generate(input_ids=torch.randint(0, VOCAB, (1, 3)), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5)
    assert (tmp_path / "adapter_config.json").exists()
