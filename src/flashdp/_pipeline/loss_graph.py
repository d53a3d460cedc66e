"""The loss's autograd graph, indexed once per backward and shared by every stage that asks about it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable
from typing import TypeVar

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from flashdp._pipeline import shared_outputs
from flashdp._pipeline.users import UserGroups

#: node -> the nodes that consume it, with the `next_functions` slot they consume it at
Parents = dict[Node, list[tuple[Node, int]]]
#: `LossGraph.operations`: the number of nodes, and a hash of their ops and wiring
Operations = tuple[int, int]
T = TypeVar("T")


class LossGraph:
    """The graph from `loss` down, walked once (on the first question) into each node's consumers, and the clipped
    units of its rows: each row, or each user's rows together (`users`).

    The nodes' Python objects are held while the graph is; their saved tensors are freed by autograd as usual."""

    def __init__(self, loss: Tensor, users: UserGroups | None = None) -> None:
        self.loss, self.users = loss, users
        self._memo: dict[tuple, object] = {}  # (`memo`: frontiers, nodes above, what stages derive alike)

    @property
    def units(self) -> int:
        """How many units are clipped: the rows of the loss, or its users."""
        return self.loss.shape[0] if self.users is None else self.users.count

    @property
    def parents(self) -> Parents:
        """Every node reachable from the loss, with the nodes that consume it (the loss's own node has none)."""
        return self._index[0]

    @property
    def operations(self) -> Operations:
        """The graph's operations and their wiring, comparable across backwards: the number of nodes and a hash of,
        per node in an order fixed by the graph's shape, its type (the op, e.g. `FlipBackward0`, or a custom
        Function's), the dims it works along and the flags it saved (`_structure_attributes`) and, per input slot,
        the number of the node it reads (and which of that node's outputs), or None. Equal for two graphs that
        compute the same ops along the same dims in the same modes and arrangement, whatever the sizes and values;
        different where an op is added, removed, rewired, moved to another dim or run in another mode (a flip of the
        rows, a transpose to time-major, a loss that subtracts the batch mean, a cumulative sum over the batch where
        it was over time, batch statistics where running ones were read), but for a 64-bit hash collision. Kept as
        a hash: a model whose graph differs on every step keeps one per verified structure. The dims of size 1 of
        each node's outputs are part of it, and for a reshape whether each is a multiple of the batch
        (`_size_classes`): an op along a dim of size 1 mixes nothing, and a reshape's rows follow the samples' only
        at some sizes."""
        return self._index[1]

    def places(self, edges: Iterable[tuple[GradientEdge, ...]]) -> tuple[tuple[tuple[int, int] | None, ...], ...]:
        """Where each group of edges (a recorded call's outputs, or inputs) sits in the graph: each edge's node's
        number in `operations` (and its output), None off the graph. With `operations`, it tells which layer sits
        where: two layers of one type whose places are swapped give the same ops, not the same places."""
        number = self._index[2]
        return tuple(
            tuple((number[e.node], e.output_nr) if e.node in number else None for e in group) for group in edges
        )

    @functools.cached_property
    def _index(self) -> tuple[Parents, Operations, dict[Node, int]]:
        """One walk from the loss's node: each node numbered when first met, so the numbering, and so
        `operations`, depends only on the graph's shape."""
        parents: Parents = {}
        operations: list[tuple[type, tuple[tuple[int, int] | None, ...], tuple]] = []
        root, batch = self.loss.grad_fn, self.loss.shape[0] if self.loss.dim() else 1
        number: dict[Node, int] = {root: 0} if root is not None else {}
        pending = list(number)
        while pending:
            node = pending.pop()
            inputs: list[tuple[int, int] | None] = []
            for slot, (child, output_nr) in enumerate(node.next_functions):
                if child is None:
                    inputs.append(None)
                    continue
                parents.setdefault(child, []).append((node, slot))
                if child not in number:
                    number[child] = len(number)
                    pending.append(child)
                inputs.append((number[child], output_nr))
            kind = type(node)  # (the dims inline: this loop runs over every node on every backward)
            names = _STRUCTURE_ATTRIBUTES.get(kind)
            if names is None:
                names = _structure_attributes(node)
            sizes = _size_classes(node, batch if kind in _RESHAPING else 0) if kind in _SIZED else ()
            operations.append((kind, tuple(inputs), _dims(node, names) if names else (), sizes))
        return parents, (len(operations), hash(tuple(operations))), number

    def reaches_loss(self, edge: GradientEdge) -> bool:
        """Whether something above the loss's own node consumes the edge's node."""
        return edge.node in self.parents

    def reads(self, edge: GradientEdge) -> bool:
        """Whether the loss's gradient flows into the edge's node (the loss's own node included)."""
        return edge.node is self.loss.grad_fn or edge.node in self.parents

    def frontiers(
        self, edge: GradientEdge, batch: int, shared: shared_outputs.SharedEdges = frozenset(), parameter: bool = False
    ) -> list[shared_outputs.Frontier]:
        """Where the batch first appears above a shared output (`shared_outputs.frontiers`), beside the `shared`
        ones (walked once per backward: a structure's key and the norm pass ask alike)."""
        return self.memo(
            ("frontiers", edge.node, edge.output_nr, batch, shared, parameter),
            lambda: shared_outputs.frontiers(edge, self.parents, batch, shared, parameter),
        )

    def memo(self, key: tuple, compute: Callable[[], T]) -> T:
        """`compute()`, computed once per backward for `key` (what several stages derive alike from the graph and
        the calls: not to be changed by the caller)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]  # type: ignore[return-value]

    def above(self, edges: Collection[tuple[Node, int]]) -> set[Node]:
        """The nodes from which one of `edges` (node, output_nr) is reachable by at least one step: autograd runs
        them to compute that edge's gradient. Walked once per set of edges (the routing and the norm pass ask alike);
        not to be changed by the caller."""
        key = frozenset(edges)
        return self.memo(("above", key), lambda: self._walk_above(key))

    def _walk_above(self, edges: Collection[tuple[Node, int]]) -> set[Node]:
        pending = [
            consumer
            for node, output_nr in edges
            for consumer, slot in self.parents.get(node, ())
            if consumer.next_functions[slot][1] == output_nr
        ]
        found: set[Node] = set()
        while pending:
            node = pending.pop()
            if node not in found:
                found.add(node)
                pending.extend(consumer for consumer, _ in self.parents.get(node, ()))
        return found


def _dims(node: Node, names: tuple[str, ...]) -> tuple:
    """The dims `node`'s op saved, and the number of dims of its output: a saved `-2` is time in `[B, T, d]` and
    the batch in `[B, d]` (a view that drops a size-1 time dim)."""
    metadata = node._input_metadata
    return (*(getattr(node, name) for name in names), len(metadata[0].shape) if metadata else None)


def _size_classes(node: Node, batch: int) -> tuple:
    """Which dims of each of `node`'s outputs have size 1 and, with `batch`, which are a multiple of it: along a dim
    of size 1 an op mixes nothing (a flip, a cumulative sum, a reshape of `[B, 1, d]` into `[1, B, d]` moves no row),
    and a reshape's rows follow the samples' only where the dims it merges and splits are multiples of the batch
    (`[B, T, d]` as `[B T / 2, 2, d]` pairs each sample's tokens at even T, and the last of one sample with the
    first of the next at odd T): a layout verified at one size says nothing of the same ops at another (breakers'
    models verified at T = 1 and T = 2 mixed samples at T = 2 and T = 3: one sample added 2 C and 1.7 C). Asked of
    the ops that work along dims or saved sizes (`_SIZED`), the multiples of reshapes and the like only
    (`_RESHAPING`), not of elementwise ops, which move nothing."""
    return _classes(tuple(tuple(m.shape) for m in node._input_metadata), batch)


@functools.lru_cache(maxsize=4096)
def _classes(shapes: tuple[tuple[int, ...], ...], batch: int) -> tuple:
    """`_size_classes` of outputs of these shapes (the same shapes recur in every layer: looked up, not computed)."""
    units = tuple(tuple(d for d, size in enumerate(shape) if size == 1) for shape in shapes)
    if batch < 2:
        return units if any(units) else ()
    multiples = tuple(tuple(d for d, size in enumerate(shape) if size % batch == 0) for shape in shapes)
    return (units, multiples, tuple(_whole_samples(shape, batch) for shape in shapes))


def _whole_samples(shape: tuple[int, ...], batch: int) -> tuple[int, ...]:
    """The dims d whose leading dims' product is a multiple of the batch: read as B sample-major blocks, each
    block of dims d onwards lies in one sample (a cumulative sum over the last dim of `[2, T, 4]` holding `[B, T,
    2]` stays in each sample at even T only, with no dim a multiple of B either way)."""
    leading, whole = 1, []
    for d, size in enumerate(shape[:-1], start=1):
        leading *= size
        if leading % batch == 0:
            whole.append(d)
    return tuple(whole)


#: per node type, the saved attributes `_structure_attributes` names
_STRUCTURE_ATTRIBUTES: dict[type, tuple[str, ...]] = {}
#: the node types whose op works along dims or saved sizes or shapes, and custom Functions (`_size_classes` is asked
#: of these only)
_SIZED: set[type] = set()
#: those of them that saved sizes or shapes (views, reshapes, expands, slices: their elements' places depend on them)
_RESHAPING: set[type] = set()


#: saved arguments that are positions, not sizes: where a roll shifts to, where a slice starts and its step, which
#: index a select picks, how much a pad adds (a constant of the model for ops along time or features; along the
#: batch, or on a flattened batch, another value pairs other samples' rows: activations padded to a multiple of a
#: block size put two samples in one block at some lengths)
_POSITIONS = ("_saved_shifts", "_saved_start", "_saved_step", "_saved_index", "_saved_pad", "_saved_padding")


def _structure_attributes(node: Node) -> tuple[str, ...]:
    """The names of the dims `node`'s op works along, as saved for its backward (`flip(dims)`, `cumsum(dim)`,
    `transpose(dim0, dim1)`, `cat(dim)`, `sum(dim, keepdim)`...), of the flags it saved (`batch_norm(training)`:
    batch statistics mix samples, running ones do not) and of the positions it saved (`_POSITIONS`): a step that
    flips, sums or concatenates along another dim with the same ops, runs one in another mode, or rolls or slices
    the batch by another offset, is another structure. Not the op's sizes (a slice's end, a split's size: a new
    structure on every sequence length). Saved tensors (those with a `_raw_saved_` twin) are not unpacked: that
    would copy them back from the host or recompute a checkpointed region, and fail once one is modified in place."""
    attributes = dir(node)
    tensors = {a.removeprefix("_raw") for a in attributes if a.startswith("_raw_saved_")}
    saved = {a: getattr(node, a) for a in attributes if a.startswith("_saved_") and a not in tensors}
    names = tuple(
        a
        for a, value in saved.items()
        if not isinstance(value, Tensor) and ("dim" in a or isinstance(value, bool) or a in _POSITIONS)
    )
    _STRUCTURE_ATTRIBUTES[type(node)] = names
    opaque = isinstance(node, torch.autograd.function.BackwardCFunction)  # (a custom Function: what it does is unseen)
    sized = any("size" in a or "shape" in a for a in saved)
    if names or opaque or sized:
        _SIZED.add(type(node))
    if sized or opaque:
        _RESHAPING.add(type(node))
    return names
