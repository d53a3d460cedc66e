"""Measuring one backward: the per-sample norms of every trainable parameter the loss reaches, checked.

`measure` is the one place that retries: it covers a forward structure not yet verified, then runs attempts, each
ONE norm pass without state of its own (`_attempt`) that returns either the pass or a finding about the layout
(shared outputs, a time-major layer, a layer not batch-first) to learn from and try again. What was learnt comes
back as a new `Knowledge`, which the caller commits only if the whole backward succeeds. The loss graph is indexed
once (`LossGraph`) and shared by every stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashdp._pipeline import aliasing, learning, nonfinite, routing, self_check
from flashdp._pipeline.clipped_sums import Keeps, Norms
from flashdp._pipeline.collector import NormCollector, no_trainable_layer_error
from flashdp._pipeline.knowledge import Knowledge
from flashdp._pipeline.layout import Ambiguous, ambiguous, ambiguous_error, dims_of, shapes_of, structure
from flashdp._pipeline.learning import Found
from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.norm_pass import stream_output_gradients
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.profiling import PhaseTimer
from flashdp._pipeline.recorder import Call, Recorder
from flashdp._pipeline.settings import EngineSettings
from flashdp._pipeline.shared_outputs import capturing_per_sample_gradients
from flashdp._pipeline.users import UserGroups
from flashdp._pipeline.verifying import Verifying, receiver, refusal
from flashdp.distributed import Adapter
from flashdp.distributed.checks import highest_on_any_rank
from flashdp.errors import FlashDPError
from flashdp.kernels import backend as kernels_backend
from flashdp.per_sample import computed_in_tf32
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


@dataclass
class _Pass:
    """A norm pass that went through: what it learnt (the outputs it found shared across the batch), its
    collector, whether it decided the layout for later steps, each trainable parameter as the forward used it (for
    the self-check), the dtypes it saw and the routing above its calls (what a layout it decided rests on)."""

    known: Knowledge
    collector: NormCollector
    decided: bool
    held: dict[object, Tensor]
    dtypes: list[torch.dtype]
    routed: routing.Routing


@dataclass(frozen=True)
class _Finding:
    """A verifying pass found what explains its failure: try again with `known` (covering again first when
    layers were found not batch-first)."""

    known: Knowledge
    cover_again: bool


def measure(
    parts: Parts,
    known: Knowledge,
    loss: Tensor,
    calls: list[Call],
    index: int,
    keeps: Keeps,
    users: UserGroups | None = None,
) -> tuple[Measurement, Knowledge]:
    """The checked norms of backward number `index` of the forward that recorded `calls` (handed over: emptied as
    the norm pass releases them), and what the engine knows after it. Runs the coverage walk (on every backward:
    `learning.uncovered`), verification on a forward structure not yet verified or newly covered, the self-check
    when due, and every rank's agreement on them. With `users`, the norms are those of each user's rows together.

    A structure (with users, their partition of the rows too) is trusted only under the routing it was verified
    under (`routing.py`): a step whose rows move otherwise between a rule site's output and the loss is verified
    again, or refused where no verifying pass can run."""
    batch, graph, shapes = loss.shape[0], LossGraph(loss, users), shapes_of(calls)
    checking = known.self_check.due(index)
    if checking:
        known = known.self_checked(index)
    routed = routing.of(graph, known.plan, calls, known.shared_sites) if batch > 1 else routing.NONE
    new_structure = not known.trusts(_structure(known.plan, shapes, users, batch), routed)
    new_structure = new_structure or (not checking and learning.uncovered(known, graph, calls, parts.registered))
    if checking or new_structure:
        plan = known.plan
        known, checking = _cover(parts, known, graph, calls, checking)
        if known.plan is not plan and batch > 1:  # (other rule sites: the routing above them)
            routed = routing.of(graph, known.plan, calls, known.shared_sites)
    verify = (checking or new_structure) and parts.adapter.allows_second_pass
    verify &= batch > 1 or parts.adapter.world_size > 1  # (FSDP collectives: every rank runs the passes)
    unclear, moved = [], []
    if new_structure and not parts.adapter.allows_second_pass:
        unclear = _unverifiable(known, graph, calls, shapes)
        moved = routed.deciding
    flags = parts.on_any_rank([verify, checking, bool(unclear), bool(moved)], loss.device)
    verify, checking, refuse, refuse_moved = map(bool, flags)
    if refuse:
        raise ambiguous_error(unclear)
    if refuse_moved:
        raise routing.unverifiable_error(moved)
    recorded = list(calls) if verify else []  # (scopes too: a layer found not batch-first is covered again)
    for _ in range(3 * len(recorded) + 2):  # each finding teaches something new about one of the calls
        outcome = _attempt(parts, known, graph, list(recorded) if verify else calls, verify, checking, keeps, routed)
        known = outcome.known
        if isinstance(outcome, _Pass):
            break
        if outcome.cover_again:
            known, checking = _cover(parts, known, graph, list(recorded), checking)
            checking = bool(parts.on_any_rank([checking], loss.device)[0])
    else:
        raise FlashDPError("flashdp could not settle the layout of this forward's layers; nothing was added to .grad.")
    calls.clear()
    del recorded
    measurement = _finish(parts, known, graph, outcome, keeps, checking)
    # a batch of one decides no layout: every dim fits it, its rows are all its own
    if batch > 1 and outcome.decided and (verify or new_structure):
        known = _verified(known, shapes, users, batch, outcome.routed)
    return measurement, known


def _verified(
    known: Knowledge, shapes: list, users: UserGroups | None, batch: int, routed: routing.Routing
) -> Knowledge:
    """This step's structure verified under `routed`, and a batch of one's with it."""
    return known.verifying(_structure(known.plan, shapes, users, batch), routed, structure(known.plan, shapes, 1))


def _structure(plan: GradientPlan, shapes: list, users: UserGroups | None, batch: int) -> tuple:
    """`layout.structure`, and with users their partition of the rows: the batch-independence check weights by
    user, so a step whose users group the rows otherwise (a pair across two users) is verified again."""
    layout = structure(plan, shapes, batch)
    return layout if users is None or not users.partition else (*layout, ("users", users.partition))


def _unverifiable(known: Knowledge, graph: LossGraph, calls: list[Call], shapes: list) -> list[Ambiguous]:
    """Under a wrapper that cannot run a verifying pass (FSDP1), the outputs whose batch dim sizes alone cannot
    tell: B in two dims, or a size that fits the batch on an output broadcast over it."""
    batch = graph.loss.shape[0]
    return ambiguous(known.plan, shapes, batch) + learning.broadcast_though_fitting(known, graph, calls)


def _cover(
    parts: Parts, known: Knowledge, graph: LossGraph, calls: list[Call], checking: bool
) -> tuple[Knowledge, bool]:
    """Cover this forward structure (`learning.cover`), and whether this backward runs the per-sample check: a
    plan changed here is checked at once, even with self_check=None (a module that has just become a generic
    rule site was recorded as a scope, without the outputs its rule's check of the recomputation compares)."""
    reshards = parts.adapter.reshards_after_forward
    known, changed = learning.cover(known, graph, calls, parts.registered, reshards)
    return known, (parts.adapter.allows_second_pass if changed else checking)


def _attempt(
    parts: Parts,
    known: Knowledge,
    graph: LossGraph,
    calls: list[Call],
    verify: bool,
    checking: bool,
    keeps: Keeps,
    routed: routing.Routing = routing.NONE,
) -> _Pass | _Finding:
    """One norm pass over `calls` (handed over): each call's output gradients go to a collector as autograd
    computes them. With `verify`, each is also sketched, and a weighted pass compared with the sketches verifies
    batch independence (see `_verdict`), under the routing above these calls (read here, before the pass frees
    the graph's saved tensors: the plan may have changed since `routed`, the routing when the measurement began)."""
    loss, batch = graph.loss, graph.loss.shape[0]
    rule_calls, aliased = _rule_calls(known.plan, calls)
    if aliased is not None and not verify:
        raise aliased
    calls.clear()  # from here the collector holds each call, and releases it once its gradients are in
    held = _graph_tensors(known.plan, rule_calls) if checking else {}
    dtypes = [loss.dtype, *(m.dtype for c in rule_calls for m in c.output_meta)]
    shared, known = learning.shared(known, graph, rule_calls)
    if verify and batch > 1:
        routed = routing.of(graph, known.plan, rule_calls, known.shared_sites)
    collector = NormCollector(
        known.plan,
        rule_calls,
        batch,
        strategy=parts.settings.norm_strategy,
        keep_for_sum=keeps.plans,
        backend=parts.settings.backend,
        recorder=parts.recorder,
        shared=shared,
        defer_checks=not verify,  # (a verifying pass may be redone: what it finds is read there)
        users=graph.users,
        **keeps.for_overflow,
    )
    dims = [dims_of(known.plan, c) for c in rule_calls]
    verifying = Verifying(rule_calls, dims, set(shared), batch) if verify else None
    if verifying is not None and aliased is not None:  # (raised once the layout is verified: learning it may move
        verifying.errors.append(aliased)  # the parameter to an enclosing generic rule, which counts it once)
    sharing = capturing_per_sample_gradients(list(shared.values()), batch)
    with parts.timer.phase("norm pass"), parts.adapter.norm_pass(), sharing:
        # (without verifying, only the collector holds each call: the pass empties its list)
        passed = list(rule_calls) if verify else rule_calls
        retain = keeps.graph or checking or verify
        stream_output_gradients(
            graph, passed, receiver(collector, verifying), {i for i, _ in shared}, retain, prepare=collector.unpack
        )
    if verifying is None:
        return _Pass(known, collector, True, held, dtypes, routed)
    found, known = _verdict(parts, known, graph, verifying)
    if found is Found.VERIFIED:
        return _Pass(known, collector, verifying.every_sample_seen(), held, dtypes, routed)
    return _Finding(known, cover_again=found is Found.NOT_BATCH_FIRST)


def _verdict(parts: Parts, known: Knowledge, graph: LossGraph, verifying: Verifying) -> tuple[Found, Knowledge]:
    """What the verifying pass found, agreed by every rank (the highest any of them found), with what explains a
    failure; raises where nothing does."""
    loss, calls = graph.loss, verifying.calls
    rtol = self_check.tolerance([loss.dtype, *(m.dtype for c in calls for m in c.output_meta)], computed_in_tf32(loss))
    with torch.no_grad(), parts.adapter.norm_pass():
        failing = self_check.batch_independence_failures(
            loss, calls, verifying.sketches, verifying.dims, rtol, parts.check_generator, graph.users
        )
    found, learnt = learning.explain_failures(known, graph, calls, failing) if failing else (Found.VERIFIED, known)
    if found is Found.VERIFIED and verifying.errors:
        found = Found.REFUSED
    agreed = Found(max(parts.on_any_rank([found], loss.device)))
    if agreed is Found.REFUSED:
        raise refusal(known.plan, calls, failing, verifying.errors, refused_here=found is agreed)
    return agreed, learnt


def _finish(parts: Parts, known: Knowledge, graph: LossGraph, done: _Pass, keeps: Keeps, checking: bool) -> Measurement:
    """The norms of the pass: the clipping groups' (a float32 overflow recomputed in float64, summed over the
    tensor-parallel group), the non-finite policy applied, and the per-sample self-check when due."""
    loss, units, groups = graph.loss, graph.units, len(known.plan.clip_group_names)
    with torch.no_grad(), kernels_backend(parts.settings.backend), parts.timer.phase("norm computation"):
        norms = done.collector.finish()
        clip_norms_sq = _group_norms_sq(norms, groups, units, loss.device)
        checks = done.collector.deferred or []
        # one device sync for the rules' recomputations as recorded and the squared norms finite
        *recomputed, finite = torch.stack([*(ok for ok, _ in checks), torch.isfinite(clip_norms_sq).all()]).tolist()
        raise_failed(checks, recomputed)  # (as if raised in the pass: before the strategies are known)
        parts.strategies.clear()
        parts.strategies.update((param.name, norm.strategy) for param, norm in norms)
        if not finite:  # a float32 norm that overflowed, or a NaN/inf gradient
            norms = _float64_norms(parts, known, graph, norms, done.collector, keeps)
            clip_norms_sq = _group_norms_sq(norms, groups, units, loss.device)
        done.collector = None
        if parts.norm_group is not None:  # a sample's computation is split across this group (tensor parallel)
            with parts.timer.phase("communication"):
                dist.all_reduce(clip_norms_sq, op=dist.ReduceOp.SUM, group=parts.norm_group)
        policy, group = parts.settings.nonfinite, parts.adapter.dp_group
        skipped = nonfinite.nonfinite_samples(policy, clip_norms_sq, norms, group, finite, graph.users)
        if checking:
            rtol = self_check.tolerance(done.dtypes, computed_in_tf32(loss))
            _check_per_sample(parts, graph, norms, done.held, rtol, keeps.graph)
    return Measurement(norms, clip_norms_sq, skipped)


def _float64_norms(
    parts: Parts, known: Knowledge, graph: LossGraph, norms: Norms, collector: NormCollector, keeps: Keeps
) -> Norms:
    """`norms` with every parameter whose squared norms are not all finite recomputed in float64 from what the
    collector kept (`Keeps.for_overflow`): its contributions, or its calls for a second norm pass."""
    gradients = collector.gradients
    if any(n.plan is None and p.key not in gradients for p, n in norms if not nonfinite.all_finite(n.norm_sq)):
        again = Keeps(graph=keeps.graph, plans=False, for_overflow={"keep_gradients": True})
        redo = _attempt(parts, known, graph, list(collector.calls), verify=False, checking=False, keeps=again)
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
            if param is not None and tensor.requires_grad:  # not a copy kept for the generic rule
                held[param.key] = tensor
    return held


def _check_per_sample(
    parts: Parts, graph: LossGraph, norms: Norms, held: dict, rtol: float, retain_graph: bool
) -> None:
    """The self-check's second part: a few samples' (or users') true gradients, by autograd, against the counts."""
    count = self_check.SAMPLES_PER_CHECK
    picks = torch.randperm(max(graph.units, 1), generator=parts.check_generator, device="cpu")[:count].tolist()
    units = [_unit(graph.users, picks[k % len(picks)]) for k in range(count)]  # as many passes on every rank
    counted = [self_check.Counted(p.name, held[p.key], n.norm_sq, n.plan) for p, n in norms]
    with parts.adapter.norm_pass():
        self_check.check_per_sample(graph.loss, counted, units, rtol, retain_graph)


def _unit(users: UserGroups | None, index: int) -> self_check.Unit:
    if users is None:
        return self_check.Unit(index, [index], f"sample {index}")
    return self_check.Unit(index, users.rows_of(index), f"user {users.named(index)}")


def _group_norms_sq(norms: Norms, groups: int, batch: int, device: torch.device) -> Tensor:
    """`[L, B]` float64 squared norms of the L clipping groups (a stack and a sum per group, not an add per
    parameter)."""
    members: dict[int, list[Tensor]] = {}
    for param, norm in norms:
        members.setdefault(param.clip_group, []).append(norm.norm_sq)
    sums = {group: torch.stack(norms_sq).sum(0, dtype=torch.float64) for group, norms_sq in members.items()}
    if len(sums) == groups:  # (every group reached: one stack of their sums)
        return torch.stack([sums[g] for g in range(groups)])
    total = torch.zeros(groups, batch, dtype=torch.float64, device=device)
    for group, norm_sq in sums.items():
        total[group] = norm_sq
    return total
