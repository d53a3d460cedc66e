"""Routed experts of mixture-of-experts layers, as Hugging Face transformers 5 stores them (Mixtral, Qwen2-MoE, OLMoE,
GraniteMoE, DeepSeek-V2, Jamba, GPT-OSS): one module holding every expert's weights, `gate_up_proj` `[E, 2I, d]`
and `down_proj` `[E, d, I]` (transposed, and with biases, in GPT-OSS), called on the batch's tokens `x` `[N, d]`
with each token's `K` experts `top_k_index` `[N, K]` and routing weights `top_k_weights` `[N, K]`:

    out_t = sum_k w_tk * (down_e gate(gate_up_e x_t + b1_e) + b2_e),   e = top_k_index[t, k]

with the module's own gating `gate` (`act(h_gate) * h_up`; GPT-OSS's clamped, interleaved one).

Expert e's weights are a Linear on the tokens routed to it, so a sample's gradient of expert e is a sum of outer
products over that sample's tokens routed to e: `down_proj[e]`: `sum_t dy_te a_te^T` with `dy_te = w_te g_t` and
`a_te` the expert's hidden activation; `gate_up_proj[e]`: `sum_t dh_te x_t^T`, `dh_te` the gradient at its first
projection. Every expert is one group of an `OuterGrad` (`conv_groups = E`), so the norms (ghost or direct) and the
clipped sums are the Linear's, exact in bk, ghost and flash. Tokens not routed to an expert have `dy = 0` there and
add nothing; an expert no token of a sample reached gets a zero gradient for that sample.

The tokens come folded into rows (`N = B * T`, sample-major); the engine hands them to the rule as `[B, T, ...]`.
Each sample's tokens routed to expert e are gathered into rows (padded to the most any sample routed to one
expert, one host sync per call) and the expert's activations recomputed on them, batched over experts: about the
experts' own forward FLOPs again, times the padding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashdp.per_sample import OuterGrad, PerSampleGrad
from flashdp.rules.registry import register_rule

_WEIGHTS = {"gate_up_proj", "down_proj"}
_BIASES = {"gate_up_proj_bias", "down_proj_bias"}


def is_routed_experts(module: nn.Module) -> bool:
    """transformers' experts module: `gate_up_proj` `[E, 2I, d]` and `down_proj` `[E, d, I]` (`[E, d, 2I]` and
    `[E, I, d]` where `is_transposed`), with biases `[E, 2I]` and `[E, d]` where `has_bias`, a gating function, and
    no other parameter."""
    params = dict(module.named_parameters(recurse=False))
    biased = bool(getattr(module, "has_bias", False))
    if set(params) != (_WEIGHTS | _BIASES if biased else _WEIGHTS):
        return False
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return False
    if not hasattr(module, "_apply_gate") and not (hasattr(module, "act_fn") and getattr(module, "is_concatenated", 1)):
        return False
    gate_up, down = _weights(module)
    return (
        gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
    )


def _weights(module: nn.Module) -> tuple[Tensor, Tensor]:
    """`gate_up_proj` as `[E, 2I, d]` and `down_proj` as `[E, d, I]` (views of the transposed layout)."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        return gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def _bias(module: nn.Module, name: str, e: int) -> Tensor | float:
    return getattr(module, name)[e] if getattr(module, "has_bias", False) else 0.0


def _gate(module: nn.Module, gate_up: Tensor) -> Tensor:
    """`[..., 2I]` -> `[..., I]`: the module's own gating (transformers' `_apply_gate`: act(gate) * up)."""
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _hits(top_k_index: Tensor, experts: int) -> Tensor:
    """`[..., K, E]` whether each of a token's K choices is expert e; indices outside `[0, E)` (transformers' marker
    of a dropped token) route nowhere."""
    return top_k_index.unsqueeze(-1) == torch.arange(experts, device=top_k_index.device)


def _routing(hits: Tensor, top_k_weights: Tensor) -> Tensor:
    """`[..., E]` each token's routing weight per expert (0 where not routed), from its `_hits` and `[..., K]`
    weights."""
    return (top_k_weights.unsqueeze(-1) * hits).sum(-2)


def routed_experts_forward(module: nn.Module, inputs: tuple) -> Tensor:
    """The forward the rule assumes: `[N, d]` -> `[N, d]`, every expert on every token, weighted by its routing."""
    x, top_k_index, top_k_weights = inputs
    gate_up, down = _weights(module)
    routing = _routing(_hits(top_k_index, gate_up.shape[0]), top_k_weights)  # [N, E]
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        hidden = _gate(module, x @ gate_up[e].T + _bias(module, "gate_up_proj_bias", e))
        y = hidden @ down[e].T + _bias(module, "down_proj_bias", e)
        out = out + routing[..., e, None].to(x.dtype) * y
    return out


def routed_experts_grads(
    module: nn.Module, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, PerSampleGrad]:
    """Per expert e, the rows of sample b's tokens routed to e: `dy = w g` and the recomputed activations;
    `down_proj` from `dy` and `a`, `gate_up_proj` from `dh` and `x` (OuterGrads of E groups: row `b * E + e`),
    biases `[B, E, *]` as sums of `dh` and `dy` over those rows.

    x `[B, T, d]`, top_k_index / top_k_weights `[B, T, K]`, g `[B, T, d]`."""
    x, top_k_index, top_k_weights = (_as_tokens(t) for t in inputs)
    g = _as_tokens(grad_output)
    gate_up, down = (w.detach() for w in _weights(module))  # [E, 2I, d], [E, d, I]
    experts = gate_up.shape[0]
    rows, weights = _routed_rows(top_k_index, top_k_weights, experts)  # [B, E, R]
    xs, gs = (_gather(t, rows) for t in (x, g))  # [B, E, R, d]
    dy = gs * weights.to(gs.dtype)[..., None]
    # (under autocast the activations are 16-bit and the weights not: recomputed in the wider of the two)
    wide = torch.promote_types(xs.dtype, gate_up.dtype)
    with torch.enable_grad():
        projected = torch.einsum("berd,eod->bero", xs.to(wide), gate_up.to(wide))
        if getattr(module, "has_bias", False):
            projected = projected + module.gate_up_proj_bias.detach()[:, None, :]
        projected = projected.detach().requires_grad_()
        hidden = _gate(module, projected)  # [B, E, R, I]
        (dh,) = torch.autograd.grad(hidden, projected, torch.einsum("berd,edi->beri", dy.to(wide), down.to(wide)))
    dy, hidden, dh, xs = (t.flatten(0, 1) for t in (dy, hidden.detach(), dh, xs))  # [B * E, R, *]
    transposed = getattr(module, "is_transposed", False)
    grads: dict[str, PerSampleGrad] = {
        "down_proj": OuterGrad(hidden, dy, experts) if transposed else OuterGrad(dy, hidden, experts),
        "gate_up_proj": OuterGrad(xs, dh, experts) if transposed else OuterGrad(dh, xs, experts),
    }
    if getattr(module, "has_bias", False):
        grads |= {"down_proj_bias": _token_sums(dy, experts), "gate_up_proj_bias": _token_sums(dh, experts)}
    return {name: grad for name, grad in grads.items() if name in trainable}


def _routed_rows(top_k_index: Tensor, top_k_weights: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """Per sample and expert, the positions of the tokens routed to it, first `[B, E, R]` (R: the most any sample
    routed to one expert; one host sync), and their routing weights (0 in the padding, whose position is 0).
    top_k_index, top_k_weights: `[B, T, K]`."""
    hits = _hits(top_k_index, experts)  # [B, T, K, E]
    weights = _routing(hits, top_k_weights).transpose(1, 2)  # [B, E, T]
    routed = hits.any(2).transpose(1, 2)  # [B, E, T]
    width = max(int(routed.sum(2).max()), 1) if routed.numel() else 1
    # routed positions first, in token order (a stable sort of "not routed")
    order = torch.sort((~routed).to(torch.int8), dim=2, stable=True).indices[..., :width]
    kept = routed.gather(2, order)
    return order * kept, weights.gather(2, order) * kept


def _gather(t: Tensor, rows: Tensor) -> Tensor:
    """`[B, T, k]` -> `[B, E, R, k]`: the rows at `rows` `[B, E, R]`."""
    batch, experts, width = rows.shape
    index = rows.reshape(batch, experts * width, 1).expand(-1, -1, t.shape[2])
    return t.gather(1, index).view(batch, experts, width, t.shape[2])


def _token_sums(rows: Tensor, experts: int) -> Tensor:
    """`[B * E, R, k]` -> `[B, E, k]`: each sample's sum over its routed rows, per expert."""
    sums = rows.sum(1, dtype=torch.promote_types(rows.dtype, torch.float32))
    return sums.view(-1, experts, rows.shape[2])


def _as_tokens(t: Tensor) -> Tensor:
    """`[B, T, k]`: a sample's tokens (one token per sample arrives as `[B, k]`)."""
    return t if t.dim() == 3 else t.unsqueeze(1)


register_rule(is_routed_experts, routed_experts_grads, reference_forward=routed_experts_forward)
