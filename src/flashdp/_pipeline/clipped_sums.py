"""How the clipped sums `sum_i c_i g_i` reach `.grad`, resolved once when the engine is built, and what the norm
pass keeps for them. Three ways, one object each:

    BookKeeping     bk, and ghost / flash under a wrapper that cannot take a second pass (FSDP1): each parameter's
                    clipped-sum plan, kept by the norm pass, applied to the coefficients
    SecondBackward  ghost / flash: the norm pass again over the forward's graph, kept by the first, each layer's
                    clipped sum taken from the output gradients its norms were measured from (under FSDP2: a
                    backward of `sum_i c_i loss_i`)
    NormsOnly       `engine.per_sample_norms`: nothing reaches `.grad`; the graph is kept for the user's backward
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from flashdp._pipeline.clipping import coefficients_in
from flashdp._pipeline.grad_writes import GradWrites
from flashdp._pipeline.param_grad import ParamGradient, ParamNorm
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.settings import EngineSettings
from flashdp._pipeline.users import UserGroups
from flashdp.distributed import Adapter
from flashdp.errors import FlashDPError
from flashdp.kernels import backend as kernels_backend
from flashdp.per_sample import cast, weighted_rows

#: each reached parameter with its squared norms `[B]` and clipped-sum plan
Norms = list[tuple[TrainableParam, ParamNorm]]
#: what a summing pass hands each parameter's complete contributions to, with whether its calls' gradients were the
#: first pass's (a device bool; None where not compared) (`measurement.summing_pass`)
SumSink = Callable[[TrainableParam, ParamGradient, Tensor | None], None]


@dataclass(frozen=True)
class Keeps:
    """What the norm pass keeps beyond the norms."""

    #: the forward's graph, for a later pass over it
    graph: bool
    #: each parameter's clipped-sum plan (what bk's sums are computed from)
    plans: bool
    #: what the collector keeps so that a float32 norm that overflows can be recomputed in float64: nothing where
    #: the plans are kept (they suffice); else the calls, for a second norm pass over the kept graph, except under
    #: FSDP, where one rank cannot run a pass alone: there each parameter's contributions
    for_overflow: dict[str, bool]


class BookKeeping:
    def __init__(self, adapter: Adapter, settings: EngineSettings) -> None:
        self._adapter, self._backend = adapter, settings.backend
        self.keeps = Keeps(graph=False, plans=True, for_overflow={})

    def take_unmatched(self) -> list[tuple[str, Tensor]]:
        """Nothing: one pass."""
        return []

    def add(
        self,
        loss: Tensor,
        norms: Norms,
        coef: Tensor,
        users: UserGroups | None,
        again: Callable | None = None,
        kept: Tensor | None = None,
    ) -> None:
        """`.grad += sum_i coef[l, i] g_i` for every reached parameter (l its clipping group); `coef` `[L, B]`
        (with users: `[L, U]`, applied to the plans, which are per user). `norms` handed over: emptied, each plan
        released once its sum is taken (a skipped unit's rows already dropped from them: `kept` is not needed)."""
        with torch.no_grad(), kernels_backend(self._backend):
            norms.sort(key=lambda pair: self._adapter.accumulation_order(pair[0]))
            for param, clipped_sum in clipped_sums(norms, coef):
                self._adapter.accumulate(param, clipped_sum)
            self._adapter.accumulation_done()


def coefficient_rows(coef: Tensor) -> Callable[[int, torch.dtype], Tensor]:
    """(clipping group, dtype) -> that group's `[B]` row of `coef` `[L, B]` cast to the dtype, rounded toward zero:
    one op for every group's row and one cast per (row, dtype), not per parameter (5 ops each)."""
    rows = coef.unbind()
    broadcast = len(rows) == 1 or coef.stride(0) == 0  # one row for every group (flat clipping): cast once
    cast: dict[tuple[int, torch.dtype], Tensor] = {}

    def row_in(group: int, dtype: torch.dtype) -> Tensor:
        key = (0 if broadcast else group, dtype)
        if key not in cast:
            cast[key] = coefficients_in(rows[key[0]], dtype)
        return cast[key]

    return row_in


def clipped_sums(norms: Norms, coef: Tensor) -> Iterator[tuple[TrainableParam, Tensor]]:
    """Each parameter's clipped sum `sum_i coef[l, i] g_i` from its plan (l its clipping group), in the order of
    `norms` (handed over: emptied as the sums are taken, so that each plan is released after its own); `coef`
    `[L, B]`."""
    row_in = coefficient_rows(coef)
    row_of = {param.key: row_in(param.clip_group, norm.plan.dtype) for param, norm in norms}  # (cast to its plan's)
    summed = _small_rows_summed(norms, row_of)
    norms.reverse()
    while norms:
        param, norm = norms.pop()
        clipped_sum = summed.pop(param.key, None)
        yield param, norm.plan.clipped_sum(row_of[param.key]) if clipped_sum is None else clipped_sum


#: per sample, the most elements of a parameter whose kept rows are summed with others' in one product. The
#: product reads a copy of the rows (one `cat`): worth it where a parameter's own few ops cost more host time than
#: copying its rows, i.e. biases and normalisation weights (d <= 4096), not a kept 256 x 256 weight (BERT-small's
#: attention at T=128: 2^16 copied 68 MB a step and took 67 ms of sums against 40 ms without)
SMALL_ROWS = 1 << 12


def _small_rows_summed(norms: Norms, row_of: dict[Hashable, Tensor]) -> dict[Hashable, Tensor]:
    """The clipped sums of the parameters whose plans are small per-sample rows alone (biases, normalisation
    weights), by parameter key: the rows of those sharing a coefficient row and dtype concatenated and summed by one
    product (one per parameter, each a few torch ops, made a step of many small layers host-bound)."""
    batches: dict[tuple[int, torch.dtype], list] = {}
    for param, norm in norms:
        rows = norm.plan.rows_alone
        if rows is not None and norm.plan.shape.numel() <= SMALL_ROWS:
            batches.setdefault((id(row_of[param.key]), rows.dtype), []).append((param, norm.plan))
    summed = {}
    for batch in batches.values():
        if len(batch) < 2:
            continue
        coef = row_of[batch[0][0].key]
        flat = torch.cat([plan.rows_alone for _, plan in batch], dim=1)
        parts = weighted_rows(coef, flat).split([plan.shape.numel() for _, plan in batch])
        views = [
            part if len(plan.shape) == 1 else part.view(plan.shape)
            for part, (_, plan) in zip(parts, batch, strict=True)
        ]
        # each its own tensor (one op for all): a .grad set to a view would share its storage and its version
        # counter, which tells an in-place change to it, with the others'
        owned = torch._foreach_mul(views, 1.0)
        summed.update((param.key, sum_) for (param, _), sum_ in zip(batch, owned, strict=True))
    return summed


class SecondBackward:
    def __init__(self, adapter: Adapter, grad_writes: GradWrites, settings: EngineSettings) -> None:
        self._adapter, self._grad_writes, self._backend = adapter, grad_writes, settings.backend
        self.keeps = Keeps(graph=True, plans=False, for_overflow=_overflow_without_plans(adapter))
        #: (name, device bool) per parameter of the last summing pass: whether its calls' gradients were the norm
        #: pass's (where not, its sum was not added); read with the next backward's first sync
        self._matched: list[tuple[str, Tensor]] = []

    def take_unmatched(self) -> list[tuple[str, Tensor]]:
        """The last summing pass's parameters with whether their gradients matched the norm pass's (emptied)."""
        matched, self._matched = self._matched, []
        return matched

    def add(
        self,
        loss: Tensor,
        norms: Norms,
        coef: Tensor,
        users: UserGroups | None,
        again: Callable[[SumSink, set[Hashable]], None] | None = None,
        kept: Tensor | None = None,
    ) -> None:
        """`.grad += sum_i coef[l, i] g_i` (with users, per user) for every reached parameter. A parameter whose
        per-sample gradients were built whole (their plan kept, `ParamGradient`) gets its clipped sum from them;
        every other from the norm pass run `again`: the same backward of `sum_i loss_i`, so the same output
        gradients its norms were measured from, summed with the coefficients by flashdp's products (a backward
        of `sum_i c_i loss_i` computes them anew, scaled, and where they cancel, between layers and the loss,
        rounds them to others: a sample added 12 C). `norms` handed over: emptied. `kept` `[B]`: the units not
        skipped for a non-finite gradient (nonfinite="skip"; the built plans' norms already drop the others):
        their rows are dropped from the sums of the pass run again (their NaN would survive a zero coefficient)."""
        if again is None:  # (FSDP2: no calls kept, the wrapper reduces what autograd accumulates)
            if kept is not None:
                raise FlashDPError(_SKIP_UNDER_FSDP2)
            self._backward(loss, norms, coef, users)
            return
        streamed = {param.key for param, norm in norms if norm.plan is None}
        built = [pair for pair in norms if pair[1].plan is not None]
        norms.clear()
        row_in = coefficient_rows(coef)

        def add_sum(param: TrainableParam, gradient: ParamGradient, matched: Tensor | None) -> None:
            if param.key not in streamed:  # (a call's other parameters, built whole, are summed from their rows)
                return
            plan = gradient.sum_plan() if kept is None else gradient.sum_plan().dropping(kept)
            clipped_sum = plan.clipped_sum(row_in(param.clip_group, plan.dtype))
            if matched is not None:  # (else other gradients than those measured: nothing added, said next backward)
                clipped_sum = torch.where(matched, clipped_sum, 0.0)
                self._matched.append((param.name, matched))
            self._accumulate(param, clipped_sum)

        # (autograd accumulates no `.grad` in this pass: a write by anything but flashdp's sums is refused)
        with kernels_backend(self._backend), self._grad_writes.refusing():
            with torch.no_grad():
                for param, clipped_sum in clipped_sums(built, coef):
                    self._accumulate(param, clipped_sum)
            again(add_sum, streamed)
            self._adapter.accumulation_done()

    def _accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        self._grad_writes.own_write(param.param, functools.partial(self._adapter.accumulate, param, clipped_sum))

    def _backward(self, loss: Tensor, norms: Norms, coef: Tensor, users: UserGroups | None) -> None:
        """A backward of `sum_i coef[0, i] loss_i` (one clipping group; with users, row i takes its user's
        coefficient): only the reached parameters' `.grad` may change. A parameter whose per-sample gradients were
        built whole gets its clipped sum from them: autograd's gradient for it is replaced by that sum. Exposed
        where gradients cancel between a layer and the loss (see `add`)."""
        counted = [param.param for param, _ in norms]
        scale = coef[:1] * self._adapter.second_pass_scale  # [1, B]
        row_coef = coefficients_in(scale[0] if users is None else users.per_row(scale[0]), loss.dtype)
        built = [pair for pair in norms if pair[1].plan is not None]
        norms.clear()
        leaves = self._adapter.graph_leaves([param for param, _ in built])
        with torch.no_grad(), kernels_backend(self._backend):
            sums = [s for _, s in clipped_sums(built, scale.expand_as(coef))]
            replacements = [(leaf, cast(s, leaf.dtype).view(leaf.shape)) for leaf, s in zip(leaves, sums, strict=True)]
        replacing = _gradients_replaced(replacements)
        with self._grad_writes.refusing(allowed=counted), replacing:
            (loss * row_coef.to(loss.dtype)).sum().backward()


@contextlib.contextmanager
def _gradients_replaced(replacements: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
    """Meanwhile, the gradient autograd accumulates into each leaf is the value paired with it (the leaf's dtype
    and shape). A leaf autograd does not reach keeps its `.grad`: the loss does not depend on it (a
    parameter of a call whose outputs the loss does not read, counted with the call), and its per-sample gradients,
    computed from the output gradients the loss gives, are zeros."""
    handles = [leaf.register_hook(functools.partial(_replaced, value)) for leaf, value in replacements]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replaced(value: Tensor, grad: Tensor) -> Tensor:
    return value


#: why nonfinite="skip" cannot run where ghost's or flash's second pass is autograd's own (FSDP2)
_SKIP_UNDER_FSDP2 = (
    "nonfinite='skip' with mode='ghost' or 'flash' under FSDP2: the second pass is autograd's backward of the "
    "weighted losses (FSDP2 reduce-scatters what it accumulates), which carries a skipped sample's NaN into every "
    "parameter (0 * NaN is NaN). Use mode='bk', or nonfinite='error'."
)


class NormsOnly:
    def __init__(self, adapter: Adapter) -> None:
        self.keeps = Keeps(graph=True, plans=False, for_overflow=_overflow_without_plans(adapter))


def _overflow_without_plans(adapter: Adapter) -> dict[str, bool]:
    return {"keep_gradients": True} if adapter.reshards_after_forward else {"keep_calls": True}


def clipped_sums_for(
    settings: EngineSettings, adapter: Adapter, grad_writes: GradWrites
) -> BookKeeping | SecondBackward:
    """The way this engine's backward fills `.grad`: a second backward in ghost and flash where the wrapper allows
    one, the clipped-sum plans otherwise."""
    if settings.fills_grad_by_second_backward and adapter.allows_second_pass:
        if settings.nonfinite == "skip" and adapter.reshards_after_forward:
            raise FlashDPError(_SKIP_UNDER_FSDP2)
        return SecondBackward(adapter, grad_writes, settings)
    return BookKeeping(adapter, settings)
