"""One parameter's per-sample gradients in one backward: the exact norm of the SUM of every contribution (a
module called several times, a parameter shared by several modules), and the plan of its clipped sum."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flashdp import kernels
from flashdp._pipeline import outer_products
from flashdp._pipeline.users import UserGroups
from flashdp.errors import FlashDPError
from flashdp.kernels.outer_norm.reference import ghost_inner, per_sample, sum_of_squares
from flashdp.per_sample import (
    DeferredOuterGrad,
    OuterGrad,
    PerSampleGrad,
    accumulation_dtype,
    cast,
    weighted_rows,
)

StrategyChoice = Literal["auto", "ghost", "direct"]

#: per sample, the most elements a parameter's contributions may hold for its norm to be taken together with others'
#: (`norms_together`): their rows are copied into one stack, worth it where a parameter's own few ops and their
#: Python cost more host time than the copy (biases, normalisation weights, small layers' blocks)
STACKED_ELEMENTS = 1 << 12


@dataclass(frozen=True)
class ClippedSumPlan:
    """What one parameter's clipped sum `sum_b c_b g_b` needs, kept after its norm (book-keeping)."""

    shape: torch.Size
    #: `[B, ...]`: each sample's gradient, laid out as the parameter flattened
    per_sample: Tensor | None = None
    #: dense outer-product blocks, positions concatenated: the sum is one GEMM with c applied inside
    factors: OuterGrad | None = None
    #: embedding rows: the sum is an index_add of `c_b g_t`
    tokens: OuterGrad | None = None
    #: calls whose layer computes its own sum from row weights (`DeferredOuterGrad.weighted_sum`)
    weighted: tuple[DeferredOuterGrad, ...] = ()

    @property
    def rows(self) -> Tensor | None:
        """The kept per-sample gradients as rows `[B, numel]` (B may be 0; a reshape only where needed: each is an
        op, and this runs per parameter)."""
        rows = self.per_sample
        return rows if rows is None or rows.dim() == 2 else rows.reshape(len(rows), self.shape.numel())

    @property
    def rows_alone(self) -> Tensor | None:
        """`rows` where they are the whole plan (no factors, tokens or layer sums)."""
        return self.rows if self.factors is None and self.tokens is None and not self.weighted else None

    @property
    def dtype(self) -> torch.dtype:
        """The widest dtype its parts accumulate in: coefficients cast to it once lose nothing any part keeps."""
        tensors = [self.per_sample] if self.per_sample is not None else []
        if self.factors is not None:
            tensors += [self.factors.left, self.factors.right]
        if self.tokens is not None:
            tensors.append(self.tokens.right)
        tensors += [x for call in self.weighted for x in call.operands]
        return accumulation_dtype(*tensors)

    def clipped_sum(self, coef: Tensor) -> Tensor:
        """`sum_b coef_b g_b`, shaped like the parameter. coef: `[B]`."""
        parts = []
        if self.per_sample is not None:
            rows = self.rows
            # 16-bit rows (kept bf16, `_kept_in_bfloat16`) never meet a coefficient rounded to 16 bits, which could
            # scale a sample's gradient past C
            parts.append(weighted_rows(cast(coef, accumulation_dtype(rows)), rows))
        if self.factors is not None:
            f = self.factors
            parts.append(kernels.clipped_sum(f.left, f.right, coef, f.conv_groups))
        if self.tokens is not None:
            parts.append(outer_products.token_clipped_sum(self.tokens, coef))
        parts += [call.weighted_sum(coef) for call in self.weighted]
        return functools.reduce(torch.add, (p if p.shape == self.shape else p.reshape(self.shape) for p in parts))

    def split(self, parts: int) -> list[ClippedSumPlan]:
        """The plans of `parts` parameters whose rows were stacked in this one (`norms_together`), one op per
        tensor: per-sample gradients and factors alone."""
        f, shape = self.factors, self.shape
        per_sample = [None] * parts if self.per_sample is None else _parts(self.per_sample, parts)
        if f is None:
            return [ClippedSumPlan(shape, rows) for rows in per_sample]
        blocks = zip(_parts(f.left, parts), _parts(f.right, parts), strict=True)
        return [ClippedSumPlan(shape, rows, OuterGrad(*block)) for rows, block in zip(per_sample, blocks, strict=True)]

    def dropping(self, keep: Tensor) -> ClippedSumPlan:
        """The plan without the samples where `keep` `[B]` is False: their rows are zeros (a NaN or inf in them
        would survive a zero coefficient, 0 * NaN being NaN)."""
        return ClippedSumPlan(
            self.shape,
            None if self.per_sample is None else _zero_rows(self.per_sample, keep),
            None if self.factors is None else _drop_samples(self.factors, keep),
            None if self.tokens is None else _drop_samples(self.tokens, keep),
            tuple(
                dataclasses.replace(call, weighted_sum=functools.partial(_kept_rows_only, call.weighted_sum, keep))
                for call in self.weighted
            ),
        )


def _kept_rows_only(weighted_sum: Callable[[Tensor], Tensor], keep: Tensor, weights: Tensor) -> Tensor:
    """A layer's weighted sum with the rows where `keep` is False weighted by 0 (which zeroes them)."""
    return weighted_sum(torch.where(keep, weights, 0))


def _zero_rows(rows: Tensor, keep: Tensor) -> Tensor:
    """`rows` `[N, ...]` with row n zeroed where `keep[n]` is False."""
    return torch.where(keep.view(-1, *([1] * (rows.dim() - 1))), rows, rows.new_zeros(()))


def _drop_samples(block: OuterGrad, keep: Tensor) -> OuterGrad:
    rows = keep.repeat_interleave(block.conv_groups)  # sample b owns rows b * groups + j
    left = block.left if block.is_tokens else _zero_rows(block.left, rows)
    return OuterGrad(left, _zero_rows(block.right, rows), block.conv_groups)


@dataclass(frozen=True)
class ParamNorm:
    #: `[B]` squared norms of the per-sample gradients, float32 (float64 for float64 inputs)
    norm_sq: Tensor
    #: how the norm was computed, e.g. "ghost", "direct+tokens", "per-sample"
    strategy: str
    #: what the clipped sum needs; with factors, None unless asked for (ghost and flash take those sums from a
    #: second backward); per-sample gradients built whole are kept unless their parts' norm bounds them
    #: (`ParamGradient`)
    plan: ClippedSumPlan | None
    #: `[B]` float64, where the gradient added is not the one measured (its parts summed again in another order,
    #: by a GEMM or a second backward) or the norm is a sum of inner products: the square of a bound on the norms of
    #: both the true gradient and the one added, through the rounding of parts that cancel (`rounding_bound_sq`);
    #: clipping uses it. None where the gradient added is the one measured.
    bound_sq: Tensor | None = None

    @property
    def clip_norm_sq(self) -> Tensor:
        """`[B]` what clipping takes as the squared norms."""
        return self.norm_sq if self.bound_sq is None else self.bound_sq

    def split(self, parts: int) -> list[ParamNorm]:
        """The norms and plans of `parts` parameters whose rows were stacked in this one (`norms_together`)."""
        plans = [None] * parts if self.plan is None else self.plan.split(parts)
        bounds = [None] * parts if self.bound_sq is None else _parts(self.bound_sq, parts)
        return [
            ParamNorm(norm_sq, self.strategy, plan, bound)
            for norm_sq, plan, bound in zip(_parts(self.norm_sq, parts), plans, bounds, strict=True)
        ]

    def dropping(self, keep: Tensor) -> ParamNorm:
        """Without the samples where `keep` `[B]` is False in the clipped sum (see `ClippedSumPlan.dropping`)."""
        plan = None if self.plan is None else self.plan.dropping(keep)
        return dataclasses.replace(self, plan=plan)


class ParamGradient:
    """Collects a parameter's contributions (`add`), then `norm_sq` gives their norms and the clipped-sum plan.

    With `keep_for_sum`, the plan keeps only what the clipped sum needs: the per-sample gradients when the cost
    model materialised them (direct), else the factors. Without it (ghost, flash) the direct norm comes from a
    kernel that never materialises them. Per-sample gradients built whole (by a rule, or for a tied parameter's
    norm) are kept either way unless their parts' norm is known (`DeferredOuterGrad.parts_norm`, which bounds
    their rounding, `rounding_bound_sq`): a second backward sums their parts (positions, a user's rows) in another order
    than the one measured, to another gradient where the parts cancel; their clipped sums are then taken from the
    very rows measured. With `users`, the rows' contributions are grouped by user before the norms (`UserGroups`):
    the norms and the plan are then per user, and `batch_size` is the number of users.
    """

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        batch_size: int,
        strategy: StrategyChoice = "auto",
        users: UserGroups | None = None,
        sum_only: bool = False,
    ) -> None:
        self.name = name
        self.shape = torch.Size(shape)
        self.batch_size = batch_size
        self._per_sample_shape = (batch_size, *self.shape)
        self.strategy_choice = strategy
        self.per_sample: Tensor | None = None  # [B, *shape], from rules that materialise
        self.blocks: list[OuterGrad] = []
        #: "generic" (the generic rule's re-run) or "broadcast" (taken where it meets the batch: `broadcast_params`),
        #: shown as the strategy; None for a registered rule
        self.counted_by: str | None = None
        self.dense_direct = False  # a rule's deferred factors were materialised by its cheaper routine
        self._bfloat16_layers: list[bool] = []  # per dense contribution: whether a bfloat16 layer's
        #: per dense contribution: its parts' norm and their number (`DeferredOuterGrad.parts_norm`, `positions`),
        #: or None where not known
        self._dense_parts: list[tuple[Callable[[torch.dtype], Tensor], int] | None] = []
        #: the dtype of the sums the bounds of rounding are of (the contributions', unless set: `norm_float64`)
        self._rounding_dtype: torch.dtype | None = None
        self._summed_by_layer: list[DeferredOuterGrad | None] = []  # per block: its call, if its layer sums it
        self._layout: tuple[int, tuple[int, int]] | None = None  # (groups, block shape) of factored contributions
        self._users = users
        self._by_user = users is not None
        #: for `sum_plan` alone: contributions whose layer sums them from row weights are kept as such, unbuilt
        self._sum_only = sum_only and users is None
        self._layer_sums: list[DeferredOuterGrad] = []

    @classmethod
    def from_plan(cls, name: str, plan: ClippedSumPlan, batch_size: int) -> ParamGradient:
        """The contributions a clipped-sum plan keeps, as a ParamGradient (its norms recomputed from them)."""
        gradient = cls(name, plan.shape, batch_size)
        if plan.per_sample is not None:
            gradient.per_sample = plan.per_sample.reshape(batch_size, *plan.shape)
        gradient.blocks = [b for b in (plan.factors, plan.tokens) if b is not None]
        for call in plan.weighted:
            gradient.add(call, "a kept plan")
        return gradient

    def add(self, grad: PerSampleGrad, source: str, counted_by: str | None = None) -> None:
        self.counted_by = self.counted_by or counted_by
        bfloat16 = False  # whether a dense contribution is a bfloat16 layer's (kept in bfloat16 by bk)
        deferred = grad if isinstance(grad, DeferredOuterGrad) else None
        parts = None if deferred is None or deferred.parts_norm is None else (deferred.parts_norm, deferred.positions)
        if deferred is not None:
            self._check_layout(deferred.conv_groups, deferred.block_shape, source)
            if self._sum_only and deferred.weighted_sum is not None:
                self._layer_sums.append(deferred)
                return
            grad, bfloat16 = self._resolved(deferred)
        if isinstance(grad, OuterGrad):
            self._check_block(grad, source)
            self.blocks.append(grad)
            self._summed_by_layer.append(deferred if deferred is not None and deferred.weighted_sum else None)
            return
        if not isinstance(grad, Tensor) or grad.shape != self._per_sample_shape:
            got = tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__
            raise FlashDPError(
                f"Rule for {source} returned a per-sample gradient of shape {got} for '{self.name}'; expected "
                f"[B, *param.shape] = {self._per_sample_shape} or an OuterGrad."
            )
        grad = cast(grad, accumulation_dtype(grad))
        self.per_sample = grad if self.per_sample is None else self.per_sample + grad
        self._bfloat16_layers.append(bfloat16)
        self._dense_parts.append(parts)

    def _resolved(self, grad: DeferredOuterGrad) -> tuple[Tensor | OuterGrad, bool]:
        """The form the norm needs: the factors for a ghost norm or a direct-norm kernel, else the dense gradients;
        and whether those are a bfloat16 layer's."""
        if self._strategy_of(grad.positions, *grad.block_shape) == "ghost" or kernels.outer_direct_norm_sq.runs_kernel(
            *grad.operands
        ):
            return grad.factors(), False
        self.dense_direct = True
        return grad.dense(), all(x.dtype == torch.bfloat16 for x in grad.operands)

    def _check_block(self, grad: OuterGrad, source: str) -> None:
        p, d = grad.block_shape
        rows = grad.right.shape[0]
        if rows != self.batch_size * grad.conv_groups or grad.conv_groups * p * d != self.shape.numel():
            raise FlashDPError(
                f"Rule for {source} returned an OuterGrad for '{self.name}' with {rows} rows of [{p}, {d}] blocks "
                f"in {grad.conv_groups} group(s); the parameter has shape {tuple(self.shape)} and the batch "
                f"{self.batch_size} samples."
            )
        self._check_layout(grad.conv_groups, (p, d), source)

    def _check_layout(self, groups: int, block_shape: tuple[int, int], source: str) -> None:
        """Every factored contribution, built as factors or not, has the first one's layout: so that whether a
        parameter's layers can be summed does not depend on the forms a step's shapes choose."""
        if self._layout is None:
            self._layout = (groups, block_shape)
        elif self._layout != (groups, block_shape):
            raise FlashDPError(f"'{self.name}' is used by layers whose gradients do not share a layout ({source}).")

    @property
    def elements(self) -> int:
        """The elements its contributions hold."""
        tensors = [self.per_sample] if self.per_sample is not None else []
        tensors += [x for block in self.blocks for x in (block.left, block.right) if isinstance(x, Tensor)]
        return sum(t.numel() for t in tensors)

    def stacking_key(self) -> Hashable | None:
        """What another parameter's gradient must share for both norms to be taken together (`norms_together`):
        the form (per-sample rows alone, or one dense block of factors), the shapes, dtypes and devices. None where
        the norm is taken alone: large contributions, forms of several parts (tokens, a tied parameter's mixed
        contributions, convolution groups, a layer's own sums), users' rows, an empty batch."""
        if self._users is not None or not self.batch_size or self.elements > STACKED_ELEMENTS * self.batch_size:
            return None
        if self.per_sample is not None and not self.blocks:
            rows = self.per_sample
            bfloat16 = bool(self._bfloat16_layers) and all(self._bfloat16_layers)
            strategy, bounded = self._per_sample_strategy(), self._dense_parts_known
            return ("rows", bfloat16, bounded, strategy, self.shape, rows.dtype, rows.device)
        if self.per_sample is not None or len(self.blocks) != 1 or self._summed_by_layer[0] is not None:
            return None
        block = self.blocks[0]
        if block.is_tokens or block.conv_groups != 1:
            return None
        left, right = block.left, block.right
        return (
            "factors",
            self.strategy_choice,
            self.shape,
            left.shape,
            left.dtype,
            right.shape,
            right.dtype,
            right.device,
        )

    def norm_sq(self, keep_for_sum: bool) -> ParamNorm:
        """The `[B]` squared norms, and with `keep_for_sum` the plan of the clipped sum."""
        self._group_by_user()
        self._merge_tied()
        if self.per_sample is not None:
            parts = None if keep_for_sum else self._dense_parts_norm()
            if parts is not None:  # (else kept with or without `keep_for_sum`: see the class docstring)
                norm_sq = sum_of_squares(self.per_sample)
                dtype = self._rounding_dtype or self.per_sample.dtype
                bound = rounding_bound_sq(norm_sq, *parts, dtype, squared=False)
                return ParamNorm(norm_sq, self._per_sample_strategy(), None, bound)
            kept, norm_sq = self.per_sample, None
            if self._bfloat16_layers and all(self._bfloat16_layers):
                kept, norm_sq = _kept_in_bfloat16(kept)
            norm_sq = sum_of_squares(kept) if norm_sq is None else norm_sq
            return ParamNorm(norm_sq, self._per_sample_strategy(), ClippedSumPlan(self.shape, per_sample=kept))
        return self._blocks_norm_sq(keep_for_sum)

    def sum_plan(self) -> ClippedSumPlan:
        """The clipped sum's plan alone, no norm taken (a second pass over contributions whose norms the first
        measured): the per-sample gradients where a rule built them, else the factors, or the layers' own sums."""
        self._group_by_user()
        self._merge_tied()
        layer_sums = tuple(self._layer_sums)
        if self.per_sample is not None or not self.blocks:
            return ClippedSumPlan(self.shape, per_sample=self.per_sample, weighted=layer_sums)
        dense = [b for b in self.blocks if not b.is_tokens]
        tokens = [b for b in self.blocks if b.is_tokens]
        concat = outer_products.concat_positions
        plan = self._plan(None, concat(dense) if dense else None, concat(tokens) if tokens else None)
        return dataclasses.replace(plan, weighted=plan.weighted + layer_sums)

    def _merge_tied(self) -> None:
        """A tied parameter one of whose layers materialised: every contribution materialised, summed."""
        if self.per_sample is not None and self.blocks:
            self.per_sample = self.per_sample + sum(
                outer_products.materialise(b, self.batch_size).view(self.per_sample.shape) for b in self.blocks
            )
            self.blocks, self._dense_parts = [], [None]

    def _group_by_user(self) -> None:
        """Each user's rows summed (dense) or concatenated along positions (blocks), once: from here on a "sample"
        is a user."""
        users, self._users = self._users, None
        if users is None:
            return
        if self.per_sample is not None:
            self.per_sample = users.sum_rows(self.per_sample)
            self._dense_parts = [None]  # (users' rows: kept, their clipped sums the rows measured)
        self.blocks = [users.regroup(b) for b in self.blocks]
        self.batch_size = users.count

    @property
    def _dense_parts_known(self) -> bool:
        return bool(self._dense_parts) and None not in self._dense_parts

    def _dense_parts_norm(self) -> tuple[Tensor, int] | None:
        """`[B]` the parts' norm of the dense contributions together and the parts they sum (every contribution's:
        the gradient added sums the calls' gradients too), where every one's is known."""
        if not self._dense_parts_known:
            return None
        # (in the rows' dtype: where it overflows, so does the bound, and the norms are taken again in float64)
        return self._dense_parts_in(self.per_sample.dtype), self._dense_positions

    def _dense_parts_in(self, dtype: torch.dtype) -> Tensor:
        return functools.reduce(torch.add, (parts(dtype) for parts, _ in self._dense_parts))

    @property
    def _dense_positions(self) -> int:
        """The parts the dense contributions' gradients sum, every call's."""
        return sum(positions for _, positions in self._dense_parts)

    def norm_float64(self) -> ParamNorm:
        """The `[B]` squared norms recomputed in float64 (where float32 overflowed: a per-sample norm above about
        1.8e19), from the factors where there are any, never from a float32 product of them; their bounds of
        rounding are those of the sums in the contributions' own dtype (the gradient added is summed in it)."""
        wide = ParamGradient(self.name, self.shape, self.batch_size, self.strategy_choice)
        wide.per_sample = None if self.per_sample is None else self.per_sample.double()
        wide._dense_parts = self._dense_parts
        contributions = [self.per_sample] if self.per_sample is not None else []
        wide._rounding_dtype = accumulation_dtype(*contributions, *(b.right for b in self.blocks))
        wide.blocks = [_float64(b) for b in self.blocks]
        return wide.norm_sq(keep_for_sum=False)

    def _blocks_norm_sq(self, keep_for_sum: bool) -> ParamNorm:
        dtype = accumulation_dtype(*(b.right for b in self.blocks))
        dense = [b for b in self.blocks if not b.is_tokens]
        tokens = [b for b in self.blocks if b.is_tokens]
        token_block = outer_products.concat_positions(tokens) if tokens else None
        factors = outer_products.concat_positions(dense) if dense else None
        parts = [b for b in (factors, token_block) if b is not None]  # (what the gradient sums, for its rounding)
        materialised = None
        terms: list[Tensor] = []  # summed at the end (no zeros to add to: a step of tiny layers is host-bound)
        strategies = []
        if factors is not None:
            strategy = self._strategy_of(factors.right.shape[1], *factors.block_shape)
            strategies.append(strategy)
            if strategy == "direct" and (keep_for_sum or token_block is not None):
                # materialised: kept for the bk sum, or needed for the cross term with a tied table
                materialised = per_sample(factors.left, factors.right, dtype)
                if token_block is None and factors.left.dtype == factors.right.dtype == torch.bfloat16:
                    materialised, norm_sq = _kept_in_bfloat16(materialised)
                    terms.append(norm_sq)
                else:
                    terms.append(sum_of_squares(materialised))
                if token_block is not None:
                    terms.append(2 * outer_products.token_inner_with_per_sample(materialised, token_block))
                factors = None
            else:  # the norm alone: a kernel where it can run, never the per-sample gradient
                norm = kernels.outer_direct_norm_sq if strategy == "direct" else kernels.outer_ghost_norm_sq
                terms.append(cast(norm(factors.left, factors.right), dtype))
                if token_block is not None:
                    terms.append(2 * ghost_inner(factors, token_block))
        if token_block is not None:
            strategies.append("tokens")
            terms.append(outer_products.token_norm_sq(token_block))
        plan = None
        if keep_for_sum:
            if materialised is not None:
                materialised = materialised.view(self.batch_size, self.shape.numel())  # rows b * g + j, stacked
            plan = self._plan(materialised, factors, token_block)
        total, bound = functools.reduce(torch.add, terms), None
        squared = "ghost" in strategies or len(terms) > 1  # (sums of inner products: a squared norm's rounding)
        if squared:  # (rounds below 0 where its exact value is about 0: sqrt would give NaN; NaN and inf stay)
            total = total.clamp_min(0)
        if squared or materialised is None:  # (a materialised gradient, measured and added as it is, needs none)
            bound = _blocks_bound_sq(total, parts, dtype, self._rounding_dtype or dtype, squared)
        groups = self.blocks[0].conv_groups
        if groups > 1:
            total = total.view(self.batch_size, groups).sum(1)
            bound = None if bound is None else bound.view(self.batch_size, groups).sum(1)
        return ParamNorm(total, "+".join(strategies), plan, bound)

    def _plan(self, materialised: Tensor | None, factors: OuterGrad | None, tokens: OuterGrad | None) -> ClippedSumPlan:
        """The clipped sum's plan; factors every call of which its layer sums from row weights are not kept (rows
        are samples here: with users, a row's weight would be its user's coefficient)."""
        calls = self._summed_by_layer
        if factors is not None and tokens is None and not self._by_user and calls and all(calls):
            return ClippedSumPlan(self.shape, materialised, weighted=tuple(calls))
        return ClippedSumPlan(self.shape, materialised, factors, tokens)

    def _strategy_of(self, positions: int, p: int, d: int) -> str:
        if self.strategy_choice != "auto":
            return self.strategy_choice
        return outer_products.norm_strategy(positions, p, d)

    def _per_sample_strategy(self) -> str:
        return self.counted_by or ("direct" if self.dense_direct else "per-sample")


def parts_norm(block: OuterGrad, dtype: torch.dtype) -> Tensor:
    """`[N]` the sum over positions of each position's own gradient norm, `||l_t|| ||r_t||` (a one-hot row's
    `||l_t||` is 1): what a gradient `sum_t r_t l_t^T` is made of, whatever cancels in the sum."""
    right = torch.linalg.vector_norm(block.right, dim=2, dtype=dtype)
    if block.is_tokens:
        return right.sum(1)
    return (torch.linalg.vector_norm(block.left, dim=2, dtype=dtype) * right).sum(1)


def _largest(rows: Tensor) -> Tensor:
    """`[N, T]` float64: each position's largest magnitude (exact; `vector_norm(ord=inf)` is 20x slower on the CPU,
    and `abs().amax` writes a copy of the rows: 1.3-1.4x slower on the CPU, three passes over them on a GPU)."""
    return torch.maximum(rows.amax(2), -rows.amin(2)).double()


def _blocks_bound_sq(
    norm_sq: Tensor, blocks: list[OuterGrad], dtype: torch.dtype, rounding_dtype: torch.dtype, squared: bool
) -> Tensor:
    """`rounding_bound_sq` of a norm taken from factor `blocks` in `dtype` (where it overflows, so does the bound,
    and the norms are taken again in float64), with what underflow can take from inner products (`squared`)."""
    parts_sum = functools.reduce(torch.add, [parts_norm(b, dtype) for b in blocks])
    positions = sum(b.right.shape[1] for b in blocks)  # (the factors' and the tokens' sums are added)
    underflow = _underflow_sq(blocks, dtype) if squared else None
    return rounding_bound_sq(norm_sq, parts_sum, positions, rounding_dtype, squared, underflow)


def _underflow_sq(blocks: list[OuterGrad], dtype: torch.dtype) -> Tensor:
    """`[N]` float64: how far below its exact value a squared norm taken as inner products (the ghost norm
    `sum_ts (l_t . l_s)(r_t . r_s)`) can be through products flushed to zero below the smallest normal number
    `tiny` of `dtype`: of the `l_t . l_s`, at most `tiny p` each, `tiny p R^2` in all (R, L: the sums over positions
    of `||r_t||`, `||l_t||`; p, d their widths), of the `r_t . r_s` `tiny d L^2`, of their products `tiny T^2`; each
    also at most `P^2`, P the sum of `||l_t|| ||r_t||` (nothing for a zero gradient). The norms are bounded by
    `sqrt(width)` times the rows' largest magnitudes, exact where a float32 norm of tiny values underflows too.
    Relative bounds miss it: a breaker's sample of tokens with norm 2e-23 and gradients of 1e16 in float32 had
    every `l_t . l_s` flushed to 0, a norm of 0, and added 14 C."""
    tiny = torch.finfo(dtype).tiny
    total = None
    for block in blocks:
        positions, widths = block.right.shape[1], block.right.shape[2] * (1 if block.is_tokens else block.left.shape[2])
        right = _largest(block.right)
        left = torch.ones_like(right) if block.is_tokens else _largest(block.left)  # (one-hot rows: norm 1)
        ceiling = widths * (left * right).sum(1).square()  # P^2
        flushed = (widths * tiny) * (right.sum(1).square() + left.sum(1).square())  # (min(a, c) + min(b, c) <= ...)
        term = torch.minimum(flushed, 2 * ceiling) + ceiling.clamp(max=tiny * positions**2)
        total = term if total is None else total + term
    return total


#: the squared norm computed as a sum of inner products (ghost norms, cross terms) is taken to be off by at most this
#: many eps S^2: measured near 1e-8 S^2 (about eps S^2) in float32, a worst case not proven (`rounding_bound_sq`)
INNER_PRODUCTS_ROUNDING = 2.0**5


def rounding_bound_sq(
    norm_sq: Tensor, parts: Tensor, positions: int, dtype: torch.dtype, squared: bool, underflow: Tensor | None = None
) -> Tensor:
    """`[N]` float64: the square of a bound on the norms of the true gradient and of the one added to `.grad`, from
    the measured `norm_sq`, S = `parts` (the sum of the parts' own norms) and T = `positions` (the parts one sum
    adds), where the gradient added sums the parts again in another order (bk's GEMM of the factors, ghost's second
    backward). Where the parts cancel (a user's rows with opposite gradients, positions of one sample) each sum
    rounds to another gradient: a sum of T parts in any order is off by at most `T eps S / 2` (to first order, the
    products' rounding included), which can exceed C however small the measured norm; clipped by the bound, a unit
    adds at most C. Twice that is added per sum, for safety. `squared`: the norm is a sum of inner products, whose
    own error is taken as `2^5 eps S^2` (`INNER_PRODUCTS_ROUNDING`), added under the root; else the measured
    gradient is a sum of the parts too, off by as much as the added one. Where the parts do not cancel the bound is
    close to the norm: S is of order sqrt(T) times it, and the bound about `T^1.5 eps` above it in relative terms
    (float32, T = 1024: 0.8%). `underflow`: `[N]` what products flushed to zero may have taken from a squared norm
    (`_underflow_sq`), added under the root. NaN and inf stay as they are."""
    eps, parts = torch.finfo(dtype).eps, parts.double()
    once = positions * eps * parts
    measured = norm_sq.double().clamp(min=0)
    if squared:
        inner = measured + INNER_PRODUCTS_ROUNDING * eps * parts.square()
        return ((inner if underflow is None else inner + underflow).sqrt() + once).square()
    return (measured.sqrt() + 2 * once).square()


def norms_together(gradients: Sequence[ParamGradient], keep_for_sum: bool) -> list[ParamNorm]:
    """`norm_sq` of gradients of one `stacking_key`, from ONE computation over their rows stacked `[n B, ...]`: each
    norm is taken row by row, so every row's is its own gradient's; a step of many small layers pays a few ops for
    all of them, not a few per parameter."""
    first = gradients[0]
    if len(gradients) == 1:
        return [first.norm_sq(keep_for_sum)]
    stacked = ParamGradient(first.name, first.shape, first.batch_size * len(gradients), first.strategy_choice)
    stacked.counted_by, stacked.dense_direct = first.counted_by, first.dense_direct
    if first.per_sample is not None:
        stacked.per_sample = torch.cat([g.per_sample for g in gradients])
        stacked._bfloat16_layers = first._bfloat16_layers
        stacked._dense_parts = [_stacked_parts(gradients)]
    else:
        blocks = [g.blocks[0] for g in gradients]
        stacked.blocks = [OuterGrad(torch.cat([b.left for b in blocks]), torch.cat([b.right for b in blocks]))]
        stacked._summed_by_layer = [None]
    return stacked.norm_sq(keep_for_sum).split(len(gradients))


def _stacked_parts(gradients: Sequence[ParamGradient]) -> tuple[Callable[[torch.dtype], Tensor], int] | None:
    """The parts' norms of gradients whose rows are stacked, stacked alike, and the most parts one of them sums;
    None where one's is not known."""
    if not all(g._dense_parts_known for g in gradients):
        return None
    positions = max(g._dense_positions for g in gradients)
    return lambda dtype: torch.cat([g._dense_parts_in(dtype) for g in gradients]), positions


def _parts(rows: Tensor, parts: int) -> tuple[Tensor, ...]:
    """`[parts * B, ...]` -> `parts` views `[B, ...]` (one op)."""
    return rows.unflatten(0, (parts, -1)).unbind(0)


def _kept_in_bfloat16(materialised: Tensor) -> tuple[Tensor, Tensor]:
    """A bfloat16 layer's per-sample gradients `[N, p, d]` (computed in float32) as bk keeps them until its clipped
    sum: in bfloat16, the precision of the layer's non-private gradient, in half the memory (bfloat16 has float32's
    range). Returns them and their `[N]` squared norms, taken of the rounded values (in float32): the clipped sum
    adds exactly the gradients whose norms were clipped, so each contribution stays within C. (The norms read the
    bfloat16 values, widened exactly as they are read: no float32 copy of them is written.)"""
    kept = materialised.to(torch.bfloat16)
    return kept, sum_of_squares(kept)


def _float64(block: OuterGrad) -> OuterGrad:
    left = block.left if block.is_tokens else block.left.double()
    return OuterGrad(left, block.right.double(), block.conv_groups)
