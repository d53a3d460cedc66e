"""A verifying pass: every call's output gradients sketched as they are handed over, for the weighted pass that
checks each layer's rows are per-sample (`self_check.batch_independence_failures`); an error about the calls (a
rule's, where the verifying pass is a norm pass) deferred until the layout is known."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdp._pipeline import self_check
from flashdp._pipeline.collector import NormCollector
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import another_rank_refused


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
    #: each call's other dims of size B per output, where its layer could be learnt to read the batch
    other_dims: list[tuple[tuple[int, ...], ...]]
    sketches: list[tuple[self_check.RowSketch | None, ...]] = field(init=False)
    #: sketches of the outputs' gradients as read in their `other_dims`
    other_layouts: dict[tuple[int, int], tuple[tuple[int, self_check.RowSketch], ...]] = field(default_factory=dict)
    #: set by the weighted pass: some output passed in one of its other dims too
    passing_elsewhere: bool = False
    errors: list[Exception] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sketches = [()] * len(self.calls)

    def decided(self) -> bool:
        """Whether the pass decides a layout for later steps: every sample has non-zero rows in every layer (a
        sample padded out, or masked, shows nothing about whose rows are whose), and no output's rows also pass
        as another dim's (time steps that masks leave to one sample each look like samples)."""
        seen = all(sketch.every_sample_seen for sketches in self.sketches for sketch in sketches if sketch)
        return seen and not self.passing_elsewhere

    def keep(self, index: int, grads: tuple) -> None:
        shared = {j for i, j in self.shared if i == index}
        call = self.calls[index]
        self.sketches[index] = self_check.sketch_output_gradients(
            call, grads, self.dims[index], self.batch, shared, seed=index
        )
        for j, (dims, sketch) in enumerate(zip(self.other_dims[index], self.sketches[index], strict=True)):
            if dims and sketch is not None:
                self.other_layouts[(index, j)] = tuple(
                    (d, self_check.RowSketch.of(grads[j], call.output_meta[j].shape, d, self.batch, sketch.seed))
                    for d in dims
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
