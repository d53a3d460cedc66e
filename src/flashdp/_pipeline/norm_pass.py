"""The norm pass: the gradient of the summed loss at every recorded call's output, in one autograd pass that
computes no parameter gradient, turned by each call's rule into per-sample gradients collected per parameter."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from flashdp._pipeline.param_grad import ParamGradient, StrategyChoice
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.recorder import Call
from flashdp._pipeline.scan import ModelScan
from flashdp.errors import FlashDPError


def output_gradients(loss: Tensor, calls: Sequence[Call], retain_graph: bool) -> tuple[Tensor | None, ...]:
    """`d sum(loss) / d output` of every call (None where the output does not reach the loss)."""
    return torch.autograd.grad(loss.sum(), [c.edge for c in calls], retain_graph=retain_graph, allow_unused=True)


def check_calls(calls: Sequence[Call], output_grads: Sequence[Tensor | None], batch: int) -> None:
    """Each call whose output reaches the loss was made on this batch, batch first, and its gradient is visible."""
    for call, grad_at_edge in zip(calls, output_grads, strict=True):
        if grad_at_edge is not None:
            _check_call_batch(call, batch)
        elif call.modified_in_place():
            raise call.hidden_by_in_place_error()


def per_param_gradients(
    scan: ModelScan,
    calls: Sequence[Call],
    output_grads: Sequence[Tensor | None],
    batch: int,
    strategy: StrategyChoice,
) -> list[tuple[TrainableParam, ParamGradient]]:
    """Every trainable parameter reached by the loss, with its per-sample contributions from every call (checked
    by `check_calls`)."""
    by_param: dict[Hashable, tuple[TrainableParam, ParamGradient]] = {}
    for call, grad_at_edge in zip(calls, output_grads, strict=True):
        layer = call.layer
        if grad_at_edge is None:
            continue  # this call's output does not reach the loss
        grad_output = call.grad_output(grad_at_edge)
        params = [scan.param_of[(id(layer.module), name)] for name in layer.trainable]
        if batch == 0:  # a rank without samples this step: nothing to add, but the same parameters as others
            per_sample = {n: grad_output.new_zeros(0, *p.shape) for n, p in zip(layer.trainable, params, strict=True)}
        else:
            per_sample = layer.match.rule.per_sample_grads(
                layer.module, call.inputs, grad_output, frozenset(layer.trainable)
            )
        missing = set(layer.trainable) - set(per_sample)
        if missing:
            raise FlashDPError(
                f"Rule {layer.match.rule.name} returned no per-sample gradient for {sorted(missing)} of layer "
                f"{layer.label}."
            )
        for name, param in zip(layer.trainable, params, strict=True):
            if param.key not in by_param:
                by_param[param.key] = (param, ParamGradient(param.name, param.shape, batch, strategy))
            by_param[param.key][1].add(per_sample[name], layer.label)
    if not by_param:
        raise FlashDPError(
            "The loss does not depend on any trainable layer recorded in the last forward pass: compute the "
            "per-sample losses from this model's output."
        )
    return list(by_param.values())


def _check_call_batch(call: Call, batch: int) -> None:
    if call.batch_size == 1 and batch > 1:
        raise FlashDPError(
            f"Layer {call.layer.label} was called on a batch of 1 while the loss has {batch} samples: its output "
            "was shared across the batch by broadcasting (e.g. position embeddings looked up with "
            "position_ids of shape [1, T]), so autograd only sees the gradient summed over samples. Give it "
            "each sample's own input (for HF models: position_ids=torch.arange(T).expand(B, T)) or freeze it."
        )
    if call.batch_size != batch:
        raise FlashDPError(
            f"Batch size mismatch: the loss has {batch} per-sample values, but layer {call.layer.label} was "
            f"called on a batch of {call.batch_size} (its output's first dim). flashdp needs the batch as "
            "the first dim of every layer's input and output, and one loss per sample."
        )
