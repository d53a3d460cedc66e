"""Whose rows are whose beyond sizes: the part of the loss's graph, between the rule sites' outputs and the loss, that
a verified layout rests on (`Routing`).

The verifying pass (verifying.py) finds every layer's rows per-sample on one batch, and a forward structure
(the modules called, their sizes and the graph's ops: `measurement._structure`) is trusted on later steps. The ops
do not fix whose rows are whose when an op moves elements by index values computed from the data: a batch sorted by
a key before a layer and put back in order after it, tokens routed to experts, `pack_padded_sequence` sorting by
length. Such an op moves the rows differently on every batch, and on the verified batch it may have moved none (a
batch already in sorted order: the identity), so the verification says nothing of the next batch's order.

So a structure is verified under its `Routing`: the nodes that autograd runs from the loss down to the rule sites'
outputs and that move elements by index (`MOVES`), in graph order, with the shapes of their index values and
those values that decide whose rows are whose: all of them, except where a node moves a rule site's output whose
batch dim the verified structure knows, where only the index in that dim decides (HF's sequence classifiers take
`logits[arange(B), last]`: `last` picks a position within each sample, whatever its values). A later step of the
structure is trusted only if its routing is the same; otherwise it is verified again, or, where no verifying pass
can run (FSDP1), refused. The cost: a scan of the kinds of the nodes above the rule sites (found by the walk the
norm pass makes anyway) and, only where such nodes are found, one comparison of their deciding index values with
those verified. A model without them pays nothing more; one whose deciding values change with the data is
verified on every step (one extra pass), until the layers they move are counted by an enclosing rule.

Not in `MOVES`, and why:
- ops that select by value within a window (max / min / median / mode / kthvalue / cummax over a dim, max pooling,
  nll_loss picking the target class): a window holding rows of two samples makes one loss depend on both (samples
  mixed, what the self-check is for); within the assumptions they move no row to another sample, whatever the data.
- element-wise selects (where, masked_fill, index_fill, scatter of a value): every element stays in its place.
Not seen here, so checked at the self-check's schedule only: rows moved by values rather than indices (a 0/1
matrix, or a mask choosing between rows moved by constant ops, built from the data), Python numbers read from the
data (`.item()`) as shifts or slice bounds, control flow on the data choosing other ops, and custom autograd
Functions (opaque).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.autograd.graph import Node

from flashdp._pipeline.layout import lacks_batch, outputs
from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError, another_rank_refused

#: autograd nodes of ops that move elements to other positions by index values (from the data, possibly), with
#: the saved attributes holding those values
MOVES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(["IndexBackward0", "UnsafeIndexBackward0"], ("_saved_indices",)),
    "UnsafeMaskedIndexBackward0": ("_saved_indices", "_saved_mask"),
    **dict.fromkeys(
        [
            "IndexSelectBackward0",
            "GatherBackward0",
            "TakeBackward0",
            "PutBackward0",
            "ScatterBackward0",
            "ScatterAddBackward0",
            "ScatterReduceBackward0",
            "IndexAddBackward0",
            "IndexCopyBackward0",
            "IndexReduceBackward0",
        ],
        ("_saved_index",),
    ),
    **dict.fromkeys(["IndexPutBackward0", "IndexPutImplBackward0", "UnsafeIndexPutBackward0"], ("_saved_indices",)),
    "UnsafeMaskedIndexPutAccumulateBackward0": ("_saved_indices", "_saved_mask"),
    **dict.fromkeys(["MaskedSelectBackward0", "MaskedScatterBackward0"], ("_saved_mask",)),
    **dict.fromkeys(["SortBackward0", "SortBackward1", "TopkBackward0"], ("_saved_indices",)),
    "EmbeddingBackward0": ("_saved_indices",),  # (above a rule site: a batch tensor looked up as the table)
    "EmbeddingBagBackward0": ("_saved_indices", "_saved_offsets"),
    "PackPaddedSequenceBackward0": ("_saved_result1",),  # (the batch sizes per step)
    # a sparse matrix times rows (`torch.sparse.mm(P, h)`: a permutation built from the data): its indices and values
    "SparseAddmmBackward0": ("_saved_mat1",),
    **dict.fromkeys(["MaxUnpool2DBackward0", "MaxUnpool3DBackward0"], ("_saved_indices",)),
}


@dataclass(frozen=True)
class Routing:
    """The graph from the loss down to the rule sites' outputs, as far as whose rows are whose depends on the data."""

    #: the kind of every node of `MOVES` autograd runs from the loss to the rule sites' outputs, in graph order
    moves: tuple[str, ...]
    #: per node, in the same order: the shapes of the index values it moved elements by (None for an index not
    #: given: `x[:, i]`)
    shapes: tuple[tuple[torch.Size | None, ...], ...] = ()
    #: and those of the values that decide whose rows are whose (None where the values cannot: `_relevant`)
    values: tuple[tuple[Tensor | None, ...], ...] = ()

    def same(self, other: Routing) -> bool:
        """Whether `other` routes rows as this does: the same nodes, index shapes and deciding index values (one
        comparison per device holding such values, where there are any)."""
        if self.moves != other.moves or self.shapes != other.shapes:
            return False
        pairs = [
            (a, b)
            for ours, theirs in zip(self.values, other.values, strict=True)
            for a, b in zip(ours, theirs, strict=True)
        ]
        if any((a is None) != (b is None) for a, b in pairs):
            return False
        pairs = [(a, b) for a, b in pairs if a is not None]
        if any(a.dtype != b.dtype or a.device != b.device for a, b in pairs):
            return False
        equal: dict[torch.device, list[Tensor]] = {}
        for a, b in pairs:
            if a.numel():
                equal.setdefault(a.device, []).append((a == b).all())
        return all(bool(torch.stack(flags).all()) for flags in equal.values())

    @property
    def deciding(self) -> list[str]:
        """The kinds of the nodes with index values that decide whose rows are whose (not only moves within each
        sample)."""
        return [kind for kind, ix in zip(self.moves, self.values, strict=True) if any(v is not None for v in ix)]

    def kept(self) -> Routing:
        """This routing with copies of its index values (the model may reuse an index tensor in place)."""
        return replace(self, values=tuple(tuple(_copy(t) for t in ix) for ix in self.values))


#: the routing of a graph that moves no element by index above the rule sites (or of a batch of one, whose rows are
#: all its one sample's)
NONE = Routing(())

#: `t[i_0, i_1, ...]`: element p is taken from `(i_0[p], i_1[p], ...)`, so only the index in t's batch dim decides
#: whose it is
_INDEXING = {"IndexBackward0", "UnsafeIndexBackward0"}
#: nodes moving elements of their one moved input (`next_functions[0]`) along `_saved_dim` alone
_ALONG_DIM = {"IndexSelectBackward0", "GatherBackward0", "SortBackward0", "SortBackward1", "TopkBackward0"}
#: a contiguous reshape's node: a rule site's output that reshapes an internal tensor (`Call.edges`: its base)
_RESHAPES = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}


def of(
    graph: LossGraph,
    plan: GradientPlan,
    calls: Iterable[Call],
    shared_sites: Collection[int] = (),
    frontiers: Iterable[tuple[Node, int]] = (),
) -> Routing:
    """The routing above the outputs of the rule sites' calls among `calls` (read before the norm pass frees the
    graph's saved tensors), and above `frontiers` (node, output_nr: where parameters counted there meet the batch,
    inside their module's call: `broadcast_params`); `shared_sites`: the ids of the modules known to share their
    outputs across the batch."""
    calls = list(calls)
    edges = {(e.node, e.output_nr) for c in calls if plan.site(c.module).match for e in c.edges} | set(frontiers)
    above = graph.above(edges)
    moving = [(n, kind) for n in (graph.loss.grad_fn, *graph.parents) if (kind := type(n).__name__) in MOVES]
    moving = [(n, kind) for n, kind in moving if n in above]
    if not moving:
        return NONE
    batch_dims = _batch_dims(plan, calls, graph.loss.shape[0], shared_sites)
    indices = [_index_values(n, MOVES[kind]) for n, kind in moving]
    decide = [_relevant(n, kind, ix, batch_dims) for (n, kind), ix in zip(moving, indices, strict=True)]
    return Routing(
        tuple(kind for _, kind in moving),
        tuple(tuple(None if t is None else t.shape for t in ix) for ix in indices),
        tuple(
            tuple(t if k in keep else None for k, t in enumerate(ix)) for ix, keep in zip(indices, decide, strict=True)
        ),
    )


def _batch_dims(
    plan: GradientPlan, calls: list[Call], batch: int, shared_sites: Collection[int]
) -> dict[tuple[Node, int], tuple[int, torch.Size]]:
    """(node, output_nr) of each rule site output that carries the batch -> its batch dim (verified with its
    structure) and its shape."""
    found = {}
    for out in outputs(plan, calls):
        if not lacks_batch(out.meta.shape, out.dim, batch) and id(calls[out.call].module) not in shared_sites:
            edge = calls[out.call].edges[out.index]
            found[(edge.node, edge.output_nr)] = (out.dim, out.meta.shape)
    return found


def _relevant(node: Node, kind: str, indices: tuple, batch_dims: dict) -> set[int]:
    """Which of a node's index values decide whose rows are whose. Where the node moves a rule site's output (or its
    reshape) whose batch dim is known, only the index in that dim (`t[i, j]`: i), or none for a move along another
    dim (a gather within each sample); every value elsewhere."""
    every = set(range(len(indices)))
    if kind not in _INDEXING and kind not in _ALONG_DIM:
        return every
    moved = node.next_functions[0]
    if moved[0] is None:
        return every
    shape = tuple(moved[0]._input_metadata[moved[1]].shape)
    known = batch_dims.get(moved)
    if known is None and type(moved[0]).__name__ in _RESHAPES:
        known = batch_dims.get(moved[0].next_functions[0])
    if known is None or tuple(known[1]) != shape:
        return every
    dim = known[0]
    if kind in _INDEXING:
        if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):  # (a mask spans dims)
            return every
        return {dim} if dim < len(indices) and indices[dim] is not None else set()
    along = int(node._saved_dim)
    along = along - 2**64 if along >= 2**63 else along  # (saved as unsigned)
    return every if along % len(shape) == dim else set()


def _index_values(node: Node, attributes: tuple[str, ...]) -> tuple[Tensor | None, ...]:
    values: list[Tensor | None] = []
    for name in attributes:
        saved = getattr(node, name)
        values.extend(saved if isinstance(saved, (tuple, list)) else (saved,))
    tensors = [v if v is None or isinstance(v, Tensor) else torch.as_tensor(v) for v in values]
    return tuple(part for v in tensors for part in _dense_parts(v))


def _dense_parts(t: Tensor | None) -> tuple[Tensor | None, ...]:
    """A sparse tensor as its (coalesced) indices and values, which say where it moves elements; others as they are."""
    if t is None or t.layout == torch.strided:
        return (t,)
    coo = t.to_sparse_coo().coalesce()
    return coo.indices(), coo.values()


def _copy(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def unverifiable_error(moves: Sequence[str]) -> FlashDPError:
    """Under FSDP1, which cannot run a verifying pass: rows moved by index between a layer and the loss."""
    if not moves:
        return another_rank_refused()
    kinds = ", ".join(dict.fromkeys(m.removesuffix("Backward0").removesuffix("Backward1") for m in moves))
    return FlashDPError(
        "Under FSDP1, which cannot run flashdp's verifying pass, a layer's rows are told to be samples by size alone, "
        f"and between a layer's output and the loss the forward moves rows by index values ({kinds}): which sample "
        "each row belongs to may change with every batch, and sizes cannot tell. Nothing was added to .grad. Use "
        "FSDP2 (fully_shard) or DDP, where flashdp verifies every batch whose rows move differently, or move the "
        "rows inside one layer counted as a whole (register a rule for the module that moves them)."
    )
