"""Coverage: every trainable parameter that reaches the loss is counted whole, else it is moved to a rule that
counts it whole, or the step is refused.

A rule counts a parameter's contribution through one recorded call: the part of the autograd graph between the
call's output and its inputs. A parameter can also reach the loss another way (`F.linear(x, layer.weight)`, a
tied head written as `h @ emb.weight.T`, `layer.forward(x)` that skips the hooks, a wrapper reading a child's
weight): that contribution would be missing from its norm. The walk below follows the graph from the loss and
tracks, along every path, the recorded calls it is inside of (entered at a call's output, left at one of its
inputs). A parameter is covered on a path inside a call of the site counting it: a generic site anywhere in the
path's calls (its rule re-runs the whole forward), a registered rule's site as the innermost rule site.

A use no site covers is moved (`promotions`) to the generic rule at the smallest module whose calls enclose
every use of that parameter; what no module encloses is refused. The walk visits each (node, enclosing calls)
pair once: about the size of the autograd graph, run at the first backward of every new forward structure and at
every self-check.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge

from flashdp._pipeline.norm_pass import batch_mismatch_error
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError

#: autograd nodes of activation checkpointing that runs its segment without a graph (torch's reentrant
#: checkpoint, and the libraries modelled on it): the parameters inside are invisible to every pass but the last
_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


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

    registered: the model's `named_parameters()` (a wrapper's flat parameters among them)."""
    param_nodes = _param_nodes(plan, calls, registered)
    output_calls: dict[Node, list[int]] = {}
    for i, call in enumerate(calls):
        for edge in call.edges:
            output_calls.setdefault(edge.node, []).append(i)
    boundaries = [{(e.node, e.output_nr) for e in call.input_edges} for call in calls]
    counted = [_counted_nodes(plan, call) for call in calls]
    generic = [plan.site(call.module).is_generic for call in calls]
    uses: dict[tuple[str, str, tuple[int, ...]], Use] = {}
    entered: dict[int, tuple[int, ...]] = {}
    seen: set[tuple[Node, tuple[int, ...]]] = set()
    pending: list[tuple[Node, tuple[int, ...], str]] = [(loss.grad_fn, (), "the loss")] if loss.grad_fn else []
    while pending:
        node, inside, consumer = pending.pop()
        if (node, inside) in seen:
            continue
        seen.add((node, inside))
        for i in reversed(output_calls.get(node, ())):  # entering calls here, outermost (recorded last) first
            entered.setdefault(i, inside)
            if i not in inside:
                inside = (*inside, i)
        param = param_nodes.get(node)
        if param is not None:
            if not _covered(node, inside, counted, generic):
                uses.setdefault((param.name, consumer, inside), Use(param, consumer, inside))
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
        _refuse_hidden_outputs(plan, [c for i, c in enumerate(calls) if i not in entered])
    return Walk(list(uses.values()), entered)


def _covered(node: Node, inside: tuple[int, ...], counted: list[set[Node]], generic: list[bool]) -> bool:
    """A generic site counts every use inside its calls; a registered rule only those in its own formula, so its
    site must be the innermost rule site on the path."""
    for depth in range(len(inside) - 1, -1, -1):
        i = inside[depth]
        if node in counted[i] and (generic[i] or all(not counted[j] for j in inside[depth + 1 :])):
            return True
    return False


def _counted_nodes(plan: GradientPlan, call: Call) -> set[Node]:
    site = plan.site(call.module)
    held = [call.params[n] for n in site.trainable if n in call.params]
    tensors = [*held, *(plan.param_of[(id(call.module), n)].param for n in site.trainable)]
    return {node for t in tensors if (node := _node(t)) is not None}


def _param_nodes(plan: GradientPlan, calls: Sequence[Call], registered: Iterable[tuple[str, Tensor]]) -> dict:
    """Every trainable parameter's graph node: as the recorded calls held them (a wrapper may swap in unsharded
    tensors or views during the forward), as the plan and the model register them. Nodes are keyed by themselves,
    never by id: a Python node object freed during the walk could hand its id to another."""
    out: dict[Node, ParamNode] = {}
    for call in calls:
        for name, tensor in call.params.items():
            param = plan.param_of.get((id(call.module), name))
            if param is not None and (node := _node(tensor)) is not None:
                out.setdefault(node, ParamNode(param.name, param.key))
    for p in plan.params:
        if (node := _node(p.param)) is not None:
            out.setdefault(node, ParamNode(p.name, p.key))
    for name, tensor in registered:  # e.g. FSDP1's flat parameters, which the plan knows only through views
        if (node := _node(tensor)) is not None:
            out.setdefault(node, ParamNode(name, None))
    return out


def _node(tensor: Tensor) -> Node | None:
    """The tensor's graph node, or None where it has none (frozen) or none any more (a wrapper's stale view)."""
    if not tensor.requires_grad:
        return None
    try:
        return get_gradient_edge(tensor).node
    except RuntimeError:
        return None


def _leave(inside: tuple[int, ...], boundaries: list[set[tuple[Node, int]]], edge: tuple[Node, int]) -> tuple[int, ...]:
    """The calls still enclosing a path that crosses `edge`: an input of a call leads out of it and of every call
    nested in it."""
    for depth, i in enumerate(inside):
        if edge in boundaries[i]:
            return inside[:depth]
    return inside


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
            if not any(batch in m.shape for m in calls[i].output_meta):  # the loss's batch is wrong
                raise batch_mismatch_error(
                    site.label, next((m.shape[0] for m in calls[i].output_meta if m.shape), 0), batch
                )
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
    refuse(walk(loss, [], plan, registered).uses)
    return FlashDPError(
        "engine.backward() found no forward pass to clip since the last backward: run the model's forward with "
        "gradients enabled (not under torch.no_grad()) after make_private and before backward, once per "
        "backward. If the loss reaches no trainable layer at all, it does not depend on the model."
    )
