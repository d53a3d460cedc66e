"""How the clipped sums `sum_i c_i g_i` reach `.grad`, resolved once when the engine is built, and what the norm
pass keeps for them. Three ways, one object each:

    BookKeeping     bk, and ghost / flash under a wrapper that cannot take a second pass (FSDP1): each parameter's
                    clipped-sum plan, kept by the norm pass, applied to the coefficients
    SecondBackward  ghost / flash: a backward of `sum_i c_i loss_i` over the forward's graph, kept by the norm pass
    NormsOnly       `engine.per_sample_norms`: nothing reaches `.grad`; the graph is kept for the user's backward
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from flashdp._pipeline.grad_writes import GradWrites
from flashdp._pipeline.param_grad import ParamNorm
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.settings import EngineSettings
from flashdp._pipeline.users import UserGroups
from flashdp.distributed import Adapter
from flashdp.kernels import backend as kernels_backend
from flashdp.per_sample import cast, weighted_rows

#: each reached parameter with its squared norms `[B]` and clipped-sum plan
Norms = list[tuple[TrainableParam, ParamNorm]]


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

    def add(self, loss: Tensor, norms: Norms, coef: Tensor, users: UserGroups | None) -> None:
        """`.grad += sum_i coef[l, i] g_i` for every reached parameter (l its clipping group); `coef` `[L, B]`
        (with users: `[L, U]`, applied to the plans, which are per user)."""
        with torch.no_grad(), kernels_backend(self._backend):
            rows = coef.unbind()  # (one op for every group's row, and one cast per dtype: not per parameter)
            broadcast = coef.stride(0) == 0  # one row for every group (flat clipping): cast once
            cast_rows: dict[tuple[int, torch.dtype], Tensor] = {}
            row_of: dict[Hashable, Tensor] = {}  # each parameter's coefficients, cast to its plan's dtype
            ordered = sorted(norms, key=lambda pair: self._adapter.accumulation_order(pair[0]))
            for param, norm in ordered:
                key = (0 if broadcast else param.clip_group, norm.plan.dtype)
                if key not in cast_rows:
                    cast_rows[key] = cast(rows[key[0]], key[1])
                row_of[param.key] = cast_rows[key]
            summed = _small_rows_summed(ordered, row_of)
            for param, norm in ordered:
                clipped_sum = summed.pop(param.key, None)
                if clipped_sum is None:
                    clipped_sum = norm.plan.clipped_sum(row_of[param.key])
                self._adapter.accumulate(param, clipped_sum)
            self._adapter.accumulation_done()


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
    def __init__(self, adapter: Adapter, grad_writes: GradWrites) -> None:
        self._adapter, self._grad_writes = adapter, grad_writes
        self.keeps = Keeps(graph=True, plans=False, for_overflow=_overflow_without_plans(adapter))

    def add(self, loss: Tensor, norms: Norms, coef: Tensor, users: UserGroups | None) -> None:
        """A backward of `sum_i coef[0, i] loss_i` (one clipping group; with users, row i takes its user's
        coefficient): only the reached parameters' `.grad` may change."""
        counted = [param.param for param, _ in norms]
        row_coef = coef[0] if users is None else users.per_row(coef[0])
        scale = (row_coef * self._adapter.second_pass_scale).to(loss.dtype)
        with self._grad_writes.refusing(allowed=counted):
            (loss * scale).sum().backward()


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
        return SecondBackward(adapter, grad_writes)
    return BookKeeping(adapter, settings)
