"""A verifying pass: every call's output gradients sketched as they are handed over, for the weighted pass that
checks each layer's rows are per-sample (`self_check.batch_independence_failures`); an error about the calls (a
rule's, where the verifying pass is a norm pass) deferred until the layout is known."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from flashdp._pipeline import self_check
from flashdp._pipeline.collector import NormCollector
from flashdp._pipeline.frontier_rows import FrontierRows
from flashdp._pipeline.layout import Reading, lacks_batch
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError, another_rank_refused


@dataclass
class Verifying:
    """What a verifying pass keeps until the weighted pass: sketches of every call's output gradients (the
    weighted pass is compared with them), and errors found about the calls meanwhile (its rules' too, where it is
    a norm pass), raised only once the layout is verified (learning it may change what they are about)."""

    calls: list[Call]
    #: each call's batch dim per output
    dims: list[tuple[int, ...]]
    #: (call, output) indices of outputs shared across the batch
    shared: set[tuple[int, int]]
    batch: int
    #: each call's other readings per output (`layout.other_readings`): where else the batch could be
    other_readings: list[tuple[tuple[Reading, ...], ...]]
    #: whether earlier passes of this backward learnt part of the layout (a layer time-major, not batch-first)
    after_learning: bool = False
    #: the most units any rank has: every rank runs the weighted passes that many need
    widest: int = 0
    sketches: list[tuple[self_check.RowSketch | None, ...]] = field(init=False)
    #: sketches of the outputs' gradients in their `other_readings`
    other_layouts: dict[tuple[int, int], tuple[self_check.OtherLayout, ...]] = field(default_factory=dict)
    #: the calls some output of which passed with its batch read in one of its other dims too
    passing_elsewhere: list[int] = field(default_factory=list)
    #: the calls an output of which reaches the loss without the batch and not shared across it (an output computed
    #: from the batch's rows, then broadcast over them: `x[None]`): no rows of its own per sample, failing
    without_batch: set[int] = field(default_factory=set)
    #: where the shared outputs meet the batch, their rows verified as samples too
    frontier_rows: FrontierRows | None = None
    errors: list[Exception] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sketches = [()] * len(self.calls)

    def decided(self) -> bool:
        """Whether the pass decides a layout for later steps: every sample has non-zero rows in every layer and at
        every frontier of a shared output (a sample padded out, or masked, or a table below a gate at 0, shows
        nothing about whose rows are whose), and no output's rows pass as samples in another dim too (token masks
        that leave each time step to one sample)."""
        seen = all(sketch.every_sample_seen for sketches in self.sketches for sketch in sketches if sketch)
        frontiers_seen = self.frontier_rows is None or self.frontier_rows.every_sample_seen
        return seen and frontiers_seen and not self.passing_elsewhere

    def undecidable(self, plan: GradientPlan) -> FlashDPError | None:
        """The refusal of a pass under which a layer's rows pass as samples in two dims, where this step's result
        may rest on the wrong one: the layer computes across its rows (attention, convolution: over the true batch
        if it is the other dim), or part of the layout was learnt on this backward (attention over the batch
        explained as a time-major first layer). A position-wise layer's rows are counted alike under either dim."""
        sites = [plan.site(self.calls[i].module) for i in self.passing_elsewhere]
        if not (self.after_learning and sites) and all(site.match.rule.position_wise for site in sites):
            return None
        outputs = [self._readings_of(i) for i in self.passing_elsewhere]
        return undecidable_layout_error([f"{site.label} ({out})" for site, out in zip(sites, outputs, strict=True)])

    def _readings_of(self, index: int) -> str:
        """The shapes of call `index`'s outputs that have other readings, and where B is read in each."""
        call = self.calls[index]
        found = [
            f"output {list(meta.shape)}: B in dim {dim}, or {', or '.join(_where(meta.shape, r) for r in readings)}"
            for meta, dim, readings in zip(call.output_meta, self.dims[index], self.other_readings[index], strict=True)
            if readings
        ]
        return "; ".join(found)

    def sketching_frontiers(self) -> contextlib.AbstractContextManager:
        """Around the sketching pass: each shared output's frontier rows sketched."""
        return self.frontier_rows.sketching() if self.frontier_rows else contextlib.nullcontext()

    def keep(self, index: int, grads: tuple) -> None:
        shared = {j for i, j in self.shared if i == index}
        call = self.calls[index]
        lacking = {
            j
            for j, (meta, dim, grad) in enumerate(zip(call.output_meta, self.dims[index], grads, strict=True))
            if self.batch > 1 and grad is not None and j not in shared and lacks_batch(meta.shape, dim, self.batch)
        }
        if lacking:
            self.without_batch.add(index)
            shared |= lacking
        self.sketches[index] = self_check.sketch_output_gradients(
            call, grads, self.dims[index], self.batch, shared, seed=index
        )
        for j, (readings, sketch) in enumerate(zip(self.other_readings[index], self.sketches[index], strict=True)):
            if readings and sketch is not None:
                self.other_layouts[(index, j)] = tuple(
                    (shape, d, self_check.RowSketch.of(grads[j], shape, d, self.batch, sketch.seed))
                    for shape, d in readings
                )


def receiver(collector: NormCollector, verifying: Verifying | None):
    """`receive(index, grads)` for the norm pass: hands one call's output gradients to the collector; while
    verifying, also sketches them and defers the rule's errors (a rule may fail because a layer's rows are not
    samples: a time-major layer with T == B passes the size checks)."""
    if verifying is None:
        return collector.receive

    def receive(index: int, grads: tuple) -> None:
        verifying.keep(index, grads)
        try:
            collector.receive(index, grads)
        except Exception as error:  # raised after the pass, unless the layout explains it
            verifying.errors.append(error)

    return receive


def _where(output: torch.Size, reading: Reading) -> str:
    """A reading's place in words: another dim of the output, or its rows read as blocks of B interleaved."""
    shape, dim = reading
    if shape == output:
        return f"dim {dim}"
    return f"its {output[dim - 1]} rows in dim {dim - 1} as {shape[dim - 1]} blocks of B interleaved"


def undecidable_layout_error(layers: list[str]) -> FlashDPError:
    """Layers (each with its outputs' readings) whose output gradients pass as per-sample with the batch read in
    either of two places of size B."""
    return FlashDPError(
        f"On this batch the output gradients of {', '.join(dict.fromkeys(layers))} pass as per-sample with the "
        "batch read in either place: flashdp cannot tell which is the batch, nor whether samples mix. Nothing was "
        "added to .grad. Two causes: an output with the batch size in two dims (time-major [T, B, ...] with T "
        "equal to B, whose loss reads each time step from one sample only, through masks or padding), or output "
        "gradients too small to tell readings apart (below 1e-3 of the sample's largest in other layers, as in a "
        "freshly initialised deep model): use a batch size that no other size of these outputs has, or skip this "
        "batch; for a time-major layer, pad to a sequence length that differs from the batch size."
    )


def refusal(
    plan: GradientPlan, calls: list[Call], failing: list[int], errors: list[Exception], refused_here: bool
) -> Exception:
    """Why a verifying pass refuses: a rule's error once the layout is verified, layers whose rows are not samples,
    or (on the other ranks: every rank stops together) another rank's refusal."""
    if not refused_here:
        return another_rank_refused()
    if not failing:
        return errors[0]
    sites = [plan.site(c.module).label for c in calls]
    return self_check.batch_independence_error([sites[i] for i in failing], sites)
