"""The rows where a shared output meets the batch, verified as samples: each sample's gradient of an output shared
across the batch is taken at its frontier, the op where the batch first appears above it, reading row i of that
op's output gradient as sample i's (`shared_outputs._through`). That holds only if the rows there are the loss's
samples in order: a batch sorted by length before a position table is added and put back after, or rows mixed
after the addition (`h + h.mean(0)`), make row i another sample's, or several samples'. A verifying pass sketches
each frontier's output gradient as it sketches a layer's (`self_check.RowSketch`), and every weighted pass compares
it, as for the layers' outputs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from flashdp._pipeline import self_check
from flashdp._pipeline.shared_outputs import SharedOutput, in_per_sample_vjp
from flashdp.errors import FlashDPError

#: sketch seeds of the frontiers start here (the layers' outputs take `index * PROJECTIONS + j`, below)
_SEED_BASE = 1 << 24


@dataclass
class FrontierRows:
    """The frontiers of a verifying pass's shared outputs, their sketches, and the calls whose frontier failed."""

    #: (node, output_nr) of each frontier -> (call index, whether a parameter's) of the shared outputs and the
    #: parameters (`broadcast_params`) it is the frontier of
    frontiers: dict[tuple[Node, int], set[tuple[int, bool]]]
    batch: int
    #: the edges of the parameters among them (`broadcast_params`): autograd runs their frontiers only when asked
    reach: list[GradientEdge] = field(default_factory=list)
    sketches: dict[tuple[Node, int], self_check.RowSketch] = field(default_factory=dict)
    #: (call index, whether a parameter's) of the frontiers that failed
    failing: set[tuple[int, bool]] = field(default_factory=set)
    #: whether a frontier's rows of some sample were too small for the comparisons to see others mixed in
    unresolved: bool = False

    @staticmethod
    def of(shared: Mapping[tuple[int, int], SharedOutput], batch: int) -> FrontierRows:
        frontiers: dict[tuple[Node, int], set[tuple[int, bool]]] = {}
        for (call, _), output in shared.items():
            for frontier in output.frontiers:
                frontiers.setdefault((frontier.node, frontier.output_nr), set()).add((call, output.parameter))
        return FrontierRows(frontiers, batch, [output.edge for output in shared.values() if output.parameter])

    @contextlib.contextmanager
    def sketching(self) -> Iterator[None]:
        """While active (the verifying pass's sketching pass), sketch each frontier's output gradient `[B, ...]`."""

        def sketch(key: tuple[Node, int], grad: Tensor, seed: int) -> None:
            self.sketches[key] = self_check.RowSketch.of(grad, grad.shape, 0, self.batch, seed)

        with self._hooked(sketch):
            yield

    @contextlib.contextmanager
    def comparing(self, weights: Tensor, rtol: float, floors: Tensor) -> Iterator[None]:
        """While active (a weighted pass, `weights` `[B]`), note the calls whose frontier's weighted output
        gradient is not `weights[i]` times sample i's rows."""

        def compare(key: tuple[Node, int], grad: Tensor, seed: int) -> None:
            sketch = self.sketches.get(key)
            if sketch is None:
                return
            if sketch.fails(grad, grad.shape, 0, weights, rtol, floors):
                self.failing |= self.frontiers[key]
            self.unresolved |= not sketch.resolves_every_sample(rtol, floors)

        with self._hooked(compare):
            yield

    @contextlib.contextmanager
    def _hooked(self, take) -> Iterator[None]:
        """Hooks calling `take` on each frontier's output gradient the first time its node runs in the pass (a
        frontier inside a call runs again where `norm_pass._outside_gradients` takes the call's outputs apart)."""
        handles, taken = [], set()
        for number, key in enumerate(self.frontiers if self.batch > 1 else ()):
            node, output_nr = key

            def hook(grad_outputs: tuple, key=key, output_nr=output_nr, seed=_SEED_BASE + number) -> None:
                if grad_outputs[output_nr] is not None and not in_per_sample_vjp() and key not in taken:
                    taken.add(key)
                    take(key, grad_outputs[output_nr], seed)

            handles.append(node.register_prehook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @property
    def every_sample_seen(self) -> bool:
        """Whether every sample's rows were resolved at every frontier that ran (`RowSketch.every_sample_seen`), and
        large enough for the comparisons (`RowSketch.resolves_every_sample`): a frontier whose rows are zero or
        tiny, below a gate initialised at 0 or near it, passes its check without evidence (a breaker's gate at
        1e-10 then 1: 1.2 C on later steps)."""
        return not self.unresolved and all(sketch.every_sample_seen for sketch in self.sketches.values())

    def failing_calls(self, parameters: bool) -> list[int]:
        """The calls with a failing frontier of a shared output (or of a parameter, `parameters`)."""
        return sorted({call for call, parameter in self.failing if parameter is parameters})

    def error(self, labels: list[str]) -> FlashDPError:
        """The refusal of shared outputs (of the layers `labels`) whose frontier rows are not the samples."""
        return FlashDPError(
            f"The output of {', '.join(dict.fromkeys(labels))} has no batch dim and is broadcast over the batch; "
            "flashdp takes each sample's gradient of it where it meets the batch, reading row i there as sample i. "
            "On this batch the rows there are not the loss's samples in order: the batch is reordered between that "
            "op and the loss (sorted by length, then put back), its rows mixed (batch statistics), or the op taken "
            "for where it meets the batch has another batch-free tensor whose first dim equals B by coincidence (a "
            "table of T positions with T == B). Nothing was added to .grad. Add the shared output where the rows are "
            "in the samples' order (before a sort, or after the order is restored), keep each sample's loss a "
            "function of that sample alone, or use a batch size that differs from the tables' lengths."
        )
