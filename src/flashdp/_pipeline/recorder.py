"""Forward hooks that record, for each call of a trainable layer, references to its inputs and the gradient
edge of its output (taken before any later in-place op can move it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from flashdp._pipeline.scan import Layer
from flashdp.errors import FlashDPError

#: Relative error allowed when checking a module's forward against its rule's. It catches a different function
#: (errors of order 1), not rounding: HF norms compute in float32 even for float64 inputs.
_FORWARD_CHECK_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}


@dataclass(frozen=True)
class Call:
    """One forward call of a trainable layer.

    edge: where the norm pass takes the gradient of the output. For an output that is a full reshape of an
    internal tensor (nn.Linear on a 3-D input returns a view), the edge of that base: a later in-place op on the
    view (ReLU(inplace=True)) re-routes the graph around the view's own node, never around the base's.
    """

    layer: Layer
    inputs: tuple
    output: Tensor
    output_version: int
    edge: GradientEdge
    batch_size: int

    def grad_output(self, grad_at_edge: Tensor) -> Tensor:
        """The gradient at the edge, shaped like the output `[B, ...]`."""
        return grad_at_edge.view(self.output.shape)

    def modified_in_place(self) -> bool:
        return self.output._version != self.output_version


class Recorder:
    """Records calls made with gradients enabled; `take()` hands them over and forgets them."""

    def __init__(self, layers: list[Layer], on_call: Callable[[], None] = lambda: None) -> None:
        self.calls: list[Call] = []
        self._on_call = on_call
        self._checked: set[int] = set()
        self._handles = [
            layer.module.register_forward_hook(functools.partial(self._record, layer), with_kwargs=True)
            for layer in layers
        ]

    def _record(self, layer: Layer, module, args: tuple, kwargs: dict, output) -> None:
        if not torch.is_grad_enabled():
            return
        if not isinstance(output, Tensor):
            raise FlashDPError(
                f"Layer {layer.label} returned {type(output).__name__}; flashdp's rules expect one output tensor."
            )
        if not output.requires_grad:
            return
        if output.dim() == 0:
            raise FlashDPError(f"Layer {layer.label} returned a scalar; expected a batched output [B, ...].")
        self._on_call()
        inputs = args or tuple(kwargs.values())
        if layer.match.verify_with is not None and id(module) not in self._checked:
            _check_forward(layer, inputs, output)
            self._checked.add(id(module))
        edge = get_gradient_edge(_reshape_base(output))
        self.calls.append(Call(layer, inputs, output, output._version, edge, output.shape[0]))

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.calls = []


def _reshape_base(output: Tensor) -> Tensor:
    """The tensor `output` is a contiguous reshape of, if any; else `output`."""
    base = output._base
    if (
        base is not None
        and base.requires_grad
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
    ):
        return base
    return output


def _check_forward(layer: Layer, inputs: tuple, output: Tensor) -> None:
    """A module matched by duck typing, or overriding its class's forward, must compute what its rule assumes."""
    with torch.no_grad():
        expected = layer.match.verify_with(layer.module, inputs)
    tolerance = _FORWARD_CHECK_TOLERANCE.get(output.dtype, 3e-2)
    ok = expected.shape == output.shape
    if ok:
        error = (expected.double() - output.double()).norm() / output.double().norm().clamp_min(1e-30)
        ok = bool(error <= tolerance)
    if not ok:
        raise FlashDPError(
            f"Layer {layer.label} matched rule {layer.match.rule.name}, but its forward does not compute what that "
            "rule assumes (checked once on its first call), so its per-sample gradients would be wrong. Register a "
            "rule for its type with flashdp.register_rule(...)."
        )
