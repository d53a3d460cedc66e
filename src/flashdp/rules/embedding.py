"""`nn.Embedding` and `nn.EmbeddingBag`: the per-sample gradient scatters `g_t` (times the bag's weight of each
token) into row `x_t`; its norm comes from segment sums over equal ids."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.per_sample import LayerCall, OuterGrad, TokenRows
from flashdp.rules.recompute import require_own_batch
from flashdp.rules.registry import register_rule


def embedding_grads(
    module: nn.Embedding, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, OuterGrad]:
    """`onehot(ids_i)^T G_i`, padding_idx rows excluded; norm by segment sums over equal ids, never a `[B, V, d]`
    tensor.

    Weight `[V, d]`, ids `[B, T]`, G `[B, T, d]`."""
    ids = inputs[0]
    if ids.dim() < 1 or ids.is_floating_point():
        raise FlashDPError(
            f"Wrong input: nn.Embedding expects integer ids batched as [B, ...]. Received a {ids.dim()}-dim "
            f"{ids.dtype} tensor."
        )
    batch = ids.shape[0]
    ids = ids.reshape(batch, -1)
    g = grad_output.reshape(batch, -1, grad_output.shape[-1])
    padding = _padding_row(module)
    if padding is not None:
        g = g * (ids != padding).unsqueeze(-1).to(g.dtype)
    return {"weight": OuterGrad(TokenRows(ids, module.num_embeddings), g)}


def embedding_bag_grads(call: LayerCall) -> dict[str, OuterGrad]:
    """Bag b's `sum_n w_bn onehot(x_bn)^T g_b` (w: per_sample_weights, 1 / bag size for "mean", 0 for
    padding_idx), bags as rows of a 2-D input or between offsets; norm by segment sums.

    Weight `[V, d]`, G `[B, d]`."""
    require_own_batch(call, "Embedding bag")
    module: nn.EmbeddingBag = call.module
    a = call.arguments(nn.EmbeddingBag)
    grad_output = call.grad_output(0)
    ids, weights, valid = _bags(module, a["input"], a["offsets"], a["per_sample_weights"], grad_output.shape[0])
    padding = _padding_row(module)
    if padding is not None:
        valid = valid & (ids != padding)
    coefficient = valid.to(grad_output.dtype) if weights is None else weights.to(grad_output.dtype) * valid
    if module.mode == "mean":
        coefficient = coefficient / valid.sum(1, keepdim=True).clamp_min(1)
    right = coefficient.unsqueeze(-1) * grad_output.unsqueeze(1)  # [B, N, d]
    return {"weight": OuterGrad(TokenRows(ids, module.num_embeddings), right)}


def _padding_row(module: nn.Embedding | nn.EmbeddingBag) -> int | None:
    """The row `padding_idx` names, as the forward reads it: a negative index counts from the end (the constructor
    makes it non-negative; an assignment after it may not)."""
    index = module.padding_idx
    return index + module.num_embeddings if index is not None and index < 0 else index


def _bags(
    module: nn.EmbeddingBag, ids: Tensor, offsets: Tensor | None, weights: Tensor | None, batch: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Bags as padded rows: ids `[B, N]`, their per-sample weights (or None) and which entries are real."""
    if ids.dim() == 2:
        return ids, weights, torch.ones_like(ids, dtype=torch.bool)
    ends = torch.cat([offsets[1:], offsets.new_tensor([ids.shape[0]])])[:batch]
    starts = offsets[:batch]
    if module.include_last_offset:
        ends = offsets[1 : batch + 1]
    sizes = ends - starts
    width = int(sizes.max()) if batch else 0
    index = starts[:, None] + torch.arange(width, device=ids.device)
    valid = torch.arange(width, device=ids.device) < sizes[:, None]
    index = torch.where(valid, index, 0).clamp_max(max(ids.shape[0] - 1, 0))
    padded_weights = None if weights is None else weights[index]
    return ids[index] if ids.numel() else index, padded_weights, valid


def embedding_bag_support(module: nn.EmbeddingBag) -> str | None:
    if module.mode == "max":
        return "mode='max' is not supported (its gradient picks a row per feature); use 'sum' or 'mean'"
    return embedding_support(module)


#: why a table with max_norm is refused, trainable or frozen (`plan.scan_model` refuses any at make_private)
RENORM_LEAK = (
    "renormalises, in the forward and in place, the rows a batch looks up, outside the noisy update (a frozen table "
    "too): the table tells which tokens the private batch held, and a table read elsewhere (a tied head) reads "
    "rows other samples renormalised. Set max_norm=None; to bound the rows' norms, renormalise every row once "
    "before training and, for a trained table, after each step (with torch.no_grad(): "
    "weight.renorm_(2, 0, max_norm))"
)


def labelled_tables(model: nn.Module) -> list[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
    """The model's embedding tables, each with the label refusals name it by: `'path' (Type)`."""
    return [
        (f"'{path}' ({type(m).__name__})", m)
        for path, m in model.named_modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    ]


def embedding_support(module: nn.Embedding) -> str | None:
    if module.max_norm is not None:
        return f"max_norm={module.max_norm} {RENORM_LEAK}"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq=True scales gradients by batch-wide token counts, which mixes samples"
    if module.sparse:
        return "sparse=True gradients are not supported; use sparse=False"
    return None


register_rule(nn.Embedding, embedding_grads, check=embedding_support, position_wise=True)
register_rule(nn.EmbeddingBag, embedding_bag_grads, check=embedding_bag_support, per_call=True)
