"""Recorded outputs that are one gradient edge: each edge's gradient is counted once per parameter, or refused.

The norm pass hands every recorded output the gradient at its edge, and that gradient sums every use of the tensor
at the edge, whoever returned it. Two recorded outputs can be one edge: one call returning a tensor twice over (a
tensor and a reshape of it: the recorder takes a reshape's gradient at its base), or two calls returning the same
tensor (a module's own parameter, `return self.pos_table`, on every call; a cached tensor; an enclosing call
returning its child's output). Handed to each holder, that gradient was counted once per holder for every parameter
they both count. Decided on every backward from this forward's own edges (nothing here is kept across steps):

- one call holding an edge twice: it keeps its first output with it (`Call.with_outputs`: the others' gradient is
  None). Exact: the call's rule maps the edge's whole gradient through the call once.
- calls counting no parameter in common (a wrapper returning its child's output): each keeps it, as each counts
  only its own parameters through it.
- a parameter's own gradient accumulator (calls returning the parameter itself): only the first holder counting
  the parameter keeps it (a call left without outputs is left out). Exact: a rule maps the gradient of an output
  that is a parameter to that parameter alone, the same for every holder.
- a later call returning its own input as is (a module passing a tensor through on some calls): it is left out of
  that output. Exact: its rule maps the gradient of an output that is its input to none of its parameters.
- calls counting parameters in common on any other edge: refused. Which call's rule accounts for the graph below
  the edge depends on whether they nest (an enclosing call's recomputation covers its child's; a later call that
  returned a cached tensor computes none of it), which the recorded calls do not say.

A parameter's gradient accumulator sums every use of the parameter anywhere in the graph, inside other calls as
well: a returned parameter is exact only where no call but the one handed its gradient counts that parameter;
otherwise refused on that backward.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch.autograd.graph import Node

from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError

_ACCUMULATOR = torch._C._functions.AccumulateGrad

Edge = tuple[Node, int]


def one_holder_per_edge(plan: GradientPlan, calls: list[Call]) -> list[Call]:
    """The rule site calls (in recorded order), each output edge left only where it counts what no earlier holder
    of it counts (see the module's docstring); raises where that cannot be exact. Costs a dict entry per output;
    what a call counts is looked at only where an edge is held twice or is a parameter."""
    edges = _Edges(plan, calls)
    out: list[tuple[int, Call]] = []
    for i, call in enumerate(calls):
        kept: list[int] = []
        for j, edge in enumerate(call.edges):
            if edges.keeps(i, (edge.node, edge.output_nr)):
                kept.append(j)
        if kept:
            out.append((i, call if len(kept) == len(call.edges) else call.with_outputs(kept)))
    edges.check_returned([i for i, _ in out])
    return [call for _, call in out]


class _Edges:
    """The edges seen so far: who holds each, and what its kept holders count."""

    def __init__(self, plan: GradientPlan, calls: list[Call]) -> None:
        self.plan, self.calls = plan, calls
        self._counts: dict[int, set[Hashable]] = {}
        #: edge -> (its first holder, the calls keeping it, what they count: None until a second holder comes)
        self._seen: dict[Edge, tuple[int, list[int], set[Hashable] | None]] = {}
        #: a parameter's own edge -> its key (None: no parameter the plan counts)
        self._params: dict[Edge, Hashable | None] = {}

    def keeps(self, i: int, at: Edge) -> bool:
        """Whether call `i` (each call in turn, each of its outputs in turn) is handed the gradient at `at`."""
        seen = self._seen.get(at)
        if seen is None:
            self._seen[at] = (i, [i], None)
            if isinstance(at[0], _ACCUMULATOR):
                self._params[at] = next((p.key for p in self.plan.params if p.param is at[0].variable), None)
            return True
        first, keepers, counted = seen
        if i in keepers:
            return False  # held twice by this call: counted through its first output with this edge
        if counted is None:
            counted = set(self._counted(first))
            self._seen[at] = (first, keepers, counted)
        keys = self._counted(i)
        if at in self._params:  # a parameter itself: only its (first) counting holder maps the gradient to anything
            param = self._params[at]
            counts_it = param in keys and param not in counted
        elif keys & counted:
            if any((e.node, e.output_nr) == at for e in self.calls[i].input_edges):
                return False  # its own input, returned as is: its rule maps that gradient to none of its parameters
            raise _held_twice_error(self.plan, self.calls[first], self.calls[i])
        else:
            counts_it = True
        if counts_it:
            counted |= keys
            keepers.append(i)
        return counts_it

    def check_returned(self, kept: list[int]) -> None:
        """A parameter returned itself, whose gradient sums every use of it: no kept call but the one handed that
        gradient may count it."""
        for at, param in self._params.items():
            keepers = self._seen[at][1]
            if param is None or not any(param in self._counted(i) for i in keepers):
                continue  # (no holder counts it: their rules map its gradient to none of their parameters)
            other = next((i for i in kept if i not in keepers and param in self._counted(i)), None)
            if other is not None:
                holder = next(i for i in keepers if param in self._counted(i))
                raise _returned_parameter_error(self.plan, self.calls[holder], param, self.calls[other])

    def _counted(self, i: int) -> set[Hashable]:
        if i not in self._counts:
            call = self.calls[i]
            site = self.plan.site(call.module)
            self._counts[i] = {self.plan.param_of[(id(call.module), n)].key for n in site.trainable}
        return self._counts[i]


def _returned_parameter_error(plan: GradientPlan, call: Call, param: Hashable, other: Call) -> FlashDPError:
    site = plan.site(call.module)
    name = next(p.name for p in plan.params if p.key == param)
    again = " (in another call)" if other.module is call.module else ""
    return FlashDPError(
        f"Layer {site.label} returns its parameter '{name}' itself, whose gradient sums every use of the "
        f"parameter, and layer {plan.site(other.module).label}{again} counts uses of it as well: flashdp would "
        f"count them twice. Nothing was added to .grad. Return a tensor computed from it instead "
        f"(`self.{name.rpartition('.')[2]}.clone()`): its gradient is that call's own."
    )


def _held_twice_error(plan: GradientPlan, first: Call, later: Call) -> FlashDPError:
    first_label, later_label = plan.site(first.module).label, plan.site(later.module).label
    if first.module is later.module:
        which = f"Layer {first_label} returns the same tensor on two calls"
    else:
        which = f"Layers {first_label} and {later_label} return the same tensor"
    return FlashDPError(
        f"{which}, and they count parameters in common: flashdp cannot tell which call's forward computed it, to "
        "count its gradient once. Nothing was added to .grad. Return a new tensor on each call (`out.clone()` of a "
        "cached tensor), or untie the parameters."
    )
