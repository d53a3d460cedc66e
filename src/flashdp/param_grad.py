"""One parameter's per-sample gradients in one step: the exact norm of the SUM of every contribution (a module
called several times, a parameter shared by several modules), then the clipped sum `sum_b c_b g_b`."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flashdp import kernels, outer
from flashdp.errors import FlashDPError
from flashdp.rules.grads import OuterGrad, PerSampleGrad, accumulation_dtype

StrategyChoice = Literal["auto", "ghost", "direct"]


class ParamGradient:
    """Collects a parameter's contributions, then gives `norm_sq()` `[B]` and `clipped_sum(coef)` (param shape).

    Between the two it keeps only what the clipped sum needs: the per-sample gradients when the cost model
    materialised them (direct, only when `keep_for_sum`: book-keeping), else the factors. Without
    `keep_for_sum` (ghost, flash) the direct norm comes from a kernel that never materialises them.
    """

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        batch_size: int,
        strategy: StrategyChoice = "auto",
        keep_for_sum: bool = True,
    ) -> None:
        self.name = name
        self.shape = torch.Size(shape)
        self.batch_size = batch_size
        self.strategy_choice = strategy
        self.keep_for_sum = keep_for_sum
        self.dense: Tensor | None = None  # [B, *shape]
        self.factors: list[OuterGrad] = []
        self.per_sample: Tensor | None = None  # [B * groups, p, d], when direct
        self.strategy: str | None = None
        self.groups = 1

    def add(self, grad: PerSampleGrad, source: str) -> None:
        if isinstance(grad, OuterGrad):
            self._check_outer(grad, source)
            self.factors.append(grad)
            return
        if not isinstance(grad, Tensor) or grad.shape != (self.batch_size, *self.shape):
            got = tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__
            raise FlashDPError(
                f"Rule for {source} returned a per-sample gradient of shape {got} for '{self.name}'; expected "
                f"[B, *param.shape] = {(self.batch_size, *self.shape)} or an OuterGrad."
            )
        grad = grad.to(accumulation_dtype(grad))
        self.dense = grad if self.dense is None else self.dense + grad

    def _check_outer(self, grad: OuterGrad, source: str) -> None:
        p, d = grad.block_shape
        rows = grad.right.shape[0]
        if rows != self.batch_size * grad.groups or grad.groups * p * d != self.shape.numel():
            raise FlashDPError(
                f"Rule for {source} returned an OuterGrad for '{self.name}' with {rows} rows of [{p}, {d}] blocks "
                f"in {grad.groups} group(s); the parameter has shape {tuple(self.shape)} and the batch "
                f"{self.batch_size} samples."
            )
        if self.factors and (self.factors[0].groups, self.factors[0].block_shape) != (grad.groups, (p, d)):
            raise FlashDPError(f"'{self.name}' is used by layers whose gradients do not share a layout ({source}).")

    def norm_sq(self) -> Tensor:
        """`[B]` squared norms of the per-sample gradients, float32 (float64 for float64 inputs)."""
        if self.dense is not None and self.factors:
            raise FlashDPError(
                f"'{self.name}' is shared by layers of different kinds (a factored and a dense per-sample "
                "gradient); flashdp cannot combine them exactly. Untie the parameter or freeze it."
            )
        if self.dense is not None:
            self.strategy = "per-sample"
            return outer.sum_of_squares(self.dense)
        return self._factors_norm_sq()

    def _factors_norm_sq(self) -> Tensor:
        dtype = accumulation_dtype(*(f.right for f in self.factors))
        dense = [f for f in self.factors if not f.is_tokens]
        token_blocks = [f for f in self.factors if f.is_tokens]
        tokens = outer.merge_tokens(token_blocks) if token_blocks else None
        first = self.factors[0]
        self.groups = first.groups
        total = first.right.new_zeros(first.right.shape[0], dtype=dtype)
        strategies = []
        if dense:
            strategy = self._choose(dense)
            strategies.append(strategy)
            if strategy == "direct" and (self.keep_for_sum or tokens is not None):
                # materialised: kept for the bk sum, or needed for the cross term with a tied table
                self.per_sample = outer.per_sample_blocks(dense, dtype)
                total += outer.sum_of_squares(self.per_sample)
                if tokens is not None:
                    total += 2 * outer.token_inner_with_dense(self.per_sample, tokens, dtype)
            elif tokens is not None:
                total += outer.ghost_norm_sq(dense, dtype) + 2 * outer.ghost_inner(dense, [tokens], dtype)
            else:  # the norm alone: a kernel where it can run, never the per-sample gradient
                left, right = _concat_positions(dense)
                norm = kernels.outer_direct_norm_sq if strategy == "direct" else kernels.outer_ghost_norm_sq
                total += norm(left, right).to(dtype)
        if tokens is not None:
            strategies.append("tokens")
            total += outer.token_norm_sq(tokens, dtype)
            token_blocks = [tokens]
        self.factors = ([] if self.per_sample is not None else dense) + token_blocks
        self.strategy = "+".join(strategies)
        return total.view(self.batch_size, first.groups).sum(1)

    def _choose(self, dense: list[OuterGrad]) -> str:
        if self.strategy_choice != "auto":
            return self.strategy_choice
        p, d = dense[0].block_shape
        return outer.norm_strategy(sum(f.right.shape[1] for f in dense), p, d)

    def clipped_sum(self, coef: Tensor) -> Tensor:
        """`sum_b coef_b g_b`, shaped like the parameter. coef: `[B]`. Call after `norm_sq()`."""
        if self.dense is not None:
            return torch.tensordot(coef.to(self.dense.dtype), self.dense, dims=1)
        parts = []
        if self.per_sample is not None:
            parts.append(outer.clipped_sum_per_sample(self.per_sample, coef, self.groups))
        dense = [f for f in self.factors if not f.is_tokens]
        if dense:
            left, right = _concat_positions(dense)
            parts.append(kernels.clipped_sum(left, right, coef, self.groups))
        tokens = [f for f in self.factors if f.is_tokens]
        if tokens:
            parts.append(outer.clipped_sum_factors(tokens, coef, accumulation_dtype(*(f.right for f in tokens))))
        return sum(parts[1:], parts[0]).reshape(self.shape)


def _concat_positions(blocks: list[OuterGrad]) -> tuple[Tensor, Tensor]:
    """One (L, R) pair for blocks of a parameter used by several calls: their positions concatenated."""
    if len(blocks) == 1:
        return blocks[0].left, blocks[0].right
    return torch.cat([b.left for b in blocks], dim=1), torch.cat([b.right for b in blocks], dim=1)
