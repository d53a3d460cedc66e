"""Coverage: every trainable parameter that reaches the loss is counted whole, or the step is refused.

A rule counts a parameter's contribution through one recorded call: the part of the autograd graph between the
call's output and its inputs. A parameter can also reach the loss another way (`F.linear(x, layer.weight)`, a
tied head written as `h @ emb.weight.T`, `layer.forward(x)` that skips the hooks, a wrapper reading a child's
weight): that contribution would be missing from its norm. The walk below follows the graph from the loss and
tracks, along every path, the recorded calls it is inside of (entered at a call's output, left at one of its
inputs); a parameter reached on a path whose innermost call does not count it is a use no rule sees.

The walk visits each (node, enclosing calls) pair once: about the size of the autograd graph, run at the first
backward of every new forward structure and at every self-check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge

from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError

#: autograd nodes of activation checkpointing that runs its segment without a graph (torch's reentrant
#: checkpoint, and the libraries modelled on it): the parameters inside are invisible to every pass but the last
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


@dataclass(frozen=True)
class Use:
    """A parameter reached by the loss on a path no recorded call covering it encloses."""

    param: str
    #: the autograd op that consumed it
    op: str
    #: the innermost recorded call the path was inside of, if any
    within: Call | None

    def describe(self) -> str:
        where = (
            f"inside the forward of {self.within.layer.label}, whose rule does not count it"
            if self.within
            else ("outside the forward of every layer that counts it")
        )
        return f"'{self.param}' reaches the loss through {self.op} {where}"


def uncovered_uses(loss: Tensor, calls: Sequence[Call], param_names: dict[Node, str]) -> list[Use]:
    """Every use of a named parameter that no recorded call covering it encloses (one per parameter and op).

    param_names: the graph node of each trainable parameter (its AccumulateGrad node, or the view a wrapper
    exposes), as held during the forward, and its name. Nodes are keyed by themselves, never by id: a Python node
    object freed during the walk could hand its id to another.
    """
    output_calls: dict[Node, list[int]] = {}
    for i, call in enumerate(calls):
        output_calls.setdefault(call.edge.node, []).append(i)
    boundaries = [{(e.node, e.output_nr) for e in call.input_edges} for call in calls]
    covered = [{get_gradient_edge(p).node for p in call.params} for call in calls]
    uses: dict[tuple[str, str], Use] = {}
    entered: set[int] = set()
    seen: set[tuple[Node, tuple[int, ...]]] = set()
    pending: list[tuple[Node, tuple[int, ...], str]] = [(loss.grad_fn, (), "the loss")] if loss.grad_fn else []
    while pending:
        node, inside, consumer = pending.pop()
        if (node, inside) in seen:
            continue
        seen.add((node, inside))
        for i in reversed(output_calls.get(node, ())):  # entering calls here, outermost first
            entered.add(i)
            if i not in inside:
                inside = (*inside, i)
        name = param_names.get(node)
        if name is not None:
            if not (inside and node in covered[inside[-1]]):
                within = calls[inside[-1]] if inside else None
                uses.setdefault((name, consumer), Use(name, consumer, within))
            continue
        if node.name() == _REENTRANT_CHECKPOINT:
            raise FlashDPError(
                "The model uses activation checkpointing with use_reentrant=True, which runs each segment without "
                "an autograd graph: flashdp cannot see the layers inside it, so their per-sample gradients would be "
                "missing. Use non-reentrant checkpointing: torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False), or for HF models model.gradient_checkpointing_enable("
                'gradient_checkpointing_kwargs={"use_reentrant": False}).'
            )
        for child, output_nr in node.next_functions:
            if child is not None:
                pending.append((child, _leave(inside, boundaries, (child, output_nr)), node.name()))
    if uses:
        _refuse_hidden_outputs([c for i, c in enumerate(calls) if i not in entered])
    return list(uses.values())


def _refuse_hidden_outputs(unreached: list[Call]) -> None:
    """A call whose output was changed in place after it returned is cut out of the graph: the uses found
    inside it are then its own, hidden. Say so, rather than blame the parameters."""
    for call in unreached:
        if call.modified_in_place():
            raise call.hidden_by_in_place_error()


def _leave(inside: tuple[int, ...], boundaries: list[set[tuple[Node, int]]], edge: tuple[Node, int]) -> tuple[int, ...]:
    """The calls still enclosing a path that crosses `edge`: an input of a call leads out of it and of every call
    it is nested in deeper."""
    for depth, i in enumerate(inside):
        if edge in boundaries[i]:
            return inside[:depth]
    return inside


def param_nodes(model: nn.Module, calls: Sequence[Call]) -> dict[Node, str]:
    """Every trainable parameter's graph node and its name: the parameters registered on the model, and those the
    recorded calls held (a wrapper may swap in unsharded tensors or views during the forward)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[get_gradient_edge(p).node] = name
    for call in calls:
        for attribute, p in zip(call.layer.trainable, call.params, strict=True):
            if p.requires_grad:
                out.setdefault(get_gradient_edge(p).node, f"{call.layer.path}.{attribute}".lstrip("."))
    return out


def refuse(uses: list[Use]) -> None:
    if uses:
        raise FlashDPError(
            "flashdp would miss part of these parameters' per-sample gradients:\n  - "
            + "\n  - ".join(use.describe() for use in uses)
            + "\nA parameter's whole contribution must pass through the forward of a layer whose rule counts it: "
            "call the layer itself (not F.linear(x, layer.weight), `x @ layer.weight.T` or layer.forward(x)), "
            "or freeze the parameter."
        )
