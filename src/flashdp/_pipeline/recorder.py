"""Forward hooks that record, for each call of a trainable layer, references to its inputs, the parameters it
held, and the gradient edge of its output (taken before any later in-place op can move it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_leaves

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
    #: the positional inputs (or, without any, the keyword inputs' values), as the layer's rule takes them
    inputs: tuple
    #: the gradient edges of every tensor input (positional and keyword) that requires grad: where the call's
    #: part of the autograd graph ends
    input_edges: tuple[GradientEdge, ...]
    #: the layer's trainable parameters as it held them during the call (wrappers may swap them afterwards)
    params: tuple[Tensor, ...]
    output: Tensor
    output_version: int
    edge: GradientEdge
    batch_size: int

    def grad_output(self, grad_at_edge: Tensor) -> Tensor:
        """The gradient at the edge, shaped like the output `[B, ...]`."""
        return grad_at_edge.view(self.output.shape)

    def modified_in_place(self) -> bool:
        return self.output._version != self.output_version

    def hidden_by_in_place_error(self) -> FlashDPError:
        return FlashDPError(
            f"The output of layer {self.layer.label} was modified in place after the layer returned it (e.g. "
            "ReLU(inplace=True) or `out += x`), which hides its gradient. Make that operation out of place "
            "(inplace=False, `out = out + x`)."
        )


class Recorder:
    """Records calls made with gradients enabled, outside any backward pass (a non-reentrant checkpoint
    recomputes its segment inside the backward: those calls are not the forward's); `take()` hands them over
    and forgets them."""

    def __init__(self, layers: list[Layer], on_call: Callable[[], None] = lambda: None) -> None:
        self.calls: list[Call] = []
        self._on_call = on_call
        self._verified: set[int] = set()
        # prepend: run before a wrapper's own post-forward hook (FSDP2 reshards its parameters there)
        self._handles = [
            layer.module.register_forward_hook(_Hook(self, layer), with_kwargs=True, prepend=True) for layer in layers
        ]

    def record(self, layer: Layer, args: tuple, kwargs: dict, output: object) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
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
        input_edges = tuple(
            get_gradient_edge(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.requires_grad
        )
        if layer.match.verify_with is not None and id(layer.module) not in self._verified:
            _check_forward(layer, inputs, output)
            self._verified.add(id(layer.module))
        params = tuple(getattr(layer.module, name) for name in layer.trainable)
        edge = get_gradient_edge(_reshape_base(output))
        self.calls.append(Call(layer, inputs, input_edges, params, output, output._version, edge, output.shape[0]))

    def take(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.calls = []


class _Hook:
    """The forward hook of one layer. Copying or pickling a model while attached (copy.deepcopy, torch.save)
    copies its hooks: the copy gets an inert hook, so it is plain PyTorch and holds none of the engine's state."""

    def __init__(self, recorder: Recorder, layer: Layer) -> None:
        self.recorder = recorder
        self.layer = layer

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        self.recorder.record(self.layer, args, kwargs, output)

    def __reduce__(self) -> tuple:
        return (_inert_hook, ())


def _inert_hook() -> Callable[..., None]:
    return _ignore


def _ignore(*_: object) -> None:
    return None


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


@torch.no_grad()  # entirely: inside a checkpointed region, a saved tensor would break the recomputation
def _check_forward(layer: Layer, inputs: tuple, output: Tensor) -> None:
    """A module matched by duck typing, or overriding its class's forward, must compute what its rule assumes:
    checked on its first call, while its parameters are as the call saw them."""
    problem = None
    try:
        expected = layer.match.verify_with(layer.module, inputs)
    except Exception as error:  # a forward with another signature or input type: not the rule's function
        problem = f"its rule's forward cannot even run on its inputs ({type(error).__name__}: {error})"
    else:
        tolerance = _FORWARD_CHECK_TOLERANCE.get(output.dtype, 3e-2)
        if not isinstance(expected, Tensor) or expected.shape != output.shape:
            problem = "its rule's forward gives another shape"
        else:
            error = (expected.double() - output.double()).norm() / output.double().norm().clamp_min(1e-30)
            if not bool(error <= tolerance):
                problem = f"its output differs from its rule's forward by {float(error):.2g} (relative)"
    if problem is not None:
        raise FlashDPError(
            f"Layer {layer.label} matched rule {layer.match.rule.name}, but its forward does not compute what that "
            f"rule assumes: {problem}. Its per-sample gradients would be wrong. Register a rule for its type with "
            "flashdp.register_rule(...), or freeze its parameters."
        )
