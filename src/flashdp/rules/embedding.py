"""`nn.Embedding`: the per-sample gradient scatters `g_t` into row `x_t`; its norm comes from segment sums."""

from __future__ import annotations

from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.per_sample import OuterGrad, TokenRows
from flashdp.rules.registry import register_rule


def embedding_grads(
    module: nn.Embedding, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, OuterGrad]:
    """Weight `[V, d]`: `onehot(x_i)^T G_i` with ids `[B, T]`, G `[B, T, d]`; `padding_idx` rows get nothing."""
    ids = inputs[0]
    if ids.dim() < 1 or ids.is_floating_point():
        raise FlashDPError(
            f"Wrong input: nn.Embedding expects integer ids batched as [B, ...]. Received a {ids.dim()}-dim "
            f"{ids.dtype} tensor."
        )
    batch = ids.shape[0]
    ids = ids.reshape(batch, -1)
    g = grad_output.reshape(batch, -1, grad_output.shape[-1])
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {"weight": OuterGrad(TokenRows(ids, module.num_embeddings), g)}


def embedding_support(module: nn.Embedding) -> str | None:
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq=True scales gradients by batch-wide token counts, which mixes samples"
    if module.sparse:
        return "sparse=True gradients are not supported; use sparse=False"
    return None


register_rule(nn.Embedding, embedding_grads, check=embedding_support)
