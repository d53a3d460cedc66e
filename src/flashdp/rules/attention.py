"""`nn.MultiheadAttention` (and with it `nn.TransformerEncoderLayer` / `DecoderLayer`): both layouts, packed or
separate q/k/v projections, `bias_k` / `bias_v`, `add_zero_attn`, masks, attention weights in the loss, dropout
in training (the recomputation replays the forward's random draws).

Its projections are Linears inside `F.multi_head_attention_forward`, out of reach of hooks. The rule projects the
recorded inputs itself, re-runs the attention core on q, k, v (the functional with identity projections, so
masks, causal attention and zero-attention behave exactly as in the forward) and takes the gradients at q, k, v
and at the context the output projection reads. Each projection is then a Linear: `G_i^T A_i` per sample, normed
like any Linear (ghost or direct). Cost: one more attention forward and backward for the layer, batched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flashdp.per_sample import LayerCall, OuterGrad, PerSampleGrad, accumulation_dtype
from flashdp.rules.recompute import as_in_the_forward, check_recomputed, replayed_random_state, require_own_batch
from flashdp.rules.registry import register_rule

PARAMS = (
    "in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k", "bias_v",
    "out_proj.weight", "out_proj.bias",
)  # fmt: skip


def mha_grads(call: LayerCall) -> dict[str, PerSampleGrad]:
    """Each projection is a Linear: `G_i^T A_i` for q, k, v (packed: three groups) and out_proj, with the gradients
    at q, k, v from one batched recomputation of the attention; ghost or direct norm.

    The recorded query, key, value are `[L|S, B, *]` inside (batch-first modules are transposed as their forward
    does)."""
    module: nn.MultiheadAttention = call.module
    require_own_batch(call, "Attention layer")
    a = call.arguments()
    seq_first = (lambda x: x.transpose(0, 1)) if module.batch_first else (lambda x: x)
    query, key, value = (seq_first(a[n]).detach() for n in ("query", "key", "value"))
    q_w, k_w, v_w = _projection_weights(call)
    q_b, k_b, v_b = _projection_biases(call)
    out_w, out_b = call.tensor("out_proj.weight"), call.tensor("out_proj.bias")
    with torch.no_grad(), as_in_the_forward(call):  # (the projections as the forward ran them: under its autocast)
        q, k, v = (F.linear(x, w, b) for x, w, b in ((query, q_w, q_b), (key, k_w, k_b), (value, v_w, v_b)))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    key_padding_mask, attn_mask = a["key_padding_mask"], a["attn_mask"]
    extra = {}  # bias_k / bias_v: one key and value row per sample, appended as the functional would
    for name in ("bias_k", "bias_v"):
        bias = call.tensor(name)
        if bias is not None:
            extra[name] = bias.detach().expand(1, query.shape[1], -1).clone().requires_grad_()
    eye = torch.eye(module.embed_dim, dtype=q.dtype, device=q.device)
    dropout = module.dropout if call.rng_state is not None else 0.0  # (in training: the same masks, replayed)
    with as_in_the_forward(call), replayed_random_state(call), torch.enable_grad():
        if extra:
            k, v = torch.cat([k, extra["bias_k"]]), torch.cat([v, extra["bias_v"]])
            attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
            key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
        context, weights = F.multi_head_attention_forward(
            q, k, v, module.embed_dim, module.num_heads, None, None, None, None, module.add_zero_attn, dropout, eye,
            None, training=dropout > 0, key_padding_mask=key_padding_mask, need_weights=a["need_weights"],
            attn_mask=attn_mask, use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
            v_proj_weight=eye, average_attn_weights=a["average_attn_weights"], is_causal=a["is_causal"],
        )  # fmt: skip
    recorded = call.outputs[0] if call.output_meta[0].slot == 0 else None
    with as_in_the_forward(call):
        output = seq_first(F.linear(context.detach(), out_w, out_b))
    check_recomputed(call.label, recorded, output, "from q, k, v")

    g_out = call.grad_output(0)
    g_out = torch.zeros_like(context) if g_out is None else seq_first(g_out)  # [L, B, E]
    targets, cotangents = [context], [g_out.to(context.dtype) @ out_w.to(context.dtype)]
    g_weights = call.grad_output(1)
    if g_weights is not None and weights is not None:
        targets.append(weights)
        cotangents.append(g_weights.to(weights.dtype))
    inputs = [*leaves, *extra.values()]
    grads = torch.autograd.grad(targets, inputs, cotangents, allow_unused=True)
    g_q, g_k, g_v, *g_extra = (torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True))
    g_extra = dict(zip(extra, g_extra, strict=True))
    return _per_sample(call, (query, key, value), (g_q, g_k, g_v), g_extra, g_out, context)


def mha_call_support(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> str | None:
    query = args[0] if args else kwargs["query"]
    if query.dim() != 3:
        return (
            f"an unbatched query of shape {tuple(query.shape)}; flashdp needs batched inputs ([B, L, E] or [L, B, E])."
        )
    return None


def draws_dropout(module: nn.MultiheadAttention) -> bool:
    return module.training and module.dropout > 0


def _projection_weights(call: LayerCall) -> tuple[Tensor, Tensor, Tensor]:
    packed = call.tensor("in_proj_weight")
    if packed is not None:
        return packed.chunk(3)
    return call.tensor("q_proj_weight"), call.tensor("k_proj_weight"), call.tensor("v_proj_weight")


def _projection_biases(call: LayerCall) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    packed = call.tensor("in_proj_bias")
    return (None, None, None) if packed is None else packed.chunk(3)


def _per_sample(
    call: LayerCall,
    inputs: tuple[Tensor, Tensor, Tensor],
    grads: tuple[Tensor, Tensor, Tensor],
    extra: dict[str, Tensor],
    g_out: Tensor,
    context: Tensor,
) -> dict[str, PerSampleGrad]:
    """inputs, grads: query, key, value and the gradients at their projections, seq-first `[L|S, B, *]`; extra:
    the gradients at the appended bias_k / bias_v rows `[1, B, E]`; g_out, context: the output projection's output
    gradient and input `[L, B, E]`."""
    batch_first = lambda x: x.transpose(0, 1)  # noqa: E731
    per_param = {
        "out_proj.weight": lambda: OuterGrad(batch_first(g_out), batch_first(context.detach())),
        "out_proj.bias": lambda: _summed(g_out),
        "in_proj_weight": lambda: OuterGrad(_stacked(grads), _stacked(inputs), conv_groups=3),
        "in_proj_bias": lambda: torch.cat([_summed(g) for g in grads], 1),
        **{
            f"{p}_proj_weight": lambda g=g, x=x: OuterGrad(batch_first(g), batch_first(x))
            for p, g, x in zip("qkv", grads, inputs, strict=True)
        },
        **{name: lambda g=g: g.transpose(0, 1).unsqueeze(1) for name, g in extra.items()},  # [B, 1, 1, E]
    }
    return {name: per_param[name]() for name in call.params}


def _summed(g: Tensor) -> Tensor:
    """`[T, B, p]` -> `[B, p]`, summed over positions in float32 (float64 stays)."""
    return g.sum(0, dtype=accumulation_dtype(g))


def _stacked(xs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Three seq-first `[T_j, B, E]` -> `[B * 3, max T_j, E]`, row `b * 3 + j`, zero-padded in time."""
    length = max(x.shape[0] for x in xs)
    padded = torch.stack([F.pad(x, (0, 0, 0, 0, 0, length - x.shape[0])) for x in xs])
    return rearrange(padded, "j t b e -> (b j) t e")


def mha_batch_dims(module: nn.MultiheadAttention) -> tuple[int, int]:
    """Output `[B, L, E]` (batch_first) or `[L, B, E]`; attention weights `[B, (H,) L, S]`."""
    return (0 if module.batch_first else 1, 0)


register_rule(
    nn.MultiheadAttention,
    mha_grads,
    params=PARAMS,
    check_call=mha_call_support,
    random=draws_dropout,
    per_call=True,
    batch_dim=mha_batch_dims,
    recomputes=True,
)
