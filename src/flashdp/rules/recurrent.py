"""`nn.LSTM`, `nn.GRU`, `nn.RNN`: stacked, bidirectional, either layout, LSTM projections (`proj_size`).

Each step is two Linears, `a_t = W_ih x_t + b_ih` and `c_t = W_hh h_{t-1} + b_hh`, then the cell. The rule re-runs
the recurrence on the recorded inputs (the layer's own fused kernel hides a_t and c_t), takes the gradients at
every a_t and c_t (and at every h_t, for the projection) in one backward, and counts each weight as a Linear:
`G_i^T A_i` per sample, summed over time, normed like any Linear. Cost: one more forward and backward of the layer,
step by step. Packed sequences are refused (pad them instead), as is dropout between layers in training.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from flashdp.per_sample import LayerCall, OuterGrad, PerSampleGrad, accumulation_dtype
from flashdp.rules.recompute import as_in_the_forward, check_recomputed, require_own_batch
from flashdp.rules.registry import register_rule


@dataclass
class _Direction:
    """One layer and direction of the recurrence, seq-first: what its weights' per-sample gradients need."""

    suffix: str  # of its parameter names: "_l0", "_l1_reverse", ...
    inputs: Tensor  # x_t `[T, B, in]`
    pre_input: Tensor  # a_t `[T, B, G]`
    previous: list[Tensor]  # h_{t-1} per step `[B, H_out]`, in the order computed
    pre_hidden: list[Tensor]  # c_t per step `[B, G]`
    cells: list[Tensor]  # LSTM with projection: m_t per step `[B, H]`, else empty
    hidden: list[Tensor]  # h_t per step `[B, H_out]`


def recurrent_grads(call: LayerCall) -> dict[str, PerSampleGrad]:
    """Each step is two Linears: `G^T A` summed over time for W_ih, W_hh (and an LSTM's projection), with the
    gradients at every pre-activation from one recomputation of the recurrence, step by step; ghost or direct
    norm."""
    module: nn.RNNBase = call.module
    require_own_batch(call, "Recurrent layer")
    x, state = _inputs(call)
    seq_first = (lambda t: t.transpose(0, 1)) if module.batch_first else (lambda t: t)
    with as_in_the_forward(call), torch.enable_grad():
        output, last, directions = _unrolled(call, seq_first(x.detach()), state)
        output = seq_first(output)
    recorded = call.outputs[0] if call.output_meta[0].slot == 0 else None
    check_recomputed(call.label, recorded, output, "step by step")
    targets, cotangents = [], []
    for slot, value in enumerate([output, *last]):
        grad = call.grad_output(slot)
        if grad is not None:
            targets.append(value)
            cotangents.append(grad.to(value.dtype))
    directions = [d for d in directions if any(name.endswith(d.suffix) for name in call.params)]
    wanted = [t for d in directions for t in (d.pre_input, *d.pre_hidden, *(d.hidden if d.cells else ()))]
    grads = iter(torch.autograd.grad(targets, wanted, cotangents, allow_unused=True))
    out: dict[str, PerSampleGrad] = {}
    for d in directions:
        g_input = _or_zeros(next(grads), d.pre_input)  # [T, B, G]
        g_hidden = torch.stack([_or_zeros(next(grads), c) for c in d.pre_hidden])  # [T, B, G]
        g_output = torch.stack([_or_zeros(next(grads), h) for h in d.hidden]) if d.cells else None  # [T, B, H_out]
        out |= _direction_grads(d, g_input, g_hidden, g_output, call.params.keys())
    return out


def _direction_grads(
    d: _Direction, g_input: Tensor, g_hidden: Tensor, g_output: Tensor | None, names: Iterable[str]
) -> dict[str, PerSampleGrad]:
    """The per-sample gradients of one layer and direction's weights that are in `names`."""
    per_param = {
        f"weight_ih{d.suffix}": lambda: OuterGrad(g_input.transpose(0, 1), d.inputs.detach().transpose(0, 1)),
        f"weight_hh{d.suffix}": lambda: OuterGrad(g_hidden.transpose(0, 1), _steps(d.previous)),
        f"bias_ih{d.suffix}": lambda: g_input.sum(0, dtype=accumulation_dtype(g_input)),
        f"bias_hh{d.suffix}": lambda: g_hidden.sum(0, dtype=accumulation_dtype(g_hidden)),
        f"weight_hr{d.suffix}": lambda: OuterGrad(g_output.transpose(0, 1), _steps(d.cells)),
    }
    return {name: per_param[name]() for name in names if name in per_param}


def _inputs(call: LayerCall) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor] | None]:
    a = call.arguments()
    return a["input"], a["hx"]


def recurrent_call_support(module: nn.RNNBase, args: tuple, kwargs: dict) -> str | None:
    x = [*args, *kwargs.values()][0]
    if isinstance(x, PackedSequence):
        return (
            "called on a PackedSequence, whose rows are not samples: flashdp cannot take it apart by sample. Pad "
            "the batch instead (pad_packed_sequence, or the padded tensor you packed) and mask the padded steps in "
            "the loss, or freeze the layer."
        )
    if x.dim() != 3:
        return f"an unbatched input of shape {tuple(x.shape)}; flashdp needs a batch ([B, T, d] or [T, B, d])."
    if module.training and module.dropout > 0 and module.num_layers > 1:
        return (
            f"dropout={module.dropout} between its layers in training mode: its per-sample gradients need the "
            "recurrence recomputed, and dropout would draw another mask. Set its dropout to 0 (or apply nn.Dropout "
            "outside the layer)."
        )
    return None


def _unrolled(call: LayerCall, x: Tensor, state: object) -> tuple[Tensor, list[Tensor], list[_Direction]]:
    """The recurrence step by step on seq-first x `[T, B, in]`: the output `[T, B, D * H_out]`, the final states
    (h_n, and c_n for an LSTM) `[L * D, B, *]`, and each layer and direction's intermediates."""
    module: nn.RNNBase = call.module
    lstm = module.mode == "LSTM"
    h0, c0 = (state if lstm else (state, None)) if state is not None else (None, None)
    batch = x.shape[1]
    final_h, final_c, directions = [], [], []
    layer_input = x
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(2 if module.bidirectional else 1):
            index = len(directions)
            h = h0[index].detach() if h0 is not None else x.new_zeros(batch, module.proj_size or module.hidden_size)
            c = c0[index].detach() if c0 is not None else x.new_zeros(batch, module.hidden_size)
            suffix = f"_l{layer}{'_reverse' if direction else ''}"
            d, c = _run_direction(call, suffix, layer_input, h, c if lstm else None, reverse=bool(direction))
            directions.append(d)
            final_h.append(d.hidden[-1] if d.hidden else h)
            final_c.append(c)
            outputs.append(torch.stack(d.hidden[::-1] if direction else d.hidden) if d.hidden else layer_input[..., :0])
        layer_input = torch.cat(outputs, -1)
    last = [torch.stack(final_h)] + ([torch.stack(final_c)] if lstm else [])
    return layer_input, last, directions


def _run_direction(
    call: LayerCall, suffix: str, x: Tensor, h: Tensor, c: Tensor | None, reverse: bool
) -> tuple[_Direction, Tensor | None]:
    """One layer in one direction over x `[T, B, in]` from states h `[B, H_out]` (and c `[B, H]`); the last cell
    state (LSTM)."""
    module: nn.RNNBase = call.module
    w_ih, w_hh = call.tensor(f"weight_ih{suffix}"), call.tensor(f"weight_hh{suffix}")
    b_ih, b_hh = call.tensor(f"bias_ih{suffix}"), call.tensor(f"bias_hh{suffix}")
    w_hr = call.tensor(f"weight_hr{suffix}")
    d = _Direction(suffix, x, _tracked(F.linear(x, w_ih, b_ih)), [], [], [], [])
    for t in reversed(range(x.shape[0])) if reverse else range(x.shape[0]):
        d.previous.append(h)
        pre_hidden = _tracked(F.linear(h, w_hh, b_hh))
        d.pre_hidden.append(pre_hidden)
        if module.mode == "LSTM":
            i, f, g, o = (d.pre_input[t] + pre_hidden).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            if w_hr is not None:
                d.cells.append(h)
                h = F.linear(h, w_hr)
        elif module.mode == "GRU":
            a_r, a_z, a_n = d.pre_input[t].chunk(3, -1)
            c_r, c_z, c_n = pre_hidden.chunk(3, -1)
            r, z = torch.sigmoid(a_r + c_r), torch.sigmoid(a_z + c_z)
            h = (1 - z) * torch.tanh(a_n + r * c_n) + z * h
        else:
            h = (torch.tanh if module.mode == "RNN_TANH" else torch.relu)(d.pre_input[t] + pre_hidden)
        d.hidden.append(h)
    return d, c


def _tracked(x: Tensor) -> Tensor:
    """x, made part of the graph where frozen weights and inputs left it out (its gradient is wanted)."""
    return x if x.requires_grad else x.requires_grad_()


def _steps(xs: list[Tensor]) -> Tensor:
    """Per-step `[B, k]` tensors -> `[B, T, k]`, detached (the right factor of an OuterGrad)."""
    return torch.stack(xs, 1).detach()


def _or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def recurrent_batch_dims(module: nn.RNNBase) -> tuple[int, ...]:
    """Output `[B, T, *]` (batch_first) or `[T, B, *]`; h_n (and c_n) `[L * D, B, *]`."""
    return (0 if module.batch_first else 1, 1, 1)


for _layer in (nn.LSTM, nn.GRU, nn.RNN):
    register_rule(
        _layer,
        recurrent_grads,
        check_call=recurrent_call_support,
        per_call=True,
        batch_dim=recurrent_batch_dims,
        recomputes=True,
    )
