"""What the engine trusts about the model, and on what evidence: one immutable value.

A backward starts from the committed `Knowledge`, derives new values as it learns (each method returns a new one),
and the engine commits the last only when the backward succeeds: a failed verification leaves nothing learnt. Each
field says what put a fact there; nothing else does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from torch import Tensor

from flashdp._pipeline import routing
from flashdp._pipeline.plan import GradientPlan

#: verified routings kept per structure (each a few index tensors of about the batch's size)
ROUTINGS_KEPT = 64
#: structures kept whose verifying passes have seen some samples' rows, not yet all (`Knowledge.partly_seen`)
PARTLY_SEEN_KEPT = 64

#: what a verified forward structure rests on (`measurement._structure`): the modules called, per output of a rule
#: site's call its number of dims, its batch dim and whether its size there is a multiple of B, the graph's ops and
#: each call's place among them
Structure = tuple[Hashable, ...]


@dataclass(frozen=True)
class RowsSeen:
    """Which samples' rows a passing verifying pass saw non-zero, per sketched output: a sample whose rows are all
    zero there (masked, padded out) shows nothing about which rows are its own (rows of another sample mixed with
    zeros scale like its own)."""

    #: the sketched outputs, as (call, output) indices among the pass's rule calls
    outputs: tuple[tuple[int, int], ...]
    #: `[outputs, B]` bool, on the CPU
    rows: Tensor

    @property
    def every_row(self) -> bool:
        return bool(self.rows.all())

    def union(self, other: RowsSeen | None) -> RowsSeen:
        """Both passes' rows, where `other` sketched the same outputs (else this pass's alone)."""
        if other is None or other.outputs != self.outputs or other.rows.shape != self.rows.shape:
            return self
        return RowsSeen(self.outputs, self.rows | other.rows)


@dataclass(frozen=True)
class SelfCheckSchedule:
    """When the per-sample self-check runs: on the first backward, then every `interval` backwards (None: never;
    the same on every rank, since it adds passes that run collectives under FSDP2)."""

    interval: int | None
    #: the backward index of the last self-check
    last: int | None = None

    def due(self, index: int) -> bool:
        return self.interval is not None and (self.last is None or index - self.last >= self.interval)

    def ran(self, index: int) -> SelfCheckSchedule:
        return replace(self, last=index)


@dataclass(frozen=True)
class Knowledge:
    #: which rule counts each parameter. Changed by: a module's first call, whose forward is checked against its
    #: rule's on values of the check's own (`Recorder`: a scale, or the generic rule); the coverage walk (a
    #: parameter used outside the calls counting it moves to an enclosing generic rule); layout learning on a
    #: batch of more than one (a position-wise layer's batch dim; a layer whose rows are not samples)
    plan: GradientPlan
    #: modules whose outputs were found shared across the batch: without the batch dim, broadcast over it by a
    #: later op whose batch dim is the only one of size B (`shared_outputs.frontiers`), on a batch of more than one
    shared_sites: frozenset[int] = frozenset()
    #: modules whose outputs' rows were found not to be samples by the verifying pass, although their number is B
    not_batch_first: frozenset[int] = frozenset()
    #: forward structures covered under this plan and verified on a batch of more than one (or, under a wrapper
    #: that cannot verify, whose sizes decided the layout alone); a batch of one verifies nothing
    verified: frozenset[Structure] = field(default_factory=frozenset)
    #: the routings each verified structure of a batch of more than one was verified under, where it moves rows
    #: (`routing.Routing`: the ops moving elements by index between the rule sites' outputs and the loss, and their
    #: index values), the latest `ROUTINGS_KEPT`; a step of that structure routing otherwise is not trusted. Sizes
    #: alone do not say whose rows are whose where the data moves them (a batch sorted by a key inside the forward:
    #: the verified batch may have been in order). Several: a sequence classifier's `logits[arange(B), last]`
    #: routes a batch of each size its own way, and Poisson batches change size on almost every step
    routings: Mapping[Structure, tuple[routing.Routing, ...]] = field(default_factory=dict)
    #: structures whose passing verifying passes (under a routing that moves no rows) each saw some samples' rows
    #: all zero: the rows seen so far, the latest `PARTLY_SEEN_KEPT`. Once every sample position of every output
    #: has been seen on some pass, the structure is verified: each position's loss showed, on one pass at least,
    #: that it reaches its own rows only (a masked sample on every step, the fully masked SFT sample, would
    #: otherwise verify every step it sits in)
    partly_seen: Mapping[Structure, RowsSeen] = field(default_factory=dict)
    #: when the self-check runs; a backward that fails does not count as having run it
    self_check: SelfCheckSchedule = SelfCheckSchedule(None)

    def with_plan(self, plan: GradientPlan) -> Knowledge:
        """Another plan: every structure is verified again under it."""
        if plan is self.plan:
            return self
        return replace(self, plan=plan, verified=frozenset(), routings={}, partly_seen={})

    def with_layout(self, plan: GradientPlan) -> Knowledge:
        """The plan with batch dims learnt by a verifying pass, which is redone: its structure is verified then."""
        return replace(self, plan=plan)

    def sharing(self, modules: Iterable[int]) -> Knowledge:
        added = frozenset(modules) - self.shared_sites
        return replace(self, shared_sites=self.shared_sites | added) if added else self

    def not_batch_first_too(self, modules: Iterable[int]) -> Knowledge:
        return replace(self, not_batch_first=self.not_batch_first | frozenset(modules))

    def trusts(self, structure: Structure, routed: routing.Routing) -> bool:
        """Whether a step of `structure` routed as `routed` was verified (a batch of one's structure: whatever its
        routing, every row is its one sample's)."""
        return structure in self.verified and any(r.same(routed) for r in self.routings.get(structure, (routing.NONE,)))

    def verifying(self, structure: Structure, routed: routing.Routing, *alike: Structure) -> Knowledge:
        """`structure` verified under `routed` (kept: the model may change its index tensors in place), and `alike`
        (a batch of one's structure) with it."""
        routings = dict(self.routings)
        if routed.moves:
            routings[structure] = (*routings.get(structure, ()), routed.kept())[-ROUTINGS_KEPT:]
        else:
            routings.pop(structure, None)
        return replace(self, verified=self.verified | {structure, *alike}, routings=routings)

    def seeing(self, structure: Structure, seen: RowsSeen) -> tuple[Knowledge, bool]:
        """`seen` joined to what earlier passes of `structure` saw, and whether every row has now been seen."""
        partly = dict(self.partly_seen)
        joined = seen.union(partly.pop(structure, None))
        if joined.every_row:
            return replace(self, partly_seen=partly), True
        partly[structure] = joined
        kept = dict(list(partly.items())[-PARTLY_SEEN_KEPT:])
        return replace(self, partly_seen=kept), False

    def self_checked(self, index: int) -> Knowledge:
        return replace(self, self_check=self.self_check.ran(index))
