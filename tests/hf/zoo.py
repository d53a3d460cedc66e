"""Tiny configs of the HF models users fine-tune, each with the per-sample loss its model card implies, and inputs
fixed per sample (the oracle runs each sample alone). No downloads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as tf
from torch import nn

from tests.oracle import seeded

VOCAB, T, B = 29, 5, 3
DROPOUT_FREE = {
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "dropout": 0.0, "attention_dropout": 0.0,
    "activation_dropout": 0.0,
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """A model and `loss(model, batch slice) -> [b]` on data fixed once."""

    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, slice], torch.Tensor]
    #: float64, except where a kernel the model calls has no float64 (Mixtral's grouped GEMM)
    dtype: torch.dtype = torch.float64


def _ids(low: int = 2) -> torch.Tensor:
    return torch.randint(low, VOCAB, (B, T), generator=seeded(0))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, reduction="none")


LABELS = torch.tensor([0, 2, 1])


def causal_lm(config_class, model_class=None, **config) -> Case:
    """Called as the model card calls it for training: ids only (no position_ids), no cache."""
    ids = _ids()
    model_class = model_class or getattr(tf, config_class.__name__.replace("Config", "ForCausalLM"))
    build = lambda: model_class(config_class(vocab_size=VOCAB, **config))  # noqa: E731
    return Case(build, lambda m, s: lm_loss(m(ids[s], use_cache=False).logits, ids[s]))


def classifier(config_class, model_class, **config) -> Case:
    """Called as the model card calls it: ids and attention mask only (no position_ids)."""
    ids = _ids()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:] = 0
    build = lambda: model_class(config_class(vocab_size=VOCAB, num_labels=3, **config))  # noqa: E731
    return Case(build, lambda m, s: classification_loss(m(input_ids=ids[s], attention_mask=mask[s]).logits, LABELS[s]))


def _masked_lm() -> Case:
    """BERT-MLM: its LM head holds the decoder's bias as its own parameter too."""
    ids = _ids()
    build = lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=VOCAB, **ENCODER))  # noqa: E731

    def loss(m, s):
        logits = m(input_ids=ids[s]).logits
        return nn.functional.cross_entropy(logits.transpose(1, 2), ids[s], reduction="none").mean(1)

    return Case(build, loss)


def _vision(config_class, model_class, **config) -> Case:
    pixels = torch.randn(B, 3, 8, 8, generator=seeded(0))
    build = lambda: model_class(config_class(num_labels=3, **config))  # noqa: E731
    return Case(build, lambda m, s: classification_loss(m(pixel_values=pixels[s].to(m.dtype)).logits, LABELS[s]))


def _clip() -> Case:
    ids, pixels = _ids(), torch.randn(B, 3, 8, 8, generator=seeded(0))
    text = {"vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 8, **DROPOUT_FREE}  # fmt: skip
    vision = {"hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 4, **DROPOUT_FREE}  # fmt: skip
    build = lambda: tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))  # noqa: E731

    def loss(m, s):  # each sample's own image-text similarity (a batch contrastive loss would mix samples)
        out = m(input_ids=ids[s], pixel_values=pixels[s].to(m.dtype))
        return -(out.text_embeds * out.image_embeds).sum(1)

    return Case(build, loss)


def _seq2seq(config_class, model_class, **config) -> Case:
    ids = _ids()
    build = lambda: model_class(config_class(vocab_size=VOCAB, **config))  # noqa: E731
    return Case(build, lambda m, s: lm_loss(m(input_ids=ids[s], decoder_input_ids=ids[s]).logits, ids[s]))


def _whisper() -> Case:
    ids = _ids()
    features = torch.sin(ids[:, :4, None] * torch.arange(1.0, 17.0))
    config = tf.WhisperConfig(
        vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12, num_mel_bins=4, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, decoder_start_token_id=1, **DROPOUT_FREE,
    )  # fmt: skip
    build = lambda: tf.WhisperForConditionalGeneration(config)  # noqa: E731
    return Case(
        build,
        lambda m, s: lm_loss(m(input_features=features[s].to(m.dtype), decoder_input_ids=ids[s]).logits, ids[s]),
    )


def _float32(case: Case) -> Case:
    return Case(case.build, case.loss, torch.float32)


DECODER = {"hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "max_position_embeddings": 16}  # fmt: skip
ENCODER = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 12,
           "max_position_embeddings": 16, **DROPOUT_FREE}  # fmt: skip

CASES: dict[str, Callable[[], Case]] = {
    "gpt2": lambda: causal_lm(tf.GPT2Config, tf.GPT2LMHeadModel, n_embd=8, n_layer=1, n_head=2, n_positions=16,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neo": lambda: causal_lm(tf.GPTNeoConfig, hidden_size=8, num_layers=2, num_heads=2,
                                 attention_types=[[["global", "local"], 1]], max_position_embeddings=16,
                                 window_size=4, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),
    "llama": lambda: causal_lm(tf.LlamaConfig, **DECODER),
    "mistral": lambda: causal_lm(tf.MistralConfig, **DECODER),
    "qwen2": lambda: causal_lm(tf.Qwen2Config, **DECODER),
    "gemma": lambda: causal_lm(tf.GemmaConfig, head_dim=4, **DECODER),
    "gemma2": lambda: causal_lm(tf.Gemma2Config, head_dim=4, query_pre_attn_scalar=4, **DECODER),
    "gemma3": lambda: causal_lm(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, head_dim=4, query_pre_attn_scalar=4,
                                **DECODER),
    "phi3": lambda: causal_lm(tf.Phi3Config, pad_token_id=0, **DECODER),
    "mamba": lambda: causal_lm(tf.MambaConfig, hidden_size=8, state_size=4, num_hidden_layers=1, expand=2,
                               conv_kernel=3),
    "opt": lambda: causal_lm(tf.OPTConfig, hidden_size=8, num_hidden_layers=1, ffn_dim=12, num_attention_heads=2,
                             max_position_embeddings=16, word_embed_proj_dim=8, dropout=0.0),
    "bert": lambda: classifier(tf.BertConfig, tf.BertForSequenceClassification, **ENCODER),
    "roberta": lambda: classifier(tf.RobertaConfig, tf.RobertaForSequenceClassification, pad_token_id=1,
                                  **ENCODER | {"max_position_embeddings": 20}),
    "albert": lambda: classifier(tf.AlbertConfig, tf.AlbertForSequenceClassification, embedding_size=8, **ENCODER),
    "distilbert": lambda: classifier(tf.DistilBertConfig, tf.DistilBertForSequenceClassification, dim=8,
                                     n_layers=1, n_heads=2, hidden_dim=12, max_position_embeddings=16, dropout=0.0,
                                     attention_dropout=0.0, seq_classif_dropout=0.0),
    "deberta_v3": lambda: classifier(tf.DebertaV2Config, tf.DebertaV2ForSequenceClassification,
                                     relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"],
                                     **ENCODER),
    "vit": lambda: _vision(tf.ViTConfig, tf.ViTForImageClassification, hidden_size=8, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=12, image_size=8, patch_size=4, **DROPOUT_FREE),
    "clip": _clip,
    "t5": lambda: _seq2seq(tf.T5Config, tf.T5ForConditionalGeneration, d_model=8, d_kv=4, d_ff=12, num_layers=2,
                           num_heads=2, dropout_rate=0.0, decoder_start_token_id=0),
    "bart": lambda: _seq2seq(tf.BartConfig, tf.BartForConditionalGeneration, d_model=8, encoder_layers=1,
                             decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                             encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=16, **DROPOUT_FREE),
    "whisper": _whisper,
    "bert_mlm": _masked_lm,
    "xlnet": lambda: classifier(tf.XLNetConfig, tf.XLNetForSequenceClassification, d_model=8, n_layer=1, n_head=2,
                                d_inner=12, dropout=0.0),
    "deit": lambda: _vision(tf.DeiTConfig, tf.DeiTForImageClassification, hidden_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=12, image_size=8, patch_size=4, **DROPOUT_FREE),
    "mbart": lambda: _seq2seq(tf.MBartConfig, tf.MBartForConditionalGeneration, d_model=8, encoder_layers=1,
                              decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                              encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=16, **DROPOUT_FREE),
    "beit": lambda: _vision(tf.BeitConfig, tf.BeitForImageClassification, hidden_size=8, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=12, image_size=8, patch_size=4,
                            use_relative_position_bias=True, **DROPOUT_FREE),
    "biogpt": lambda: causal_lm(tf.BioGptConfig, **ENCODER, pad_token_id=1, layerdrop=0.0),
    "swin": lambda: _vision(tf.SwinConfig, tf.SwinForImageClassification, image_size=8, patch_size=2, embed_dim=8,
                            depths=[2, 1], num_heads=[2, 2], window_size=2, mlp_ratio=1.5, drop_path_rate=0.0,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "cohere": lambda: causal_lm(tf.CohereConfig, **DECODER),
    "mixtral": lambda: _float32(causal_lm(tf.MixtralConfig, num_local_experts=4, num_experts_per_tok=2, **DECODER)),
}  # fmt: skip


def _peft(name: str) -> Case:
    """A tiny Llama with a PEFT adapter: only the adapter is trainable."""
    import peft

    ids = _ids()
    adapters = {
        "lora": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "embed_tokens"]),
        "dora": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_dora=True),
        "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
    }

    def build() -> nn.Module:
        base = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, **DECODER))
        return peft.get_peft_model(base, adapters[name]())

    def loss(m, s):
        logits = m(input_ids=ids[s], use_cache=False).logits
        return lm_loss(logits[:, -T:], ids[s])  # prompt tuning prepends its virtual tokens

    return Case(build, loss)


PEFT_CASES: dict[str, Callable[[], Case]] = {
    name: lambda name=name: _peft(name) for name in ("lora", "dora", "prompt_tuning")
}


def _audio(config_class, model_class) -> Case:
    """wav2vec2-style: raw audio through a convolutional feature encoder and a positional convolution (under
    weight_norm, a torch parametrization)."""
    wave = torch.randn(B, 400, generator=seeded(0))
    config = config_class(
        num_labels=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0,
        **DROPOUT_FREE,
    )  # fmt: skip
    return Case(
        lambda: model_class(config),
        lambda m, s: classification_loss(m(input_values=wave[s].to(m.dtype)).logits, LABELS[s]),
    )


#: more architectures whose learnt layouts, shared outputs or parametrizations depend on the batch shape; tested
#: over step sequences (tests/hf/test_zoo.py)
STEP_CASES: dict[str, Callable[[], Case]] = {
    "umt5": lambda: _seq2seq(tf.UMT5Config, tf.UMT5ForConditionalGeneration, d_model=8, d_kv=4, d_ff=12,
                             num_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0),
    "mpnet": lambda: classifier(tf.MPNetConfig, tf.MPNetForSequenceClassification, **ENCODER),
    "longformer": lambda: classifier(tf.LongformerConfig, tf.LongformerForSequenceClassification, attention_window=4,
                                     pad_token_id=1, **ENCODER | {"max_position_embeddings": 20}),
    "wav2vec2": lambda: _audio(tf.Wav2Vec2Config, tf.Wav2Vec2ForSequenceClassification),
    "hubert": lambda: _audio(tf.HubertConfig, tf.HubertForSequenceClassification),
}  # fmt: skip
