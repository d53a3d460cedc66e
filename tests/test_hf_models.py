"""HF transformers models built from configs (no downloads), exact against the oracle."""

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from tests.oracle import check_against_oracle

VOCAB, T, B = 37, 6, 3


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B] mean next-token cross entropy per sequence."""
    logits, targets = logits[:, :-1], ids[:, 1:]
    return nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def gpt2(tied: bool = True):
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
    )
    return GPT2LMHeadModel(config)


def llama(tied: bool):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def positions(ids: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids: each sample looks up its own position embeddings (not one [1, T] lookup broadcast)."""
    return torch.arange(ids.shape[1]).expand_as(ids)


def _check_lm(model, mode, clipping="flat"):
    model = model.double().eval()  # eval: no dropout; the oracle must see the same function
    ids = torch.randint(0, VOCAB, (B, T))

    def loss_of(s):
        return lm_loss(model(ids[s], position_ids=positions(ids[s])).logits, ids[s])

    norms = check_against_oracle(model, loss_of, B, mode=mode, clipping=clipping, rtol=1e-7)
    return model, norms


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_gpt2_with_tied_head(mode):
    model, _ = _check_lm(gpt2(), mode)
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("tied", [True, False])
def test_llama(mode, tied):
    model, _ = _check_lm(llama(tied), mode)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_llama_per_layer_clipping():
    _check_lm(llama(False), "bk", clipping="per_layer")


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_bert_classifier_with_padding_mask(mode):
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    model = BertForSequenceClassification(config).double().eval()
    ids = torch.randint(1, VOCAB, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0
    labels = torch.tensor([0, 2, 1])

    def loss_of(s):
        logits = model(input_ids=ids[s], attention_mask=mask[s], position_ids=positions(ids[s])).logits
        return nn.functional.cross_entropy(logits, labels[s], reduction="none")

    check_against_oracle(model, loss_of, B, mode=mode, rtol=1e-7)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_gpt2_without_position_ids_is_exact(mode):
    """HF looks up wpe with position_ids of shape [1, T] and broadcasts it over the batch."""
    model = gpt2().double().eval()
    ids = torch.randint(0, VOCAB, (B, T))
    check_against_oracle(model, lambda s: lm_loss(model(ids[s]).logits, ids[s]), B, mode=mode, rtol=1e-7)


def test_hf_model_keeps_working_after_make_private():
    import flashdp

    model = gpt2().eval()
    keys = list(model.state_dict())
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0):
        out = model.generate(torch.randint(0, VOCAB, (1, 3)), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 6)
        assert isinstance(model, GPT2LMHeadModel) and list(model.state_dict()) == keys


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, ffn_dim=12, num_attention_heads=2,
        max_position_embeddings=16, word_embed_proj_dim=8, dropout=0.0,
    )  # fmt: skip
    return OPTForCausalLM(config), lambda model, ids: model(ids)


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=16, dropout=0.0,
    )  # fmt: skip
    return BartForConditionalGeneration(config), lambda model, ids: model(input_ids=ids, decoder_input_ids=ids)


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12, num_mel_bins=4, max_source_positions=8,
        max_target_positions=16, dropout=0.0, pad_token_id=0, decoder_start_token_id=1,
    )  # fmt: skip
    return WhisperForConditionalGeneration(config), lambda model, ids: model(
        input_features=torch.sin(ids[:, :4, None] * torch.arange(1.0, 17.0)).to(model.dtype), decoder_input_ids=ids
    )


@pytest.mark.parametrize("batch, seq", [(3, 5), (4, 4)], ids=["T!=B", "T==B"])
@pytest.mark.parametrize("build", [_opt, _bart, _whisper], ids=["opt", "bart", "whisper"])
def test_embedding_subclasses_with_their_own_forward_are_exact(build, batch, seq):
    """Learned position embeddings that subclass nn.Embedding with another forward get the generic rule (Whisper's
    decoder positions, [T, d] without a batch dim, are also shared across the batch; BART's decoder positions are
    `[1, T, d]` from `[T]` ids, which are positions, not samples, where T equals B)."""
    model, run = build()
    model = model.double().eval()
    ids = torch.randint(2, VOCAB, (batch, seq))
    check_against_oracle(model, lambda s: run(model, ids[s]).logits.square().mean((1, 2)), batch, rtol=1e-7)
