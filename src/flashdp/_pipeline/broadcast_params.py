"""Parameters that meet the batch by broadcast: a layer scale `gamma * x` (BEiT, ConvNeXt, DINOv2, CaiT), a class
token expanded to every sample, a position table added to the tokens, learnt latents. Held by a module that has no
rule of its own (a transformer block, the embeddings), they are the generic rule's, whose re-run of the module's
whole forward per sample costs a forward and a backward of everything the module holds (BEiT's blocks: 3.4x
non-private training in bk).

Such a parameter is counted like an output shared across the batch (`shared_outputs`) instead: the norm pass's own
backward takes the gradient flowing into each op where the batch first appears above the parameter (its
*frontiers*, on every path to the loss), row i taken back through that op alone to the parameter: sample i's
gradient, `[B, *shape]`, for all samples at once (a product's backward is `grad * other` before its sum). That row
i there is sample i's is verified, with the shared outputs' frontiers, by the verifying pass (`frontier_rows`), on
every new structure; where the frontiers sit is part of the structure (`learning.frontier_places`), and so are the
ops moving rows by index above them (`routing`: rows sorted inside the module and put back before its output).
Where the verifying pass finds those rows not to be the samples', the module's parameters go back to the generic
rule (`Knowledge.unbroadcast`) and the pass is redone. What the routing does not see between the frontier and the
module's output (rows moved by values from the data, docs/assumptions.md) is then trusted as for a layer's rows:
the generic rule, re-running the module, did not depend on it.

A call's parameters are taken so only where every one its site counts is a leaf that this call alone counts, whose
frontiers are additions, products, expands or a layer norm's affine (`F.layer_norm` in a module of its own, such
as ConvNeXt's channels-first norm: taken back for all samples in one op), reached from the parameter
through views, slices and elementwise maps of it alone, whose other side (where the batch comes from) autograd
tracks, and above which the batch does not appear again (a parameter used in a matrix product, or counted by two
calls, or scaling a fixed table `pe[:T]` whose rows pass for a batch at T == B, leaves the whole call to the generic
rule). They are keyed among the shared outputs as (call,
`len(call.edges) + k`), k the parameter's index in its site's `trainable`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from flashdp._pipeline.knowledge import Knowledge
from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp._pipeline.shared_outputs import MAX_DEPTH, ONE_INPUT_MAPS, Frontier, SharedOutput, batch_side, in_one_op

Key = tuple[int, int]


def broadcast_parameters(known: Knowledge, graph: LossGraph, calls: Sequence[Call]) -> dict[Key, SharedOutput]:
    """(call, `len(call.edges) + k`) -> the k-th parameter of a generic site's call, counted at its frontiers, for
    every call whose parameters all can be (see the module docstring) and whose module's were not found elsewhere
    (`Knowledge.unbroadcast`); none on a batch of one. Found once per backward (several stages ask alike), each
    call given new `SharedOutput`s (a pass fills their `per_sample`)."""
    if graph.loss.shape[0] < 2 or not known.plan.counts_generic:
        return {}
    key = ("broadcast_parameters", id(known.plan), known.unbroadcast, tuple(map(id, calls)))
    # (the plan and calls held with the result: their ids in the key are not reused while it is kept)
    found, _, _ = graph.memo(key, lambda: (_found(known, graph, calls), known.plan, list(calls)))
    return {k: SharedOutput(p.edge, p.shape, p.frontiers, parameter=True) for k, p in found.items()}


def _found(known: Knowledge, graph: LossGraph, calls: Sequence[Call]) -> dict[Key, SharedOutput]:
    plan = known.plan
    generic = [i for i, c in enumerate(calls) if plan.site(c.module).is_generic]
    if not generic:
        return {}
    counted = Counter(plan.param_of[(id(c.module), name)].key for c in calls for name in plan.site(c.module).trainable)
    found: dict[Key, SharedOutput] = {}
    for index in generic:
        call = calls[index]
        if plan.site(call.module).trainable and id(call.module) not in known.unbroadcast:
            found |= _call_parameters(plan, graph, call, index, counted) or {}
    return found


def frontier_edges(known: Knowledge, graph: LossGraph, calls: Sequence[Call]) -> list[tuple[Node, int]]:
    """(node, output_nr) of each frontier of the parameters `broadcast_parameters` takes: the routing above them is
    part of what their rows rest on (rows sorted inside their module and put back before its output)."""
    return [(f.node, f.output_nr) for p in broadcast_parameters(known, graph, calls).values() for f in p.frontiers]


def _call_parameters(
    plan: GradientPlan, graph: LossGraph, call: Call, index: int, counted: Mapping[Hashable, int]
) -> dict[Key, SharedOutput] | None:
    """The call's parameters with their frontiers, or None where one of them cannot be counted at frontiers."""
    batch, found = graph.loss.shape[0], {}
    for k, name in enumerate(plan.site(call.module).trainable):
        tensor = call.parameter(name)
        if counted[plan.param_of[(id(call.module), name)].key] != 1 or not _is_leaf(tensor):
            return None
        edge = get_gradient_edge(tensor)
        frontiers = _frontiers(graph, edge, batch)
        if frontiers is None:
            return None
        found[(index, len(call.edges) + k)] = SharedOutput(edge, tensor.shape, frontiers, parameter=True)
    return found


def _frontiers(graph: LossGraph, edge: GradientEdge, batch: int) -> list[Frontier] | None:
    """A parameter's frontiers ([] where it does not reach the loss: no gradient), or None where it cannot be
    counted at them."""
    if not graph.reaches_loss(edge):
        return []
    found = graph.frontiers(edge, batch, parameter=True)
    if not found or not all(in_one_op(f) and _elements_of(f.child[0], edge.node) for f in found):
        return None
    if not all(_batch_side_tracked(f) for f in found) or any(_met_again(graph, f, batch) for f in found):
        return None
    return found


def _batch_side_tracked(frontier: Frontier) -> bool:
    """Whether the frontier's other side, where the batch comes from, is a tensor autograd tracks (computed from the
    layers' outputs or inputs): an untracked one may be a buffer whose `[T, d]` rows pass for a batch at T == B
    (`alpha * pe[:T]`, with `pe` a fixed table), whatever happens above it (a breaker added it to a time-major batch,
    or broadcast its mean, where no later op shows the batch again). An expand has no other side: its rows are
    checked, as any frontier's, and `_met_again`."""
    others = batch_side(frontier)
    return not others or any(child is not None for child in others)


def _met_again(graph: LossGraph, frontier: Frontier, batch: int) -> bool:
    """Whether the batch appears again above the frontier's output: `alpha * pe[:T]` (a buffer's `[T, d]` rows) at
    T == B passes for a batch by its size, and is broadcast over the true one later (`x + ...`, `[B, T, d]`): its
    rows were positions. (Its rows check can pass without evidence: where one sample reads each position, or where
    its gradient is zero, a scale initialised at 0: a breaker's 0.54 C on later steps.) Also true where a batch is
    broadcast again (a time-major decoder's `ctx.expand(T2, B, d)` at T2 == B): the generic rule counts the module
    then, exact either way."""
    return bool(graph.frontiers(GradientEdge(frontier.node, frontier.output_nr), batch))


def _elements_of(node: Node, leaf: Node) -> bool:
    """Whether `node` computes its output from the parameter's (`leaf`, its AccumulateGrad) alone, through
    `shared_outputs.ONE_INPUT_MAPS` (a slice `pos[:, :T]`, a view): no op on the way to the batch may bring in
    anything else, the data among it (`p * x.mean()` with untracked data `x` reads every sample's: each sample's
    loss would depend on the others', which no gradient shows)."""
    for _ in range(MAX_DEPTH):
        if node is leaf:
            return True
        tracked = [child for child, _ in node.next_functions if child is not None]
        if node.name() not in ONE_INPUT_MAPS or len(tracked) != 1:
            return False
        node = tracked[0]
    return False


def _is_leaf(tensor: Tensor) -> bool:
    return isinstance(tensor, Tensor) and tensor.is_leaf and tensor.requires_grad


def parameters_of(entries: Mapping[int, SharedOutput], trainable: Sequence[str], outputs: int) -> dict:
    """A call's parameters counted at their frontiers, by name, with their per-sample gradients `[B, *shape]`, from
    the call's `entries` among the shared outputs (by output or `outputs + k`; `outputs`: the call's number of
    output edges; `trainable`: its site's parameter names)."""
    return {trainable[j - outputs]: output.per_sample for j, output in entries.items() if output.parameter}
