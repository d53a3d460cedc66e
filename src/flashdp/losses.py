"""Per-sample losses for language models: one loss per sequence, as `engine.backward` needs."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flashdp.errors import FlashDPError


def per_sample_lm_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    attention_mask: Tensor | None = None,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum"] = "mean",
    shift: bool = True,
) -> Tensor:
    """`[B]` next-token cross entropy per sequence, over its valid tokens only.

    Args:
        logits: `[B, T, V]`.
        labels: `[B, T]` target ids; positions equal to `ignore_index` do not count.
        attention_mask: `[B, T]`, 0 where the input is padding; those positions do not count either.
        reduction: "mean" over each sequence's valid tokens (0 for a sequence with none) or "sum".
        shift: predict token t+1 from position t (HF causal LMs take `labels=input_ids` this way).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise FlashDPError(
            f"Wrong shape: expected logits [B, T, V] and labels [B, T]. Received logits {tuple(logits.shape)} and "
            f"labels {tuple(labels.shape)}."
        )
    if reduction not in ("mean", "sum"):
        raise FlashDPError(f"reduction must be 'mean' or 'sum'. Received {reduction!r}.")
    valid = labels != ignore_index
    if attention_mask is not None:
        valid = valid & attention_mask.bool()
    if shift:
        logits, labels, valid = logits[:, :-1], labels[:, 1:], valid[:, 1:]
    targets = labels.masked_fill(~valid, 0)
    if logits.dtype in (torch.float16, torch.bfloat16):  # (16-bit logits: the softmax in float32; float64 stays)
        logits = logits.float()
    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    total = (token_loss * valid).sum(1)
    if reduction == "sum":
        return total
    return total / valid.sum(1).clamp(min=1)
