"""Linear layers: `nn.Linear` (`y = x W^T + b`) and HF's `Conv1D` (`y = x W + b`, GPT-2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashdp.rules.grads import OuterGrad, PerSampleGrad
from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import positions


def _bias(grad_output: Tensor) -> Tensor:
    """`[B, T, p]` -> `[B, p]`: a bias's per-sample gradient `sum_t g_t`."""
    return grad_output.sum(1, dtype=torch.promote_types(grad_output.dtype, torch.float32))


def linear_grads(
    module: nn.Linear, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, PerSampleGrad]:
    """Weight `[p, d]`: `G_i^T A_i` with A `[B, T, d]`, G `[B, T, p]`; bias `[p]`: `sum_t G_i[t]`."""
    g = positions(grad_output, "output gradient of nn.Linear")
    out: dict[str, PerSampleGrad] = {}
    if "weight" in trainable:
        out["weight"] = OuterGrad(g, positions(inputs[0], "input of nn.Linear"))
    if "bias" in trainable:
        out["bias"] = _bias(g)
    return out


def hf_conv1d_grads(
    module: nn.Module, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]
) -> dict[str, PerSampleGrad]:
    """HF `Conv1D`: weight `[d, p]` gets `A_i^T G_i`; bias as Linear."""
    g = positions(grad_output, "output gradient of Conv1D")
    out: dict[str, PerSampleGrad] = {}
    if "weight" in trainable:
        out["weight"] = OuterGrad(positions(inputs[0], "input of Conv1D"), g)
    if "bias" in trainable:
        out["bias"] = _bias(g)
    return out


def is_hf_conv1d(module: nn.Module) -> bool:
    """HF transformers' `Conv1D` (GPT-2, GPT): a Linear with a transposed `[nx, nf]` weight."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and getattr(module, "nf", None) == weight.shape[1]
    )


def hf_conv1d_forward(module: nn.Module, inputs: tuple) -> Tensor:
    (x,) = inputs
    y = x @ module.weight
    return y if module.bias is None else y + module.bias


register_rule(nn.Linear, linear_grads)
register_rule(is_hf_conv1d, hf_conv1d_grads, reference_forward=hf_conv1d_forward)
