"""Measuring one backward: the per-sample norms of every trainable parameter the loss reaches, checked.

`measure` is the one place that retries: it covers a forward structure not yet verified, then verifies it in
attempts, each a pair of passes without state of their own (`_verifying_pass`) that returns either the verified
layout or a finding about it (shared outputs, a time-major layer, a layer not batch-first) to learn from and try
again. The self-check's passes follow, then ONE norm pass (`_norm_pass`) as on a step that checks nothing, unless
the verifying pass was the norm pass. What was learnt comes back as a new `Knowledge`, which the caller commits
only if the whole backward succeeds. The loss graph is indexed once (`LossGraph`) and shared by every stage.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashdp._pipeline import aliasing, clipping, learning, nonfinite, routing, self_check
from flashdp._pipeline.broadcast_params import frontier_edges
from flashdp._pipeline.clipped_sums import Keeps, Norms, SumSink
from flashdp._pipeline.collector import NormCollector, no_trainable_layer_error
from flashdp._pipeline.frontier_rows import FrontierRows
from flashdp._pipeline.grad_writes import GradWrites
from flashdp._pipeline.knowledge import Knowledge
from flashdp._pipeline.layout import (
    Ambiguous,
    ambiguous,
    ambiguous_error,
    dims_of,
    other_readings,
    shapes_of,
    structure,
)
from flashdp._pipeline.learning import Found
from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.norm_pass import stream_output_gradients
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.profiling import PhaseTimer
from flashdp._pipeline.recomputation import releasing_packed_inputs
from flashdp._pipeline.recorder import Call, Recorder
from flashdp._pipeline.settings import EngineSettings
from flashdp._pipeline.shared_outputs import capturing_per_sample_gradients
from flashdp._pipeline.users import UserGroups
from flashdp._pipeline.verifying import Verifying, receiver, refusal
from flashdp.distributed import Adapter
from flashdp.distributed.checks import highest_on_any_rank
from flashdp.errors import FlashDPError, another_rank_refused
from flashdp.kernels import backend as kernels_backend
from flashdp.per_sample import computed_in_tf32, tf32_allowed
from flashdp.rules.recompute import raise_failed


@dataclass(frozen=True)
class Parts:
    """The engine's parts a measurement uses (none of them is changed by it)."""

    settings: EngineSettings
    adapter: Adapter
    timer: PhaseTimer
    recorder: Recorder
    #: the model's `named_parameters`
    registered: learning.Registered
    #: the tensor-parallel group over which a sample's squared norms are summed, if any
    norm_group: dist.ProcessGroup | None
    #: the self-check's random choices, the same on every rank
    check_generator: torch.Generator
    #: the watch on `.grad` writes during the backward (the self-check's passes write none)
    grad_writes: GradWrites
    #: how each parameter's norm was computed in the last backward that reached its norms (`engine.strategies`,
    #: also after a backward refused later: what to look at when a layer is slow or fails)
    strategies: dict[str, str]

    def on_any_rank(self, flags: Iterable[int], device: torch.device) -> list[int]:
        """Each flag, the highest any data-parallel rank has: every rank takes the same decision."""
        return highest_on_any_rank([int(f) for f in flags], self.adapter.dp_group, device)


@dataclass
class Measurement:
    """Each reached parameter's squared norms `[B]` (and clipped-sum plan), the clipping groups' squared norms
    `[L, B]` float64, and the samples whose gradient is not finite (nonfinite="skip") or None. With users, B is
    the number of users (`UserGroups`) and a sample is a user."""

    norms: Norms
    clip_norms_sq: Tensor
    skipped: Tensor | None
    #: where the norm pass kept its calls and the graph (ghost, flash): the same pass again, each parameter's
    #: contributions handed to the given sink as they are complete (`summing_pass`); else None
    again: Callable[[SumSink, set[Hashable]], None] | None = None


@dataclass
class _Pass:
    """A norm pass that went through: what is known after it (the outputs it found shared across the batch), its
    collector, and the dtypes it saw."""

    known: Knowledge
    collector: NormCollector
    dtypes: list[torch.dtype]
    #: where the outputs it took as shared met the batch (`learning.frontier_places`)
    frontiers: tuple = ()


@dataclass(frozen=True)
class _Verified:
    """A verifying pass found every call's rows per-sample: whether it decided the layout for later steps (every
    sample seen), the routing above its calls (what that layout rests on), and the norm pass it was, if it was one."""

    known: Knowledge
    decided: bool
    routed: routing.Routing
    done: _Pass | None


@dataclass(frozen=True)
class _Finding:
    """A verifying pass found what explains its failure: try again with `known` (covering again first when
    layers were found not batch-first)."""

    known: Knowledge
    cover_again: bool
    #: whether a layout was learnt (not only parameters sent back to the generic rule: `Knowledge.unbroadcast`)
    layout: bool = True


def measure(
    parts: Parts,
    known: Knowledge,
    loss: Tensor,
    calls: list[Call],
    index: int,
    keeps: Keeps,
    users: UserGroups | None = None,
    refusal: FlashDPError | None = None,
) -> tuple[Measurement, Knowledge]:
    """The checked norms of backward number `index` of the forward that recorded `calls` (handed over: emptied as
    the norm pass releases them), and what the engine knows after it. Runs the coverage walk (on every backward:
    `learning.uncovered`), verification on a forward structure not yet verified or newly covered, the self-check
    when due, and every rank's agreement on them, and on `refusal` (this rank's, raised on every rank). With
    `users`, the norms are those of each user's rows together.

    The checks' passes hold the graph and nothing a norm pass keeps for the sums: bk's norm pass, which keeps
    them and frees the graph as it goes, runs after the checks as on any step (a norm pass that keeps the graph
    anyway, ghost's, is the verifying pass). A structure (with users, their partition of the rows too) is trusted
    only under the routing it was verified under (`routing.py`): a step whose rows move otherwise between a rule
    site's output and the loss is verified again, or refused where no verifying pass can run."""
    batch, graph = loss.shape[0], LossGraph(loss, users)
    # A call none of whose outputs the loss reads has no gradient: dropped, it is not part of the structure (a step
    # on which it is read is another one, verified again) and holds nothing through the passes (inside a
    # checkpointed region, its inputs and output's node would keep each pass's recomputation). One whose output was
    # modified in place is kept: the norm pass refuses it, its gradient hidden.
    calls[:] = [c for c in calls if any(graph.reads(edge) for edge in c.edges) or c.modified_in_place()]
    refusal = refusal or _modified_inputs(known.plan, calls)
    shapes, placed = shapes_of(calls), _placed(known, graph, calls)
    checking = known.self_check.due(index)
    if checking:
        known = known.self_checked(index)
    routed = _routing(known, graph, calls) if batch > 1 else routing.NONE
    new_structure = _new_structure(parts, known, graph, calls, checking, (shapes, placed, routed))
    if checking or new_structure:
        plan = known.plan
        known, checking, refusal = _cover(parts, known, graph, calls, checking, refusal)
        if known.plan is not plan and batch > 1:  # (other rule sites: the routing above them)
            routed = _routing(known, graph, calls)
    verify = (checking or new_structure) and parts.adapter.allows_second_pass
    verify &= batch > 1 or parts.adapter.world_size > 1  # (FSDP collectives: every rank runs the passes)
    unverifiable = _unverifiable(
        known, graph, calls, shapes, routed, new_structure and not parts.adapter.allows_second_pass
    )
    verify, checking, widest = _agreed(parts, graph, verify, checking, unverifiable, refusal)
    verified = _Verified(known, True, routed, None)
    if verify:
        verified, checking = _verify(parts, known, graph, calls, checking, (routed, widest), keeps)
    known = verified.known
    unit_gradients = _unit_gradients(parts, known, graph, calls, keeps) if checking else None
    done = verified.done or _norm_pass(parts, known, graph, calls, keeps)
    calls.clear()
    known = done.known
    measurement = _finish(parts, known, graph, done, keeps, unit_gradients)
    # a batch of one decides no layout: every dim fits it, its rows are all its own
    if batch > 1 and verified.decided and (verify or new_structure):  # (the frontiers of what the pass took shared)
        known = _verified(known, shapes, graph, (placed[0], done.frontiers), verified.routed)
    return measurement, known


def _routing(known: Knowledge, graph: LossGraph, calls: list[Call]) -> routing.Routing:
    """`routing.of` the calls, and of the frontiers of the parameters counted where they meet the batch."""
    return routing.of(graph, known.plan, calls, known.shared_sites, frontier_edges(known, graph, calls))


def _placed(known: Knowledge, graph: LossGraph, calls: list[Call]) -> tuple:
    """Where the calls' outputs and inputs sit in the graph, and where the outputs shared across the batch meet it
    (`learning.frontier_places`): what a verified structure rests on besides the calls' shapes and the ops."""
    edges = graph.places(e for c in calls for e in (c.edges, c.input_edges))
    return edges, learning.frontier_places(known, graph, calls)


def _new_structure(
    parts: Parts, known: Knowledge, graph: LossGraph, calls: list[Call], checking: bool, seen: tuple
) -> bool:
    """Whether this backward's structure is to be verified: not verified under its routing (`seen`: the calls'
    shapes, their places in the graph, the routing), using a parameter outside the sites counting it (asked where
    no self-check covers it anyway), or with an output lacking the batch whose broadcast these sizes cannot place
    (`learning.unshared_without_batch`)."""
    shapes, placed, routed = seen
    if not known.trusts(_structure(known.plan, shapes, graph, placed), routed):
        return True
    if not checking and learning.uncovered(known, graph, calls, parts.registered):
        return True
    return learning.unshared_without_batch(known, graph, calls)


def _modified_inputs(plan: GradientPlan, calls: list[Call]) -> FlashDPError | None:
    """The refusal of a call whose input was modified in place since (the rules read the inputs as they are now),
    found before any pass: the checks' passes would meet autograd's own version check, or not where it saved a
    copy. The norm pass checks again as each rule runs."""
    modified = next((c for c in calls if c.input_modified()), None)
    return None if modified is None else modified.input_modified_error(plan.site(modified.module).label)


def _agreed(
    parts: Parts,
    graph: LossGraph,
    verify: bool,
    checking: bool,
    unverifiable: tuple[list[Ambiguous], list],
    refusal: FlashDPError | None,
) -> tuple[bool, bool, int]:
    """Whether to verify and to self-check, as any rank decides, and the most units any rank has (one agreement);
    refused on every rank where any rank has a structure it cannot verify (`_unverifiable`) or a refusal of its
    own."""
    unclear, moved = unverifiable
    flags = [verify, checking, bool(unclear), bool(moved), refusal is not None, graph.units]
    *agreed, widest = parts.on_any_rank(flags, graph.loss.device)
    verify, checking, refuse, refuse_moved, refused = map(bool, agreed)
    if refused:
        raise refusal or another_rank_refused()
    if refuse:
        raise ambiguous_error(unclear)
    if refuse_moved:
        raise routing.unverifiable_error(moved)
    return verify, checking, widest


def _verified(known: Knowledge, shapes: list, graph: LossGraph, placed: tuple, routed: routing.Routing) -> Knowledge:
    """This step's structure verified under `routed`, and a batch of one's with it."""
    plain = structure(known.plan, shapes, 1)
    return known.verifying(_structure(known.plan, shapes, graph, placed), routed, plain)


def _structure(plan: GradientPlan, shapes: list, graph: LossGraph, placed: tuple) -> tuple:
    """`layout.structure`, the graph's operations and where each call's outputs and inputs sit among them
    (`LossGraph.operations`, `places`: a verified layout rests on the ops between the layers and the loss as much
    as on the layers) and, with users, their partition of the rows (the batch-independence check weights by user,
    so a step whose users group the rows otherwise is verified again). A batch of one: the layers alone."""
    batch, users = graph.loss.shape[0], graph.users
    layout = structure(plan, shapes, batch)
    if batch < 2:
        return layout
    layout = (*layout, ("operations", graph.operations, placed))
    return layout if users is None or not users.partition else (*layout, ("users", users.partition))


def _unverifiable(
    known: Knowledge, graph: LossGraph, calls: list[Call], shapes: list, routed: routing.Routing, unverified: bool
) -> tuple[list[Ambiguous], list]:
    """For a new structure under a wrapper that cannot run a verifying pass (FSDP1, `unverified`): the outputs
    whose batch dim sizes alone cannot tell (B in two dims, or a size that fits the batch on an output broadcast
    over it), and the rule sites whose rows move otherwise than where the structure was verified."""
    if not unverified:
        return [], []
    batch = graph.loss.shape[0]
    unclear = ambiguous(known.plan, shapes, batch) + learning.broadcast_though_fitting(known, graph, calls)
    return unclear, routed.deciding


def _cover(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    calls: list[Call],
    checking: bool,
    refusal: FlashDPError | None = None,
) -> tuple[Knowledge, bool, FlashDPError | None]:
    """Cover this forward structure (`learning.cover`), and whether this backward runs the per-sample check: a
    plan changed here is checked at once, even with self_check=None (a module that has just become a generic
    rule site was recorded as a scope, without the outputs its rule's check of the recomputation compares). A
    refusal of the coverage is raised here on one process; on several it is returned, as `refusal` (this rank's
    first), for every rank to raise together: the other ranks are on their way to the next agreement."""
    reshards = parts.adapter.reshards_after_forward
    try:
        known, changed = learning.cover(known, graph, calls, parts.registered, reshards)
    except FlashDPError as error:
        if parts.adapter.world_size == 1:
            raise
        return known, checking, refusal or error
    return known, (parts.adapter.allows_second_pass if changed else checking), refusal


def _verify(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    calls: list[Call],
    checking: bool,
    routing_and_widest: tuple[routing.Routing, int],
    keeps: Keeps,
) -> tuple[_Verified, bool]:
    """Verify the layout of `calls`' layers, learning from each failure that explains itself (a layer found not
    batch-first is covered again, which may make the self-check due): the verified pass, and whether the
    self-check is due. `routing_and_widest`: the routing above the calls, and the most units any rank has."""
    routed, widest = routing_and_widest
    learnt = False  # (a layout learnt on this backward: see `Verifying.undecidable`)
    for _ in range(3 * len(calls) + 2):  # each finding teaches something new about one of the calls
        outcome = _verifying_pass(parts, known, graph, calls, (routed, widest), keeps, after_learning=learnt)
        known = outcome.known
        if isinstance(outcome, _Verified):
            return outcome, checking
        learnt |= outcome.layout
        if outcome.cover_again:
            known, checking, refusal = _cover(parts, known, graph, calls, checking)
            checking, refused = map(bool, parts.on_any_rank([checking, refusal is not None], graph.loss.device))
            if refused:
                raise refusal or another_rank_refused()
    raise FlashDPError("flashdp could not settle the layout of this forward's layers; nothing was added to .grad.")


def _verifying_pass(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    calls: list[Call],
    routing_and_widest: tuple[routing.Routing, int],
    keeps: Keeps,
    after_learning: bool,
) -> _Verified | _Finding:
    """One pass over the graph that sketches each call's output gradients, and the weighted pass compared with the
    sketches (see `_verdict`), under the routing above these calls. Where the norm pass keeps the graph anyway
    and nothing for sums (ghost, flash, norms only), the sketching pass is that norm pass (`_Verified.done`), a
    rule's error deferred until the layout explains it or not; else (bk, whose norm pass frees the graph as it
    goes) it computes no norm, and the norm pass runs once the layout is verified."""
    batch, (routed, widest) = graph.loss.shape[0], routing_and_widest
    rule_calls, aliased = _rule_calls(known.plan, calls)
    shared, known = learning.shared(known, graph, rule_calls)
    if batch > 1:
        routed = _routing(known, graph, rule_calls)
    dims = [dims_of(known.plan, c) for c in rule_calls]
    others = [other_readings(known.plan, c, batch) for c in rule_calls]
    verifying = Verifying(rule_calls, dims, set(shared), batch, others, after_learning, widest)
    verifying.frontier_rows = FrontierRows.of(shared, batch)
    if aliased is not None:  # (raised once the layout is verified: learning it may move the parameter to an
        verifying.errors.append(aliased)  # enclosing generic rule, which counts it once)
    done = None
    if keeps.graph and not keeps.plans:
        with releasing_packed_inputs([c for c in calls if not known.plan.site(c.module).match]):  # (scopes)
            done = _collect(parts, known, graph, list(rule_calls), shared, keeps, verifying)
    else:
        with (
            parts.timer.phase("checks"),
            parts.adapter.norm_pass(),
            releasing_packed_inputs(calls),
            verifying.sketching_frontiers(),
        ):
            stream_output_gradients(
                graph, list(rule_calls), verifying.keep, held=(), retain_graph=True, reach=verifying.frontier_rows.reach
            )
    found, known, layout = _verdict(parts, known, graph, verifying, calls)
    if found is Found.VERIFIED:
        return _Verified(known, verifying.decided(), routed, done)
    return _Finding(known, cover_again=found is Found.NOT_BATCH_FIRST, layout=layout)


def _verdict(
    parts: Parts, known: Knowledge, graph: LossGraph, verifying: Verifying, recorded: list[Call]
) -> tuple[Found, Knowledge, bool]:
    """What the verifying pass found, agreed by every rank (the highest any of them found), with what explains a
    failure, and whether that is a layout (`_Finding.layout`); raises where nothing does."""
    loss, calls = graph.loss, verifying.calls
    rtol = self_check.tolerance([loss.dtype, *(m.dtype for c in calls for m in c.output_meta)], _in_tf32(graph))
    with torch.no_grad(), parts.adapter.norm_pass(), parts.timer.phase("checks"), releasing_packed_inputs(recorded):
        failing, verifying.passing_elsewhere = self_check.batch_independence_failures(
            loss, calls, verifying.sketches, verifying.dims, rtol, parts.check_generator, graph.users,
            verifying.other_layouts, verifying.widest, verifying.frontier_rows,
        )  # fmt: skip
        failing = sorted({*failing, *verifying.without_batch})
    rows = verifying.frontier_rows
    if rows and rows.failing_calls(parameters=False):
        labels = [known.plan.site(calls[i].module).label for i in rows.failing_calls(parameters=False)]
        verifying.errors.insert(0, rows.error(labels))
    found, learnt = learning.explain_failures(known, graph, calls, failing) if failing else (Found.VERIFIED, known)
    layout = found is not Found.VERIFIED
    if rows and rows.failing_calls(parameters=True):  # (their generic rule counts them: the pass is redone)
        learnt = learnt.not_broadcast(id(calls[i].module) for i in rows.failing_calls(parameters=True))
        found = max(found, Found.RELEARNT)
    if found is Found.VERIFIED:  # (outputs a later op broadcasts over the batch, passing as per-sample rows)
        broadcast = learning.calls_broadcast_though_fitting(known, graph, calls)
        verifying.passing_elsewhere = sorted({*verifying.passing_elsewhere, *broadcast})
    undecidable = verifying.undecidable(known.plan) if found is Found.VERIFIED else None
    if undecidable is not None:
        verifying.errors.insert(0, undecidable)
    if found is Found.VERIFIED and verifying.errors:
        found = Found.REFUSED
    agreed = Found(max(parts.on_any_rank([found], loss.device)))
    if agreed is Found.REFUSED:
        raise refusal(known.plan, calls, failing, verifying.errors, refused_here=found is agreed)
    return agreed, learnt, layout


def _unit_gradients(
    parts: Parts, known: Knowledge, graph: LossGraph, calls: list[Call], keeps: Keeps
) -> list[self_check.UnitGradient]:
    """The self-check's first part, on the graph before the norm pass: a few samples' (or users') true gradients
    by autograd, reduced to what `_finish` compares with the counts (`self_check.unit_gradients`)."""
    count = self_check.SAMPLES_PER_CHECK
    picks = torch.randperm(max(graph.units, 1), generator=parts.check_generator, device="cpu")[:count].tolist()
    units = [_unit(graph.users, picks[k % len(picks)]) for k in range(count)]  # as many passes on every rank
    rule_calls, _ = _rule_calls(known.plan, calls)
    held = _graph_tensors(known.plan, rule_calls)
    seed = int(torch.randint(2**31, (), generator=parts.check_generator, device="cpu"))
    with (
        parts.adapter.norm_pass(),
        parts.timer.phase("checks"),
        releasing_packed_inputs(calls),
        parts.grad_writes.capturing(),
    ):
        return self_check.unit_gradients(graph.loss, held, units, projected=keeps.plans, seed=seed)


def _norm_pass(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    calls: list[Call],
    keeps: Keeps,
    sums: SumSink | None = None,
    fingerprints: list[Tensor | None] | None = None,
) -> _Pass:
    """One norm pass over `calls` (handed over: from here the collector holds each call, and releases it once its
    gradients are in); the graph is kept only where `keeps` says. With `sums`, a summing pass (`summing_pass`)."""
    rule_calls, aliased = _rule_calls(known.plan, calls)
    if aliased is not None:
        raise aliased
    if fingerprints is not None and len(fingerprints) != len(rule_calls):  # (the kept calls are rule calls already)
        raise RuntimeError("flashdp: the second pass's calls are not the first pass's")
    calls.clear()
    shared, known = learning.shared(known, graph, rule_calls)
    return _collect(parts, known, graph, rule_calls, shared, keeps, sums=sums, fingerprints=fingerprints)


def _collect(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    rule_calls: list[Call],
    shared: dict,
    keeps: Keeps,
    verifying: Verifying | None = None,
    sums: SumSink | None = None,
    fingerprints: list[Tensor | None] | None = None,
) -> _Pass:
    """The norm pass over `rule_calls` (handed over): each call's output gradients go to a collector as autograd
    computes them (and, `verifying`, to its sketches, the graph kept)."""
    loss, batch = graph.loss, graph.loss.shape[0]
    dtypes = [loss.dtype, *(m.dtype for c in rule_calls for m in c.output_meta)]
    frontiers = learning.frontier_places(known, graph, rule_calls)
    collector = NormCollector(
        known.plan,
        rule_calls,
        batch,
        strategy=parts.settings.norm_strategy,
        keep_for_sum=keeps.plans,
        backend=parts.settings.backend,
        recorder=parts.recorder,
        shared=shared,
        defer_checks=True,
        users=graph.users,
        sums=sums,
        fingerprints=fingerprints,
        **keeps.for_overflow,
    )
    sharing = capturing_per_sample_gradients(list(shared.values()), batch)
    with (
        parts.timer.phase("norm pass" if sums is None else "second pass / bk sums"),
        parts.adapter.norm_pass(),
        sharing,
        verifying.sketching_frontiers() if verifying else contextlib.nullcontext(),
    ):
        stream_output_gradients(
            graph,
            rule_calls,
            receiver(collector, verifying),
            {i for i, _ in shared},
            keeps.graph or verifying is not None,
            prepare=collector.unpack,
            reach=[output.edge for output in shared.values() if output.parameter],
        )
    return _Pass(known, collector, dtypes, frontiers)


def _finish(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    done: _Pass,
    keeps: Keeps,
    unit_gradients: list[self_check.UnitGradient] | None,
) -> Measurement:
    """The norms of the pass: the clipping groups' (a float32 overflow recomputed in float64, summed over the
    tensor-parallel group), the non-finite policy applied, and the per-sample self-check's comparison when due."""
    units, groups = graph.units, len(known.plan.clip_group_names)
    with torch.no_grad(), kernels_backend(parts.settings.backend), parts.timer.phase("norm computation"):
        norms = done.collector.finish()
        clip_norms_sq = _group_norms_sq(norms, groups, units)
        checks = done.collector.deferred or []
        # one device sync for the rules' recomputations as recorded and the squared norms finite
        *recomputed, finite = torch.stack([*(ok for ok, _ in checks), torch.isfinite(clip_norms_sq).all()]).tolist()
        raise_failed(checks, recomputed)  # (as if raised in the pass: before the strategies are known)
        parts.strategies.clear()
        parts.strategies.update((param.name, norm.strategy) for param, norm in norms)
        if not finite:  # a float32 norm that overflowed, or a NaN/inf gradient
            norms = _float64_norms(parts, known, graph, norms, done.collector, keeps)
            clip_norms_sq = _group_norms_sq(norms, groups, units)
        kept, fingerprints, done.collector = done.collector.calls, done.collector.fingerprints, None
        again = None
        if kept and keeps.graph:
            again = functools.partial(summing_pass, parts, known, graph, list(zip(kept, fingerprints, strict=True)))
        if parts.norm_group is not None:  # a sample's computation is split across this group (tensor parallel)
            with parts.timer.phase("communication"):
                dist.all_reduce(clip_norms_sq, op=dist.ReduceOp.SUM, group=parts.norm_group)
        policy, group = parts.settings.nonfinite, parts.adapter.dp_group
        skipped = nonfinite.nonfinite_samples(policy, clip_norms_sq, norms, group, finite, graph.users)
        if unit_gradients is not None:
            rtol = self_check.tolerance(done.dtypes, _in_tf32(graph))
            counted = [self_check.Counted(p.name, p.key, n.norm_sq, n.plan, n.bound_sq) for p, n in norms]
            least = clipping.least_bound(parts.settings.clipping, parts.settings.max_grad_norm, groups)
            self_check.check_per_sample(unit_gradients, counted, rtol, least)
    return Measurement(norms, clip_norms_sq, skipped, again)


def summing_pass(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    kept: list[tuple[Call, Tensor | None]],
    sums: SumSink,
    wanted: Collection[Hashable],
) -> None:
    """The norm pass again over the kept graph, freeing it as it goes: the same backward of `sum_i loss_i` over the
    same ops, so each call's output gradients are those its norms were measured from where the ops are
    deterministic and no hook returns another gradient than before: checked against the first pass's fingerprint
    of each call's gradients (`kept`: the calls with theirs), the outcome handed with each `wanted` parameter's
    contributions to `sums` once complete; no norm is taken. Only the calls counting a wanted parameter run. The
    rules' recomputations are those the norm pass checked (the same inputs, the same replayed random state): not
    checked again (a device sync)."""
    plan = known.plan
    counting = [
        any(plan.param_of[(id(c.module), n)].key in wanted for n in plan.site(c.module).trainable) for c, _ in kept
    ]
    # (a call left out still has its packed inputs recomputed by its checkpointed region in this pass, held until
    # unpacked: dropped as the pass reaches it, or each region's recomputation would live to the end of the pass)
    left_out = [c for (c, _), counts in zip(kept, counting, strict=True) if not counts]
    kept = [pair for pair, counts in zip(kept, counting, strict=True) if counts]
    if kept:
        calls, fingerprints = [c for c, _ in kept], [f for _, f in kept]
        keeps = Keeps(graph=False, plans=False, for_overflow={})
        with releasing_packed_inputs(left_out):
            _norm_pass(parts, known, graph, calls, keeps, sums=sums, fingerprints=fingerprints).collector.finish()


def _float64_norms(
    parts: Parts, known: Knowledge, graph: LossGraph, norms: Norms, collector: NormCollector, keeps: Keeps
) -> Norms:
    """`norms` with every parameter whose squared norms are not all finite recomputed in float64 from what the
    collector kept (`Keeps.for_overflow`): its contributions, or its calls for a second norm pass."""
    gradients = collector.gradients
    if any(n.plan is None and p.key not in gradients for p, n in norms if not nonfinite.all_finite(n.norm_sq)):
        again = Keeps(graph=keeps.graph, plans=False, for_overflow={"keep_gradients": True})
        redo = _norm_pass(parts, known, graph, list(collector.calls), keeps=again)
        redo.collector.finish()
        raise_failed(redo.collector.deferred)
        gradients = redo.collector.gradients
    return nonfinite.recompute_overflowed(norms, gradients, graph.units)


def _rule_calls(plan: GradientPlan, calls: list[Call]) -> tuple[list[Call], FlashDPError | None]:
    """The calls of rule sites (scopes only enclose them), without the outputs their rules do not read, each
    output's gradient edge counted once per parameter (`aliasing`, on every backward); or, with the error, as
    recorded where that cannot be exact."""
    rule_calls = [
        c if plan.site(c.module).match.rule.per_call else c.without_outputs()
        for c in calls
        if plan.site(c.module).match
    ]
    if not rule_calls:
        raise no_trainable_layer_error()
    try:
        return aliasing.one_holder_per_edge(plan, rule_calls), None
    except FlashDPError as error:
        return rule_calls, error


def _graph_tensors(plan: GradientPlan, calls: list[Call]) -> dict[object, Tensor]:
    """Each trainable parameter as the forward used it (a wrapper may have swapped in another tensor)."""
    held = {p.key: p.param for p in plan.params}
    for call in calls:
        for name, tensor in call.params.items():
            param = plan.param_of.get((id(call.module), name))
            if param is not None and tensor.requires_grad:
                held[param.key] = tensor
    return held


def _unit(users: UserGroups | None, index: int) -> self_check.Unit:
    if users is None:
        return self_check.Unit(index, [index], f"sample {index}")
    return self_check.Unit(index, users.rows_of(index), f"user {users.named(index)}")


def _group_norms_sq(norms: Norms, groups: int, batch: int) -> Tensor:
    """`[L, B]` float64 squared norms of the L clipping groups."""
    norms_sq = [norm.clip_norm_sq for _, norm in norms]
    return clipping.group_norms_sq(norms_sq, tuple(param.clip_group for param, _ in norms), groups, batch)


#: the nodes of cuDNN's operations that TF32 settings of their own govern (`per_sample.tf32_allowed`)
_CUDNN_NODES = {"ConvolutionBackward0": "conv", "CudnnConvolutionBackward0": "conv", "CudnnRnnBackward0": "rnn"}


def _in_tf32(graph: LossGraph) -> bool:
    """Whether the float32 loss's graph may have been computed in TF32, for the checks' tolerance: anywhere where
    TF32 matrix multiplies are allowed, else where it holds a cuDNN convolution or recurrent layer allowed TF32
    (the default): a float32 model of linear layers is checked at float32's tolerance on CUDA too."""
    if not computed_in_tf32(graph.loss):
        return False
    if tf32_allowed("matmul"):
        return True
    return any(tf32_allowed(op) for op in {_CUDNN_NODES.get(type(node).__name__) for node in graph.parents} - {None})
