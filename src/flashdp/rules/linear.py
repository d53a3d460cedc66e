"""Linear layers: `nn.Linear` (`y = x W^T + b`), HF's `Conv1D` (`y = x W + b`, GPT-2) and `nn.Bilinear`
(`y_k = x1^T W_k x2 + b_k`, a Linear on `x1 ⊗ x2`)."""

from __future__ import annotations

from torch import Tensor, nn

from flashdp.per_sample import OuterGrad, PerSampleGrad, accumulation_dtype
from flashdp.rules.registry import register_rule
from flashdp.rules.shapes import positions


def _linear_grads(
    x: Tensor, grad_output: Tensor, trainable: frozenset[str], *, transposed: bool, what: str
) -> dict[str, PerSampleGrad]:
    """Weight: `G_i^T A_i` (`[p, d]`), or `A_i^T G_i` (`[d, p]`) when `transposed`; bias `[p]`: `sum_t G_i[t]`.

    A: inputs `[B, T, d]`, G: output gradients `[B, T, p]`, every leading dim but the batch a position.
    """
    g = positions(grad_output, f"output gradient of {what}")
    out: dict[str, PerSampleGrad] = {}
    if "weight" in trainable:
        a = positions(x, f"input of {what}")
        out["weight"] = OuterGrad(a, g) if transposed else OuterGrad(g, a)
    if "bias" in trainable:
        out["bias"] = g.sum(1, dtype=accumulation_dtype(g))  # (not torch.promote_types: an op per call)
    return out


def linear_grads(module: nn.Linear, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """`G_i^T A_i` summed over positions, bias `sum G_i`; ghost norm (tiled) or direct, by cost model.

    Weight `[p, d]`, bias `[p]`."""
    return _linear_grads(inputs[0], grad_output, trainable, transposed=False, what="nn.Linear")


def hf_conv1d_grads(module: nn.Module, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """A Linear with a transposed weight: `A_i^T G_i`, bias `sum G_i`; ghost or direct norm.

    Weight `[d, p]`, bias `[p]`."""
    return _linear_grads(inputs[0], grad_output, trainable, transposed=True, what="Conv1D")


def bilinear_grads(module: nn.Bilinear, inputs: tuple, grad_output: Tensor, trainable: frozenset[str]):
    """A Linear on `x1 ⊗ x2`: weight `G_i^T (x1 ⊗ x2)_i`, bias `sum G_i`; ghost or direct norm.

    x1 `[B, *, d1]`, x2 `[B, *, d2]`: weight `[p, d1, d2]`, bias `[p]`."""
    x1, x2 = inputs
    outer = (x1.unsqueeze(-1) * x2.unsqueeze(-2)).flatten(-2)  # [B, *, d1 * d2]
    return _linear_grads(outer, grad_output, trainable, transposed=False, what="nn.Bilinear")


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


register_rule(nn.Linear, linear_grads, position_wise=True)
register_rule(nn.Bilinear, bilinear_grads, position_wise=True)
register_rule(is_hf_conv1d, hf_conv1d_grads, reference_forward=hf_conv1d_forward, position_wise=True)
