"""Coverage: every trainable parameter that reaches the loss is counted whole, else it is moved to a rule that
counts it whole, or the step is refused.

A rule counts a parameter's contribution through one recorded call: the part of the autograd graph between the
call's output and its inputs. A parameter can also reach the loss another way (`F.linear(x, layer.weight)`, a
tied head written as `h @ emb.weight.T`, `layer.forward(x)` that skips the hooks, a wrapper reading a child's
weight): that contribution would be missing from its norm. The walk below follows the graph from the loss and
tracks, along every path, the recorded calls it is inside of (entered at one of a call's output edges, left at one
of its input edges). A parameter is covered on a path inside a call of the site counting it: a generic site
anywhere in the path's calls (its rule re-runs the whole forward), a registered rule's site as the innermost rule
site. A generic site's call entered inside another call of the same site (a module calling itself) is refused: the
outer call's re-run counts the inner call's uses again.

A use no site covers is moved (`promotions`) to the generic rule at the smallest module whose calls enclose
every use of that parameter; what no module encloses is refused. The walk visits each (node, enclosing calls)
pair once: about the size of the autograd graph. It runs on every backward (`learning.uncovered`): the calls and
their sizes, which key a verified forward structure, do not say where the forward used each parameter (a branch
on the data or the step around `F.linear(x, layer.weight)`), so nothing about coverage is carried from one
backward to the next. About 0.75 us per node on a CPU core (0.4 ms for a 64-block model of 578 nodes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

from flashdp._pipeline.norm_pass import batch_mismatch_error
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError

#: autograd nodes of activation checkpointing that runs its segment without a graph (torch's reentrant
#: checkpoint, and the libraries modelled on it): the parameters inside are invisible to every pass but the last
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"
#: the node of a leaf tensor that requires grad: its gradient accumulator
_ACCUMULATOR = torch._C._functions.AccumulateGrad


@dataclass(frozen=True)
class ParamNode:
    """A trainable parameter's node in the graph, and who it is."""

    name: str
    #: the plan's key for it (None: a parameter the plan does not know, e.g. an FSDP1 flat parameter)
    key: Hashable | None


@dataclass(frozen=True)
class Use:
    """A parameter reached by the loss on a path no site counting it encloses."""

    param: ParamNode
    #: the autograd op that consumed it
    op: str
    #: the recorded calls the path was inside of, outermost first (indices into the walk's calls)
    inside: tuple[int, ...]


@dataclass(frozen=True)
class Walk:
    #: every use of a trainable parameter no site counting it encloses
    uses: list[Use]
    #: per call (index), the calls enclosing it where the walk entered it, outermost first
    enclosing: dict[int, tuple[int, ...]]


def walk(loss: Tensor, calls: Sequence[Call], plan: GradientPlan, registered: Iterable[tuple[str, Tensor]]) -> Walk:
    """Every use of a trainable parameter that no site counting it encloses (one per parameter, op and path), and
    how the calls nest.

    registered: the model's `named_parameters()` (a wrapper's flat parameters among them), read only where the
    graph holds a leaf that requires grad and that neither the plan nor the calls hold.

    Run on every backward: one visit per (node, enclosing calls) pair, each a few dict lookups. A parameter is
    found by its node (a leaf's gradient accumulator by the tensor it accumulates into), never by asking torch
    for each parameter's node."""
    params = _Params(plan, calls, registered)
    nesting = _Nesting(calls, params.known.generic)
    leaves, others, modules = params.known.leaves, params.others, nesting.modules
    uses: dict[tuple[str, str, tuple[int, ...]], Use] = {}
    #: node -> the enclosing calls it was visited with (one tuple, or a set of them after a second)
    seen: dict[Node, tuple[int, ...] | set[tuple[int, ...]]] = {}
    pending: list[tuple[Node, int, tuple[int, ...], Node | None]] = []
    if loss.grad_fn is not None:
        pending.append((loss.grad_fn, loss.output_nr, (), None))
    # (the loop runs once per node on every backward: methods bound once)
    pop, push, seen_with, entering, leaving = pending.pop, pending.append, seen.get, nesting.entering, nesting.leaving
    while pending:
        node, output_nr, inside, consumer = pop()
        if node in entering:
            inside = nesting.enter(node, output_nr, inside, params)
        before = seen_with(node)
        if before is None:
            seen[node] = inside
        elif type(before) is tuple:
            if before is inside or before == inside:
                continue
            seen[node] = {before, inside}
        elif inside in before:
            continue
        else:
            before.add(inside)
        kind = type(node)
        if kind is _ACCUMULATOR:  # (the usual case: the innermost call's site counts it, as the plan holds it)
            variable = node.variable
            known = leaves.get(id(variable))
            if known is not None and known[0] is variable and inside and modules[inside[-1]] in known[2]:
                continue
        elif node not in others:
            if kind.__name__ == _REENTRANT_CHECKPOINT:
                raise _reentrant_checkpoint_error()
            for edge in node.next_functions:
                if edge[0] is not None:
                    push((edge[0], edge[1], nesting.leave(inside, edge) if edge[0] in leaving else inside, node))
            continue
        found = params.at(node)  # (a parameter's node: the walk goes no further down)
        if found is not None and not params.covered(found[1], inside):
            op = "the loss" if consumer is None else consumer.name()
            uses.setdefault((found[0].name, op, inside), Use(found[0], op, inside))
    if uses:
        _refuse_hidden_outputs(plan, [c for i, c in enumerate(calls) if i not in nesting.entered])
    return Walk(list(uses.values()), nesting.entered)


class _Nesting:
    """Where a path enters and leaves the recorded calls."""

    def __init__(self, calls: Sequence[Call], generic: frozenset[int]) -> None:
        self.calls = calls
        #: a path enters a call through one of its output edges (node, output_nr), not through another output of
        #: the same node (a tensor computed inside the call and used outside it other than by the call's outputs)
        self.entering: dict[Node, list[tuple[int, int]]] = {}
        #: and leaves it (and every call nested in it) through one of its input edges
        self.leaving: dict[Node, list[tuple[int, int]]] = {}
        entering, leaving = self.entering, self.leaving
        for i, call in enumerate(calls):
            for edge in call.edges:
                entering.setdefault(edge.node, []).append((edge.output_nr, i))
            for edge in call.input_edges:
                leaving.setdefault(edge.node, []).append((edge.output_nr, i))
        self.modules = [id(call.module) for call in calls]
        #: generic sites called more than once (a call nested in another of the same site: `_refuse_recursion`)
        called = [m for m in self.modules if m in generic]
        self.recursing = {m for m, n in Counter(called).items() if n > 1} if called else set()
        #: per call entered, the calls enclosing it where the walk first entered it
        self.entered: dict[int, tuple[int, ...]] = {}

    def enter(self, node: Node, output_nr: int, inside: tuple[int, ...], params: _Params) -> tuple[int, ...]:
        """The calls enclosing a path arriving at `node` through its output `output_nr`."""
        for nr, i in reversed(self.entering[node]):  # entering calls here, outermost (recorded last) first
            if nr == output_nr:
                self.entered.setdefault(i, inside)
                if i not in inside:
                    if self.modules[i] in self.recursing and type(node) is not _ACCUMULATOR:
                        _refuse_recursion(params, self.calls, inside, i, (node, output_nr))
                    inside = (*inside, i)
        return inside

    def leave(self, inside: tuple[int, ...], edge: tuple[Node, int]) -> tuple[int, ...]:
        """The calls still enclosing a path that crosses `edge`: an input of a call leads out of it and of every
        call nested in it."""
        calls = {i for nr, i in self.leaving[edge[0]] if nr == edge[1]}
        for depth, i in enumerate(inside):
            if i in calls:
                return inside[:depth]
        return inside


def _refuse_recursion(
    params: _Params, calls: Sequence[Call], inside: tuple[int, ...], inner: int, at: tuple[Node, int]
) -> None:
    """A call of a generic site entered, at one of its outputs, inside another call of the same site whose own
    inputs and outputs do not hold that edge: called during the other's forward (a module calling itself). The
    outer call's rule re-runs its whole forward with its parameters swapped for its own copies, inner call
    included, so the inner call's use of them would be counted by both calls. (A tensor both calls return, or one
    the later call returns as it got it, is `aliasing.py`'s; a parameter returned itself has no call of its own.)"""
    module = calls[inner].module
    outer = [i for i in inside if calls[i].module is module and not _holds(calls[i], at)]
    if not outer or not params.counts_any(inner):
        return
    label = params.plan.site(module).label
    raise FlashDPError(
        f"Layer {label} is called inside its own forward (recursion). Its generic rule re-runs the outer call's "
        "whole forward, inner calls included, so flashdp would count the inner calls' use of its parameters twice. "
        "Nothing was added to .grad. Call the layer repeatedly from its parent instead (`for _ in range(depth): h = "
        "self.layer(h)`), or register a rule for its type with flashdp.register_rule(...)."
    )


def _holds(call: Call, edge: tuple[Node, int]) -> bool:
    """Whether `edge` is one of the call's inputs or outputs."""
    return any(edge == (e.node, e.output_nr) for e in (*call.edges, *call.input_edges))


def _reentrant_checkpoint_error() -> FlashDPError:
    return FlashDPError(
        "The model uses activation checkpointing with use_reentrant=True, which runs each segment without an "
        "autograd graph: flashdp cannot see the layers inside it, so their per-sample gradients would be missing. "
        "Use non-reentrant checkpointing: torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or for HF "
        'models model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}).'
    )


class _Params:
    """The trainable parameters' graph nodes, and what each call counts, for one walk.

    A parameter is named by its node: a leaf's gradient accumulator by the tensor it accumulates into (its id:
    `AccumulateGrad.variable` is the tensor object itself, held here while the walk runs), another tensor (a
    wrapper's unsharded tensor or view, a parametrization's result) by its `grad_fn`. Found as the plan holds them
    (`_PlanParams`, per plan), then as the recorded calls held them (a wrapper may swap in other tensors during the
    forward), then, for a leaf neither holds (FSDP1's flat parameters, which the plan knows only through views), as
    the model registers them: each looked at only on a miss."""

    def __init__(self, plan: GradientPlan, calls: Sequence[Call], registered: Iterable[tuple[str, Tensor]]) -> None:
        self.plan, self.calls = plan, calls
        self.known = _plan_params(plan)
        self._leaves: dict[int, tuple[Tensor, ParamNode]] = {}
        #: tensors that are not leaves (as the plan holds them, and on a miss as the calls held them) by node
        self.others: dict[Node, ParamNode] = {}
        for p in self.known.not_leaves:
            self._add(p.param, ParamNode(p.name, p.key))
        self._held_added = False
        self._registered: Iterable[tuple[str, Tensor]] | None = registered
        self._held: dict[int, frozenset[object]] = {}
        self._counts: dict[int, bool] = {}
        self._generic: dict[int, bool] = {}
        if _hold_a_non_leaf(calls):  # (found by node: known before the walk)
            self._add_held()

    def _add(self, tensor: Tensor, param: ParamNode) -> None:
        if not tensor.requires_grad:
            return
        node = _grad_fn(tensor)
        if node is None:
            self._leaves.setdefault(id(tensor), (tensor, param))
        elif node is not _STALE:
            self.others.setdefault(node, param)

    def _add_held(self) -> None:
        if self._held_added:
            return
        self._held_added = True
        for call in self.calls:
            for name, tensor in call.params.items():
                param = self.plan.param_of.get((id(call.module), name))
                if param is not None:
                    self._add(tensor, ParamNode(param.name, param.key))

    def at(self, node: Node) -> tuple[ParamNode, object] | None:
        """The trainable parameter at `node`, if any, and its name (`name_of`)."""
        if type(node) is not _ACCUMULATOR:
            param = self.others.get(node)
            return None if param is None else (param, node)
        variable = node.variable
        name = id(variable)
        found = self.known.leaves.get(name) or self._leaves.get(name)
        if found is None:
            self._add_held()
            found = self._leaves.get(name)
        if found is None and self._registered is not None:
            registered, self._registered = self._registered, None
            for param_name, tensor in registered:
                self._add(tensor, ParamNode(param_name, None))
            found = self._leaves.get(name)
        return (found[1], name) if found is not None and found[0] is variable else None

    def covered(self, name: object, inside: tuple[int, ...]) -> bool:
        """Whether a use of the parameter `name` inside these calls (outermost first) is counted: a generic site
        counts every use inside its calls; a registered rule only those in its own formula, so its site must be the
        innermost rule site on the path."""
        for depth in range(len(inside) - 1, -1, -1):
            i = inside[depth]
            if self._counts_it(i, name) and (
                self._is_generic(i) or not any(self.counts_any(j) for j in inside[depth + 1 :])
            ):
                return True
        return False

    def _counts_it(self, i: int, name: object) -> bool:
        """Whether call i's site counts the parameter `name`: as the plan holds it, or as the call held it."""
        known = self.known.leaves.get(name) if type(name) is int else None
        if known is not None and id(self.calls[i].module) in known[2]:
            return True
        return name in self._held_names(i)

    def counts_any(self, i: int) -> bool:
        """Whether call i's site counts any parameter that requires grad."""
        found = self._counts.get(i)
        if found is None:
            found = self._counts[i] = bool(self._held_names(i))
        return found

    def _is_generic(self, i: int) -> bool:
        found = self._generic.get(i)
        if found is None:
            found = self._generic[i] = self.plan.site(self.calls[i].module).is_generic
        return found

    def _held_names(self, i: int) -> frozenset[object]:
        """The names of the parameters call i's site counts, as the call held them and as the plan holds them."""
        found = self._held.get(i)
        if found is None:
            call = self.calls[i]
            trainable = self.plan.site(call.module).trainable
            held = [call.params[n] for n in trainable if n in call.params]
            tensors = [*held, *(self.plan.param_of[(id(call.module), n)].param for n in trainable)]
            found = self._held[i] = frozenset(name for t in tensors if (name := _name_of(t)) is not None)
        return found


@dataclass(frozen=True)
class _PlanParams:
    """What a plan says of its parameters, by name (`_name_of`), for every walk under it while its leaves are still
    leaves (the plan's tensors are fixed)."""

    #: id -> (the plan's leaf tensor, the parameter, the ids of the modules whose sites count it as the plan holds it)
    leaves: dict[int, tuple[Tensor, ParamNode, frozenset[int]]]
    #: the plan's parameters whose tensor is not a leaf (a wrapper's view): found by node on every walk
    not_leaves: list[TrainableParam]
    #: the ids of the modules of generic sites
    generic: frozenset[int]


#: the attribute of a plan holding its `_PlanParams` (kept with the plan: a cache of its own would keep the
#: parameters of a model no longer trained alive)
_KEPT = "_coverage_params"


def _plan_params(plan: GradientPlan) -> _PlanParams:
    """The plan's `_PlanParams`, computed once per plan (the engine's, on every backward)."""
    found = plan.__dict__.get(_KEPT)
    if isinstance(found, _PlanParams) and _still_leaves(found.leaves.values()):
        return found
    counting: dict[int, set[int]] = {}
    for site in plan.rule_sites:
        for n in site.trainable:
            counting.setdefault(id(plan.param_of[(id(site.module), n)].param), set()).add(id(site.module))
    leaves: dict[int, tuple[Tensor, ParamNode, frozenset[int]]] = {}
    not_leaves = []
    for p in plan.params:
        if _grad_fn(p.param) is None:
            sites = frozenset(counting.get(id(p.param), ()))
            leaves.setdefault(id(p.param), (p.param, ParamNode(p.name, p.key), sites))
        else:
            not_leaves.append(p)
    generic = frozenset(id(site.module) for site in plan.rule_sites if site.is_generic)
    found = _PlanParams(leaves, not_leaves, generic)
    object.__setattr__(plan, _KEPT, found)  # (a frozen dataclass: none of its fields changes)
    return found


def _still_leaves(leaves: Iterable[tuple[Tensor, ParamNode, frozenset[int]]]) -> bool:
    """Whether each of these tensors is still a leaf (an in-place op with gradients makes a tensor that does not
    require grad a non-leaf one that does)."""
    try:
        return all(tensor.grad_fn is None for tensor, _, _ in leaves)
    except RuntimeError:
        return False


def _name_of(tensor: Tensor) -> object | None:
    """A trainable tensor's name in the walk (None without a node): its id for a leaf, else its node."""
    if not tensor.requires_grad:
        return None
    node = _grad_fn(tensor)
    return id(tensor) if node is None else None if node is _STALE else node


def _hold_a_non_leaf(calls: Sequence[Call]) -> bool:
    """Whether a call held a tensor for its rule that is not a leaf (a wrapper's view, a parametrization's
    result), or one whose node torch cannot give."""
    try:
        for call in calls:
            for tensor in call.params.values():
                if tensor.grad_fn is not None:
                    return True
    except RuntimeError:
        return True
    return False


#: `_grad_fn` of a tensor whose node torch cannot give any more (a wrapper's stale view)
_STALE = object()


def _grad_fn(tensor: Tensor) -> object | None:
    try:
        return tensor.grad_fn
    except RuntimeError:
        return _STALE


def layout_promotions(
    misfits: Iterable[int],
    calls: Sequence[Call],
    plan: GradientPlan,
    enclosing: dict[int, tuple[int, ...]],
    batch: int,
    not_batch_first: Collection[int] = (),
) -> dict[nn.Module, list[Hashable]]:
    """Per call whose output is neither batch-first nor broadcast over the batch (DeBERTa's relative position
    projections, repeated over the batch and heads), the smallest enclosing module whose own outputs are
    batch-first (by size, and not among the modules whose ids are in `not_batch_first`: verified otherwise): the
    generic rule there counts the call's parameters, per sample. Raises where none is."""
    targets: dict[nn.Module, list[Hashable]] = {}
    for i in misfits:
        site = plan.site(calls[i].module)
        outer = [
            calls[j]
            for j in reversed(enclosing.get(i, ()))
            if _ancestor(plan.site(calls[j].module).path, site.path)
            and all(m.shape and m.shape[0] % batch == 0 for m in calls[j].output_meta)
            and id(calls[j].module) not in not_batch_first
        ]
        if not outer:
            shapes = [m.shape for m in calls[i].output_meta]
            if not any(shapes):  # a scalar shared by every sample, no single op placing the batch above it
                raise _unplaced_scalar_error(site.label, batch)
            if not any(batch in shape for shape in shapes):  # the loss's batch is wrong
                raise batch_mismatch_error(site.label, next(shape[0] for shape in shapes if shape), batch)
            raise FlashDPError(
                f"The gradient of layer {site.label}'s output is not separable by sample. Either (1) the loss of "
                "a sample depends on other samples: a term computed from the whole batch was added to every "
                "sample's loss, like the auxiliary load-balancing loss of a mixture-of-experts model (`aux_loss`, "
                "from output_router_logits=True): leave it out of the per-sample loss; or (2) the layer gives an "
                "output without the batch as its first dim, which no later op broadcasts over the batch and no "
                "enclosing module's forward takes back to batch-first outputs: freeze its parameters, or register "
                "a rule."
            )
        keys = [plan.param_of[(id(calls[i].module), n)].key for n in site.trainable]
        targets.setdefault(outer[0].module, []).extend(keys)
    return targets


def _ancestor(path: str, of: str) -> bool:
    return path == "" or of.startswith(f"{path}.")


def promotions(uses: list[Use], calls: Sequence[Call], plan: GradientPlan) -> dict[nn.Module, list[Hashable]]:
    """Per uncovered parameter, the smallest module whose calls enclose every one of its uses: the module the
    generic rule will count it at. Raises for a parameter no module can take (used outside every recorded call,
    or not part of the tree of the module enclosing its uses)."""
    by_param: dict[Hashable, list[Use]] = {}
    for use in uses:
        if use.param.key is None or not use.inside:
            refuse([use])
        by_param.setdefault(use.param.key, []).append(use)
    targets: dict[nn.Module, list[Hashable]] = {}
    for key, param_uses in by_param.items():
        enclosing = set.intersection(*({id(calls[i].module) for i in use.inside} for use in param_uses))
        owner_path = param_uses[0].param.name.rpartition(".")[0]
        candidates = [
            site
            for site in plan.sites.values()
            if id(site.module) in enclosing and (site.path == "" or f"{owner_path}.".startswith(f"{site.path}."))
        ]
        if not candidates:
            refuse(param_uses)
        target = max(candidates, key=lambda site: site.path.count(".") + bool(site.path))
        targets.setdefault(target.module, []).append(key)
    return targets


def _refuse_hidden_outputs(plan: GradientPlan, unreached: list[Call]) -> None:
    """A call whose output was changed in place after it returned is cut out of the graph: the uses found
    inside it are then its own, hidden. Say so, rather than blame the parameters."""
    for call in unreached:
        if call.modified_in_place():
            raise call.hidden_by_in_place_error(plan.site(call.module).label)


def refuse(uses: list[Use]) -> None:
    if uses:
        raise FlashDPError(
            "flashdp would miss part of these parameters' per-sample gradients:\n  - "
            + "\n  - ".join(
                f"'{use.param.name}' reaches the loss through {use.op} outside the forward of every "
                "module that could count it"
                for use in uses
            )
            + "\nA parameter's whole contribution must pass through the forward of the model (or of a module whose "
            "rule counts it): call the layer itself (not F.linear(x, layer.weight) outside the model), or freeze the "
            "parameter."
        )


def no_forward_error(
    loss: Tensor, plan: GradientPlan, registered: Iterable[tuple[str, Tensor]], clipped: bool
) -> FlashDPError:
    """Why a backward found no recorded forward: its loss was `clipped` already, a parameter is used outside the
    layers that record (refused here), or the forward ran without gradients."""
    if clipped:
        return FlashDPError(
            "engine.backward() was already called on this forward's loss: each forward is clipped once. Run a "
            "new forward for the next backward."
        )
    try:
        refuse(walk(loss, [], plan, registered).uses)
    except FlashDPError as error:  # (every use is outside a recorded call when none was recorded)
        return FlashDPError(f"{_EARLIER_FORWARD} Or: {error}")
    return FlashDPError(
        "engine.backward() found no forward pass to clip since the last backward: run the model's forward with "
        "gradients enabled (not under torch.no_grad()) after make_private and before backward, once per "
        f"backward. If the loss reaches no trainable layer at all, it does not depend on the model. {_EARLIER_FORWARD}"
    )


_EARLIER_FORWARD = (
    "No layer call was recorded since the last engine.backward(): if this loss comes from a forward run before it, "
    "that backward took the forward's calls (each backward takes every call recorded since the one before). Call "
    "engine.backward() after each forward, or add the per-sample losses of both forwards into one backward."
)


def _unplaced_scalar_error(label: str, batch: int) -> FlashDPError:
    return FlashDPError(
        f"Layer {label} returns a scalar (a gate or a scale shared by every sample), and flashdp found no single op "
        f"where it meets the batch (for one, where it is broadcast over two dims of size B = {batch} at once, a "
        "sequence as long as the batch, which sizes alone cannot tell apart). Nothing was added to .grad. Call "
        "it inside the forward of a module that also takes the batch (that module's generic rule then counts it "
        "per sample), give it a leading dim of 1 broadcast against the batch's dim 0 alone, or use a batch size "
        "that differs from the other dims."
    )
