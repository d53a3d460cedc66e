"""The oracle across STEPS: one engine trained through a sequence of backwards whose batch shapes change, each
step's norms and clipped sums compared with per-sample gradients taken one sample at a time (float64), on an
independent copy of the model that flashdp never touched."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

import flashdp
from tests.oracle import assert_clipped_sums, clip, per_sample_grads

#: batch -> [B] per-sample losses of the model on that batch
LossOf = Callable[[nn.Module, object], Tensor]
#: batch, i -> the batch holding sample i alone
Sample = Callable[[object, int], object]


def check_steps(
    model: nn.Module,
    batches: Sequence[object],
    loss_of: LossOf,
    sample: Sample,
    sizes: Sequence[int],
    *,
    mode: str = "bk",
    self_check: int | None = None,
    max_grad_norm: float = 1.0,
    rtol: float = 1e-7,
    refusals: bool = False,
    before_step: Callable[[nn.Module, int], None] | None = None,
) -> list[int]:
    """One engine through every batch in turn; each step's norms and `.grad` against the oracle (float64). With
    `refusals`, a step may be refused (FlashDPError) instead: the steps refused are returned. `before_step(model,
    step)` changes both models' weights before a step (under no_grad)."""
    reference = copy.deepcopy(model)
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=max_grad_norm, noise_multiplier=0.0, self_check=self_check
    )
    refused: list[int] = []
    try:
        for step, (batch, size) in enumerate(zip(batches, sizes, strict=True)):
            if before_step is not None:  # (an optimiser's change to the weights, on both models)
                with torch.no_grad():
                    before_step(model, step), before_step(reference, step)
            expected_ps = per_sample_grads(
                reference, lambda rows, b=batch: loss_of(reference, sample(b, rows.start)), size
            )
            expected_norms, expected_sums = clip(expected_ps, "flat", max_grad_norm)
            model.zero_grad(set_to_none=True)
            try:
                norms = engine.backward(loss_of(model, batch))
            except flashdp.FlashDPError:
                if not refusals:
                    raise
                refused.append(step)
                continue
            where = f"step {step} (batch of {size})"
            torch.testing.assert_close(
                norms.double(), expected_norms, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
            )
            assert_clipped_sums(model, expected_sums, rtol, where=f"{where}, ")
    finally:
        engine.detach()
    return refused
