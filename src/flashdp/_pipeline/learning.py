"""What a backward learns about the model's layout, as new `Knowledge` values (nothing here keeps state): which rule
covers each parameter's uses, which outputs are shared across the batch, where a layer's batch is. The caller
commits what a backward learnt only when the backward succeeds."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable

from torch import Tensor, nn
from torch.autograd.graph import Node

from flashdp._pipeline import coverage, shared_outputs
from flashdp._pipeline.broadcast_params import broadcast_parameters
from flashdp._pipeline.knowledge import Knowledge
from flashdp._pipeline.layout import Ambiguous, Output, lacks_batch, outputs, time_major_dim
from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError

#: the model's `named_parameters()` (a wrapper's flat parameters among them), asked anew for every walk
Registered = Callable[[], Iterable[tuple[str, Tensor]]]


class Found(enum.IntEnum):
    """What a verifying norm pass found, ordered so that the ranks agree on the highest any of them found."""

    VERIFIED = 0  # every layer's rows are per-sample
    RELEARNT = 1  # shared or time-major layers learnt: the pass is redone
    NOT_BATCH_FIRST = 2  # layers whose rows are not samples: their parameters are covered again
    REFUSED = 3


def cover(
    known: Knowledge, graph: LossGraph, calls: list[Call], registered: Registered, reshards: bool
) -> tuple[Knowledge, bool]:
    """Make every trainable parameter's use counted: parameters used outside the site counting them, and those of
    layers whose outputs are neither batch-first nor broadcast over the batch, move to the generic rule at the
    smallest module enclosing their uses (refused under a wrapper that `reshards` its parameters). Whether the
    plan changed."""
    batch, start = graph.loss.shape[0], known
    told: set[int] = set()  # modules told their batch dim on this backward (their calls may disagree: once each)
    for _ in range(len(known.plan.params) + 1):  # each round moves at least one parameter up the tree
        found = coverage.walk(graph.loss, calls, known.plan, registered())
        misfits = _misfits(known, graph, calls, found.enclosing) if not found.uses else []
        if not found.uses and not misfits:
            return known, known.plan is not start.plan
        time_major = {
            i: d
            for i in misfits
            if id(calls[i].module) not in told
            and (d := time_major_dim(known.plan, calls[i], batch, later=False)) is not None
        }
        if time_major:  # a position-wise rule is told where the batch is
            dims = {calls[i].module: d for i, d in time_major.items()}
            told.update(id(module) for module in dims)
            known = known.with_plan(known.plan.with_batch_dims(dims))
            continue
        if found.uses:
            targets = coverage.promotions(found.uses, calls, known.plan)
        else:
            targets = coverage.layout_promotions(
                misfits, calls, known.plan, found.enclosing, batch, known.not_batch_first
            )
        if reshards:  # (after the promotions: the errors they raise name the cause more precisely)
            raise _enclosing_rule_under_fsdp_error(found.uses)
        plan = known.plan
        for module, keys in targets.items():
            plan = plan.promote(module, keys)
        known = known.with_plan(plan)
    coverage.refuse(coverage.walk(graph.loss, calls, known.plan, registered()).uses)
    return known, True


def uncovered(known: Knowledge, graph: LossGraph, calls: list[Call], registered: Registered) -> bool:
    """Whether this backward uses a trainable parameter where no site counting it encloses the use (the coverage
    walk, without the layout questions a verified structure has answered): run on every backward whose structure
    was verified, since its calls and sizes do not say how the forward used each parameter (`F.linear(x,
    layer.weight)` in a branch taken on some steps only)."""
    return bool(coverage.walk(graph.loss, calls, known.plan, registered()).uses)


def _enclosing_rule_under_fsdp_error(uses: list[coverage.Use]) -> FlashDPError:
    names = sorted(use.param.name for use in uses)
    return FlashDPError(
        "Under FSDP, flashdp counts a parameter used outside its own module (or a layer whose output is neither "
        "batch-first nor broadcast) only by a rule registered for the module that encloses its uses; these would "
        f"need the generic rule there: {', '.join(names) or 'see the layers above'}. Tie weights by sharing the "
        "Parameter between layers, call layers rather than reading their weights, or register a rule."
    )


def _misfits(known: Knowledge, graph: LossGraph, calls: list[Call], entered: dict[int, tuple[int, ...]]) -> list[int]:
    """Rule site calls with an output that reaches the loss, has no batch dim (B * k rows are a batch) and is not
    broadcast over the batch by a later op."""
    batch = graph.loss.shape[0]
    lacking: dict[int, list] = {}
    for out in outputs(known.plan, calls) if batch > 1 else ():
        call = calls[out.call]
        if out.call in entered and (
            lacks_batch(out.meta.shape, out.dim, batch) or id(call.module) in known.not_batch_first
        ):
            lacking.setdefault(out.call, []).append(call.edges[out.index])
    return [
        i for i, edges in lacking.items() if any(graph.reaches_loss(e) and not graph.frontiers(e, batch) for e in edges)
    ]


def shared(
    known: Knowledge, graph: LossGraph, calls: list[Call]
) -> tuple[dict[tuple[int, int], shared_outputs.SharedOutput], Knowledge]:
    """(call, output) -> SharedOutput for every output shared across the batch: those without the batch dim, and
    every output of a site known to share its output (a shared output's dims may equal B by chance); and the
    knowledge that their sites share. An output of a call with several takes its per-sample gradient through its
    uses outside the call alone (`shared_outputs.outside_frontiers`): the paths inside the call to its other
    outputs are theirs, which the call's rule maps back through the call (as `norm_pass._outside_gradients` does
    for batch outputs); where it has no other use, its gradient is None. With them, the parameters of generic
    sites' calls counted where they meet the batch (`broadcast_params`)."""
    batch = graph.loss.shape[0]
    if batch < 2:
        return {}, known
    candidates, by_chance = _shared_candidates(known, calls, batch)
    found = {
        key: shared_outputs.SharedOutput(calls[key[0]].edges[key[1]], shape, frontiers)
        for key, (shape, frontiers) in _frontiers(graph, calls, candidates, batch).items()
        if frontiers is not None and (frontiers or len(calls[key[0]].edges) > 1)
    }
    readers = sample_readers(known, calls, set(found), batch, by_chance)
    found = {key: output for key, output in found.items() if key not in readers}
    known = known.sharing(id(calls[i].module) for i, _ in found)
    return found | broadcast_parameters(known, graph, calls), known


def frontier_places(known: Knowledge, graph: LossGraph, calls: list[Call]) -> tuple:
    """Where the outputs (and parameters) that `shared` would take as shared meet the batch, as places in the graph
    (`LossGraph.places`): a structure is verified with its frontiers, whose rows the verifying pass checks are the
    samples'. A later step of the same ops and size classes may place a frontier elsewhere (a sum of two tables
    `[T, d]` with T == B passes for a batch): another structure, verified again."""
    batch = graph.loss.shape[0]
    if batch < 2:
        return ()
    found = _frontiers(graph, calls, _shared_candidates(known, calls, batch)[0], batch).items()
    groups = [(calls[c].edges[j], *(frontiers or ())) for (c, j), (_, frontiers) in found]
    groups += [(p.edge, *p.frontiers) for p in broadcast_parameters(known, graph, calls).values()]
    return tuple(sorted(graph.places(groups), key=repr))


def _shared_candidates(known: Knowledge, calls: list[Call], batch: int) -> tuple[list[Output], set[tuple[int, int]]]:
    """The outputs that may be shared across the batch (without the batch dim, or of a site known to share), and
    the (call, output) of those that fit the batch by size (shared only where no sample's rows are read)."""
    candidates, by_chance = [], set()
    for out in outputs(known.plan, calls):
        lacking = lacks_batch(out.meta.shape, out.dim, batch)
        if not lacking:
            by_chance.add((out.call, out.index))
        if id(calls[out.call].module) in known.shared_sites or lacking:
            candidates.append(out)
    return candidates, by_chance


def _frontiers(
    graph: LossGraph, calls: list[Call], candidates: list[Output], batch: int
) -> dict[tuple[int, int], tuple[object, list[shared_outputs.Frontier] | None]]:
    """(call, output) -> (its shape, its frontiers, or None where it is mis-shaped or does not reach the loss), each
    beside the other candidates that are shared (an op adding two of them is no batch): those with frontiers of
    their own (a call of a site known to share may be a per-sample lookup, `emb(ids) + emb(arange(T))`)."""
    alone = _frontiers_beside(graph, calls, candidates, batch, frozenset())
    edges = frozenset(
        (calls[o.call].edges[o.index].node, calls[o.call].edges[o.index].output_nr)
        for o in candidates
        if alone[(o.call, o.index)][1]  # (frontiers of its own: [] or None where the batch never meets it)
    )
    return _frontiers_beside(graph, calls, candidates, batch, edges) if edges else alone


def _frontiers_beside(
    graph: LossGraph, calls: list[Call], candidates: list[Output], batch: int, edges: frozenset
) -> dict[tuple[int, int], tuple[object, list[shared_outputs.Frontier] | None]]:
    """`_frontiers` with the outputs at `edges` (node, output_nr) taken as shared beside each candidate."""
    regions: dict[int, list[set[Node]]] = {}
    found = {}
    for out in candidates:
        call = calls[out.call]
        edge = call.edges[out.index]
        if len(call.edges) == 1:
            frontiers = graph.frontiers(edge, batch, edges)
        else:  # (only its uses outside the call: the paths to the call's other outputs are theirs)
            if out.call not in regions:
                regions[out.call] = _regions(call)
            others = [k for k in range(len(call.edges)) if k != out.index]
            inside = set().union(*(regions[out.call][k] for k in others))
            siblings = {(call.edges[k].node, call.edges[k].output_nr) for k in others}
            frontiers = shared_outputs.outside_frontiers(edge, graph.parents, batch, inside, siblings, edges)
            if frontiers == [] and not graph.frontiers(edge, batch, edges):
                frontiers = None  # (mis-shaped, or not reaching the loss, whatever the call's other outputs)
        found[(out.call, out.index)] = (out.meta.shape, frontiers)
    return found


def sample_readers(
    known: Knowledge,
    calls: list[Call],
    candidates: set[tuple[int, int]],
    batch: int,
    fitting: set[tuple[int, int]] | None = None,
) -> set[tuple[int, int]]:
    """The `candidates` (call, output) that pass for shared across the batch but are computed from rows of samples
    (`_reads_rows`): a layer's `[B, d]` outputs expanded to every sample, `h.unsqueeze(0).expand(B, B, d)` in
    in-batch attention, have the shapes and graph of a `[T, d]` table with T == B (a breaker's added 2 B C). Data
    untracked by autograd among a call's inputs is taken as read only for the outputs that fit the batch by size
    (`fitting`, all where None); one without the batch dim reading it is refused by its rule (`generic`'s
    re-run with the data's values changed: BioGPT's positions take the float attention mask for its shape)."""
    readers: set[tuple[int, int]] = set()
    while candidates - readers:  # (none on most steps: this runs in every norm pass)
        rows = {
            calls[o.call].edges[o.index].node
            for o in outputs(known.plan, calls)
            if ((o.call, o.index) not in candidates or (o.call, o.index) in readers)
            and not lacks_batch(o.meta.shape, o.dim, batch)
        }
        found = {
            key
            for key in candidates - readers
            if _reads_rows(calls[key[0]], key[1], rows, batch, fitting is None or key in fitting)
        }
        if not found:
            break
        readers |= found
    return readers


def _reads_rows(call: Call, index: int, rows: set[Node], batch: int, untracked: bool = True) -> bool:
    """Whether output `index` of `call` is computed from rows of samples: from `rows` (outputs with the batch),
    or from floating-point data autograd does not track with a multiple of B rows (a layer on the model's input,
    `Linear(x)`; a position table of T == B rows is read so too, and refused: a batch size that does not divide T
    tells them apart). Autograd does not record which of a call's outputs read such data: where the call has
    several, each is taken to (`untracked`: only for outputs that fit the batch by size; one without the batch
    reading it is refused by its rule, as a module returning `(x.mean(0, keepdim=True) @ w, b[None])` is by the
    generic rule's re-run with the data changed)."""
    node = call.edges[index].node
    inputs = [child for child, _ in node.next_functions if child is not None] if node is not None else []
    is_data = functools.partial(_is_data, batch=batch)
    if untracked and any(t.grad_fn is None and is_data(t) for t in call.tensor_inputs()):
        return True
    return shared_outputs.computed_from(inputs, rows, is_data)


def _is_data(tensor: Tensor | None, batch: int) -> bool:
    """Floating-point, no parameter, with a multiple of B rows in dim 0: the data (as given, or made to require
    grad: `x.requires_grad_()`, an adversarial perturbation `x + delta`), or a table of T = k B positions."""
    return (
        isinstance(tensor, Tensor)
        and not isinstance(tensor, nn.Parameter)
        and tensor.is_floating_point()
        and tensor.dim() > 0
        and tensor.shape[0] % batch == 0
    )


def unshared_without_batch(known: Knowledge, graph: LossGraph, calls: list[Call]) -> bool:
    """Whether an output of a rule site's call lacks the batch yet is not found shared (`shared`: no frontier where
    the batch appears above it, as where a broadcast's two dims of size B cannot be told apart, T == B): the norm
    pass would refuse it as a call on a batch of one, where a verifying pass learns how its parameters are counted
    (the generic rule of a module enclosing the call), as on a first step of these sizes."""
    batch = graph.loss.shape[0]
    if batch < 2:
        return False
    lacking = [(o.call, o.index) for o in outputs(known.plan, calls) if lacks_batch(o.meta.shape, o.dim, batch)]
    return bool(lacking) and not set(lacking) <= shared(known, graph, calls)[0].keys()


def _regions(call: Call) -> list[set[Node]]:
    """Per output of the call, the call's part of the graph below it: the nodes from its edge down to the call's
    inputs."""
    stop = {(e.node, e.output_nr) for e in call.input_edges}
    regions = []
    for edge in call.edges:
        region = {edge.node}
        pending = [edge.node]
        while pending:
            node = pending.pop()
            for child in node.next_functions:
                if child[0] is not None and child not in stop and child[0] not in region:
                    region.add(child[0])
                    pending.append(child[0])
        regions.append(region)
    return regions


def broadcast_though_fitting(known: Knowledge, graph: LossGraph, calls: list[Call]) -> list[Ambiguous]:
    """Rule site outputs whose size fits the batch (B, or B * k rows) but that a later op broadcasts over the
    batch: shared across the batch, or rows broadcast again; where no verifying pass can run, sizes cannot tell."""
    return [
        (known.plan.site(calls[out.call].module).label, out.meta.shape, [])
        for out in _broadcast_though_fitting(known, graph, calls)
    ]


def calls_broadcast_though_fitting(known: Knowledge, graph: LossGraph, calls: list[Call]) -> list[int]:
    """The calls (indices) with an output `broadcast_though_fitting`: one that passes a verifying pass as
    per-sample rows does so only where the loss reads each of its rows from one sample (masks), and decides no
    layout (GPT-2's `[T, d]` position embedding with T = 2B, each sample reading T / B positions of its own)."""
    return sorted({out.call for out in _broadcast_though_fitting(known, graph, calls)})


def _broadcast_though_fitting(known: Knowledge, graph: LossGraph, calls: list[Call]) -> list[Output]:
    batch = graph.loss.shape[0]
    found = []
    for out in outputs(known.plan, calls) if batch > 1 else ():
        call = calls[out.call]
        fits = not lacks_batch(out.meta.shape, out.dim, batch)
        if fits and id(call.module) not in known.shared_sites and graph.frontiers(call.edges[out.index], batch):
            found.append(out)
    return found


def explain_failures(
    known: Knowledge, graph: LossGraph, calls: list[Call], failing: list[int]
) -> tuple[Found, Knowledge]:
    """Why calls' output rows were found not per-sample, to be verified again: outputs shared across the batch
    (their dims equal B by chance), position-wise layers with the batch in a later dim (time-major, T equal to B by
    chance), and other layers whose dim 0 is not the batch (NOT_BATCH_FIRST: their parameters are to be covered
    again). REFUSED where that cannot explain the failure: every layer fails (the losses mix samples), or the
    layers were already known not batch-first."""
    batch = graph.loss.shape[0]
    sharing = {i for i in failing if any(graph.frontiers(edge, batch) for edge in calls[i].edges)}
    candidates = {(i, j) for i in sharing for j in range(len(calls[i].edges))}
    sharing -= {i for i, _ in sample_readers(known, calls, candidates, batch)}
    time_major = {i: d for i in failing if i not in sharing and (d := time_major_dim(known.plan, calls[i], batch))}
    others = [i for i in failing if i not in sharing and i not in time_major]
    if others and len(set(failing)) == len(calls):  # every layer fails: the losses mix samples
        return Found.REFUSED, known
    if others and all(id(calls[i].module) in known.not_batch_first for i in others):  # known, not covered
        return Found.REFUSED, known
    known = known.sharing(id(calls[i].module) for i in sharing)
    if time_major:  # (verified by the redone pass)
        known = known.with_layout(known.plan.with_batch_dims({calls[i].module: d for i, d in time_major.items()}))
    if others:  # (a time-major layer without a position-wise rule, whose T equals B)
        return Found.NOT_BATCH_FIRST, known.not_batch_first_too(id(calls[i].module) for i in others)
    return Found.RELEARNT, known
