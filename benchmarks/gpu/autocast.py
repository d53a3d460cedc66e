"""HF models trained under bf16 autocast on CUDA: flashdp's per-sample norms against float64 (needs a GPU).

    python benchmarks/gpu/autocast.py
    python benchmarks/gpu/autocast.py --device cpu --modes bk ghost     # a dry run on the CPU

GPT-2, Llama, BERT and ViT from small configs (d=128, float32 weights, B=4), each in bk, ghost and flash with the
self-check on, their forward under `torch.autocast("cuda", torch.bfloat16)`. The oracle: every sample's gradient
alone, in float64 without autocast. The yardstick: the same per-sample gradients computed by PyTorch alone under
autocast. A mode is "ok" when its norms' largest relative error is at most twice PyTorch's plus 1e-3.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import flashdp

B, T = 4, 64


def models(device: str) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    import transformers as tf

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (B, T))
    small = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256}
    build = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=1000, hidden_size=128, **small)),
        "bert": lambda: tf.BertForSequenceClassification(
            tf.BertConfig(vocab_size=1000, hidden_size=128, num_labels=3, hidden_dropout_prob=0.0, **small)
        ),
        "vit": lambda: tf.ViTForImageClassification(
            tf.ViTConfig(image_size=32, patch_size=4, hidden_size=128, num_labels=3, hidden_dropout_prob=0.0, **small)
        ),
    }
    inputs = {"gpt2": ids, "llama": ids, "bert": ids, "vit": torch.randn(B, 3, 32, 32)}
    return {name: (make().to(device).eval(), inputs[name].to(device)) for name, make in build.items()}


def per_sample_loss(model: nn.Module, name: str, x: torch.Tensor, first: int = 0) -> torch.Tensor:
    """`[b]` the loss of each sample of `x`, samples `first, first + 1, ...` of the batch."""
    if name in ("gpt2", "llama"):
        return flashdp.per_sample_lm_loss(model(x).logits.float(), x)
    labels = (torch.arange(len(x), device=x.device) + first) % 3
    out = model(input_ids=x) if name == "bert" else model(pixel_values=x)
    return nn.functional.cross_entropy(out.logits.float(), labels, reduction="none")


def one_at_a_time(model: nn.Module, name: str, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    """`[B]` float64 norms of the per-sample gradients, each sample's backward alone."""
    norms = []
    for i in range(len(x)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            loss = per_sample_loss(model, name, x[i : i + 1], first=i)
        loss.sum().backward()
        grads = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
        norms.append(torch.cat(grads).norm())
    model.zero_grad(set_to_none=True)
    return torch.stack(norms)


def flashdp_norms(model: nn.Module, name: str, x: torch.Tensor, mode: str) -> torch.Tensor:
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        with torch.autocast(x.device.type, torch.bfloat16):
            loss = per_sample_loss(model, name, x)
        norms = engine.backward(loss)
    model.zero_grad(set_to_none=True)
    return norms.double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", default=["bk", "ghost", "flash"])
    args = parser.parse_args()
    print("| model | mode | max rel. error of the norms | PyTorch's under autocast | ok |\n|---|---|---|---|---|")
    for name, (model, x) in models(args.device).items():
        exact = one_at_a_time(model.double(), name, x if name != "vit" else x.double(), autocast=False)
        model.float()
        torch_error = ((one_at_a_time(model, name, x, autocast=True) - exact).abs() / exact).max().item()
        for mode in args.modes:
            try:
                error = ((flashdp_norms(model, name, x, mode) - exact).abs() / exact).max().item()
                verdict = error <= 2 * torch_error + 1e-3
                print(f"| {name} | {mode} | {error:.2e} | {torch_error:.2e} | {verdict} |", flush=True)
            except Exception as failure:  # a failing mode is a finding; the others still run
                print(f"| {name} | {mode} | {type(failure).__name__}: {str(failure)[:300]} | | False |", flush=True)


if __name__ == "__main__":
    main()
