"""A model whose steps repeat shapes already verified runs no verifying pass again: the structure flashdp keys its
trust on (layers, sizes, the graph's ops, the routings verified) must not change from step to step when nothing
that decides whose rows are whose does. A structure re-verified on every step costs bk two extra backward passes."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import transformers as tf
from torch import nn

import flashdp
from flashdp._pipeline import self_check
from tests.hf.zoo import DECODER, VOCAB, classification_loss, lm_loss
from tests.oracle import seeded

SHAPES = [(3, 4, False), (2, 4, True), (3, 6, True), (2, 6, False)]  # (B, T, padded)


def _batch(b: int, t: int, padded: bool, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, VOCAB, (b, t), generator=generator)
    mask = torch.ones(b, t, dtype=torch.long)
    if padded:
        mask[0, t // 2 :] = 0
    return ids, mask


def _gpt2_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, ids)


def _classifier_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return classification_loss(model(input_ids=ids, attention_mask=mask).logits, ids[:, 0] % 3)


MODELS = {
    "gpt2-lm": (
        lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=16)),
        _gpt2_loss,
    ),
    "llama-classifier": (  # logits[arange(B), last]: each batch size routes its own way
        lambda: tf.LlamaForSequenceClassification(tf.LlamaConfig(vocab_size=VOCAB, num_labels=3, pad_token_id=0,
                                                                 **DECODER)),
        _classifier_loss,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shapes_seen_before_are_not_verified_again(name):
    torch.manual_seed(0)
    build, loss_of = MODELS[name]
    model = build().train()  # (dropout on: the same ops every step)
    generator = seeded(0)
    engine = flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    counted = mock.patch.object(self_check, "batch_independence_failures", wraps=self_check.batch_independence_failures)
    with engine, counted as spy:
        for shape in SHAPES * 2:
            model.zero_grad()
            engine.backward(loss_of(model, *_batch(*shape, generator)))
        first_round = spy.call_count
        for shape in SHAPES:
            model.zero_grad()
            engine.backward(loss_of(model, *_batch(*shape, generator)))
    assert first_round >= 1
    assert spy.call_count == first_round, "a step of a shape verified before was verified again"
