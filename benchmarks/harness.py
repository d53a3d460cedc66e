"""One training step per mode, built the same way for every library, so that modes are timed side by side.

`make_step(model_name, mode, seq, batch)` returns a zero-argument callable doing forward, per-sample loss,
backward and optimizer step (with noise for the DP modes) on fixed data.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import flashdp
from benchmarks.models import LlamaLike, SmallCNN, WideResNet

MODES = ("non-private", "flashdp-bk", "flashdp-ghost", "flashdp-flash", "opacus-ghost", "opacus-hooks")
VOCAB = 4096


def unavailable(mode: str) -> str | None:
    """Why a mode cannot run on this machine, or None."""
    if mode == "flashdp-flash" and not torch.cuda.is_available():
        return "flash needs a GPU (on CPU its kernels run only in Triton's interpreter, a correctness tool)"
    if mode.startswith("opacus"):
        try:
            import opacus  # noqa: F401
        except ImportError:
            return "opacus is not installed (pip install opacus)"
    return None


#: models reading token ids (the rest read 3-channel images)
TOKEN_MODELS = ("llama", "t5", "mixtral", "gpt2", "bert")


def data(model_name: str, seq: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's input and the targets. seq: tokens per sequence, or image side in pixels. BERT: ids 1.. with
    each sequence padded by zeros after a random length in [seq / 2, seq], a binary label per sequence."""
    generator = torch.Generator().manual_seed(0)
    if model_name == "bert":
        ids = torch.randint(1, VOCAB, (batch, seq), generator=generator)
        lengths = torch.randint(seq // 2, seq + 1, (batch, 1), generator=generator)
        ids = ids.masked_fill(torch.arange(seq) >= lengths, 0)
        return ids.to(device), torch.randint(0, 2, (batch,), generator=generator).to(device)
    if model_name in TOKEN_MODELS:
        vocab = T5_SMALL["vocab_size"] if model_name == "t5" else VOCAB
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)  # Opacus views the ids
    classes = 1000 if model_name == "vit" else 10
    images = torch.randn(batch, 3, seq, seq, generator=generator)
    return images.to(device), torch.randint(0, classes, (batch,), generator=generator).to(device)


#: HF T5-small's shape (t5-small on the Hub), randomly initialised
T5_SMALL = {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8}
#: a small Mixtral-shaped decoder (8 experts, top-2), transformers' eager experts
MIXTRAL_SMALL = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
                 "num_experts_per_tok": 2, "experts_implementation": "eager"}  # fmt: skip
#: HF ViT-Base/16's shape (google/vit-base-patch16-224), randomly initialised
VIT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
            "image_size": 224, "patch_size": 16, "num_labels": 1000}  # fmt: skip
#: the small transformers of DP benchmarks: ViT on 64 px images, BERT classifier, GPT-2 LM (tied head)
VIT_SMALL = {"hidden_size": 192, "num_hidden_layers": 6, "num_attention_heads": 3, "intermediate_size": 768,
             "image_size": 64, "patch_size": 8, "num_labels": 10}  # fmt: skip
BERT_SMALL = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 1024, "num_labels": 2, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0}  # fmt: skip
GPT2_SMALL = {"vocab_size": VOCAB, "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 1024,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip


class Logits(torch.nn.Module):
    """An HF model called as its model card calls it, returning its logits (one forward signature for every
    library timed). T5: the decoder reads the same ids (teacher forcing on a copy task). BERT: id 0 is padding."""

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind in ("vit", "vitsmall"):
            return self.model(pixel_values=x).logits
        if self.kind == "bert":
            return self.model(input_ids=x, attention_mask=(x != 0).long()).logits
        if self.kind in ("mixtral", "gpt2"):
            return self.model(input_ids=x, use_cache=False).logits
        return self.model(input_ids=x, decoder_input_ids=x).logits


def _hf_model(model_name: str) -> torch.nn.Module:
    import transformers as tf

    config, model_class = {
        "vit": lambda: (tf.ViTConfig(**VIT_BASE), tf.ViTForImageClassification),
        "vitsmall": lambda: (tf.ViTConfig(**VIT_SMALL), tf.ViTForImageClassification),
        "bert": lambda: (tf.BertConfig(**BERT_SMALL), tf.BertForSequenceClassification),
        "gpt2": lambda: (tf.GPT2Config(**GPT2_SMALL), tf.GPT2LMHeadModel),
        "t5": lambda: (
            tf.T5Config(**T5_SMALL, dropout_rate=0.0, decoder_start_token_id=0),
            tf.T5ForConditionalGeneration,
        ),
        "mixtral": lambda: (tf.MixtralConfig(**MIXTRAL_SMALL), tf.MixtralForCausalLM),
    }[model_name]()
    return Logits(model_class(config), model_name)


def build_model(model_name: str, device: str, checkpointing: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_name in ("vit", "vitsmall", "bert", "gpt2", "t5", "mixtral"):
        return _hf_model(model_name).to(device)
    if model_name == "wrn":
        return WideResNet().to(device)
    return (LlamaLike(checkpointing=checkpointing) if model_name == "llama" else SmallCNN()).to(device)


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B]: mean cross entropy over each sequence's tokens (or the one label of an image)."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
    return F.cross_entropy(logits, targets, reduction="none")


def make_step(
    model_name: str, mode: str, seq: int, batch: int, device: str = "cpu", checkpointing: bool = False
) -> Callable[[], None]:
    """checkpointing: the Llama-like decoder's blocks are checkpointed (not with Opacus, whose hooks would see each
    block's forward twice)."""
    if checkpointing and mode.startswith("opacus"):
        raise ValueError("Opacus does not support activation checkpointing")
    model = build_model(model_name, device, checkpointing)
    x, y = data(model_name, seq, batch, device)
    if mode.startswith("opacus"):
        return _opacus_step(model, mode, x, y, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode == "non-private":

        def step() -> None:
            per_sample_loss(model(x), y).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    engine = flashdp.make_private(
        model, mode=mode.removeprefix("flashdp-"), max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer,
        expected_batch_size=batch, sample_rate=0.01,
    )  # fmt: skip

    def dp_step() -> None:
        engine.backward(per_sample_loss(model(x), y))
        engine.step()

    return dp_step


def _opacus_step(model, mode, x, y, batch) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "expected_batch_size": batch, "loss_reduction": "mean"}
    if mode == "opacus-hooks":
        module = GradSampleModule(model, loss_reduction="mean")
        optimizer = DPOptimizer(sgd, **dp)

        def hooks_step() -> None:
            per_sample_loss(module(x), y).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        return hooks_step
    module = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(sgd, **dp)
    criterion = DPLossFastGradientClipping(module, optimizer, torch.nn.CrossEntropyLoss(reduction="mean"))

    def ghost_step() -> None:
        logits = module(x)
        if logits.dim() == 3:
            loss = criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape[:2])
        else:
            loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return ghost_step


def interleaved_times(steps: dict[str, Callable[[], None]], rounds: int, device: str = "cpu") -> dict[str, list[float]]:
    """Each step's time in ms over `rounds` interleaved rounds (one of each step per round, in order), so that drift
    on a shared machine hits them alike; the device synchronised around each step. Warm the steps up first."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
