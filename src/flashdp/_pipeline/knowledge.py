"""What the engine trusts about the model, and on what evidence: one immutable value.

A backward starts from the committed `Knowledge`, derives new values as it learns (each method returns a new one),
and the engine commits the last only when the backward succeeds: a failed verification leaves nothing learnt. Each
field says what put a fact there; nothing else does.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from flashdp._pipeline import routing
from flashdp._pipeline.plan import GradientPlan

#: verified routings kept per structure (each a few index tensors of about the batch's size)
ROUTINGS_KEPT = 64

#: what a verified forward structure rests on (`measurement._structure`): the modules called, per output of a rule
#: site's call its number of dims, its batch dim and whether its size there is a multiple of B, the graph's ops and
#: each call's place among them
Structure = tuple[Hashable, ...]


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
    #: modules a parameter of which was taken to meet the batch where the verifying pass found the rows not to be
    #: the samples' (a scale of a table `[T, d]` with T == B, rows sorted inside the module): the generic rule
    #: counts their parameters from then on (`broadcast_params`)
    unbroadcast: frozenset[int] = frozenset()
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
    #: when the self-check runs; a backward that fails does not count as having run it
    self_check: SelfCheckSchedule = SelfCheckSchedule(None)

    def with_plan(self, plan: GradientPlan) -> Knowledge:
        """Another plan: every structure is verified again under it."""
        return self if plan is self.plan else replace(self, plan=plan, verified=frozenset(), routings={})

    def with_layout(self, plan: GradientPlan) -> Knowledge:
        """The plan with batch dims learnt by a verifying pass, which is redone: its structure is verified then."""
        return replace(self, plan=plan)

    def sharing(self, modules: Iterable[int]) -> Knowledge:
        added = frozenset(modules) - self.shared_sites
        return replace(self, shared_sites=self.shared_sites | added) if added else self

    def not_broadcast(self, modules: Iterable[int]) -> Knowledge:
        return replace(self, unbroadcast=self.unbroadcast | frozenset(modules))

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

    def self_checked(self, index: int) -> Knowledge:
        return replace(self, self_check=self.self_check.ran(index))
