"""Shared outputs: a layer called without the batch whose output a later op broadcasts over it (GPT-2, BERT or
CLIP position embeddings looked up with ids `[1, T]`, Whisper's decoder positions `[T, d]`, T5's relative
attention bias `[q_len, k_len, heads]`) gets exact per-sample gradients, with no change to the model's code.

Autograd only sees such an output's gradient summed over the samples. Each sample's own gradient is the vjp,
with that sample's rows of the cotangent alone, through the *frontier*: the first ops on the way to the loss
whose output carries the batch that the shared tensor does not (told apart by shape: the shared tensor lacks the
batch dim or has it at size 1). The norm pass runs with a pre-hook on each frontier node that takes the gradient
flowing in, `[B, ...]`, and turns it into `[B, *shared shape]`: through the frontier op alone, into its input on
the shared side (for an addition by summing each sample's rows; for any other op by applying the op's backward
to each sample's rows), then through the batch-free ops between that input and the shared tensor, for all
samples at once. Only the frontier's shared-side input is followed: its other inputs may reach the shared tensor
through earlier frontiers (T5's bias, added in every layer), whose own hooks count those paths. The layer's rule
then sees B copies of its inputs, each with its own output gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import CheckpointError

from flashdp.errors import FlashDPError

#: how far above a shared output its frontier may be (shape ops and the like in between)
MAX_DEPTH = 16
#: ops whose backward into each input is the output's gradient summed to the input's shape (times a sign): an
#: addition, a subtraction, an expand
_ADDITIONS = {"AddBackward0": 1.0, "SubBackward0": -1.0, "ExpandBackward0": 1.0}


@dataclass(frozen=True)
class Frontier:
    """An op where the batch first appears above a shared tensor."""

    node: Node
    #: the index of its forward output that carries the batch
    output_nr: int
    #: its inputs (`next_functions` slots) on the shared side, and the edge they point to
    slots: tuple[int, ...]
    child: tuple[Node, int]


@dataclass
class SharedOutput:
    """One output of one call, shared across the batch, and its per-sample gradient once the norm pass ran."""

    edge: GradientEdge
    shape: torch.Size
    frontiers: list[Frontier]
    per_sample: Tensor | None = field(default=None, repr=False)
    #: a parameter that meets the batch by broadcast (`broadcast_params`), not an output
    parameter: bool = False


#: (node, output_nr) of the outputs known to be shared across the batch
SharedEdges = Collection[tuple[Node, int]]


def frontiers(
    edge: GradientEdge,
    graph: dict[Node, list[tuple[Node, int]]],
    batch: int,
    shared: SharedEdges = frozenset(),
    parameter: bool = False,
) -> list[Frontier]:
    """Where the batch first appears above a shared tensor, on every path to the loss; [] if it does not reach the
    loss or some path gets there without meeting the batch (then it is not shared but mis-shaped). `shared`: the
    other outputs shared across the batch, which an op adding them to this one does not make a batch of.
    `parameter`: the edge is a parameter's, whose elements a slice may cut to any size (`pos[:, :T]` of a table
    of 2 B positions is no sum over samples; `broadcast_params` accepts only such maps below a frontier)."""
    return outside_frontiers(edge, graph, batch, shared=shared, parameter=parameter) or []


def outside_frontiers(
    edge: GradientEdge,
    graph: dict[Node, list[tuple[Node, int]]],
    batch: int,
    inside: Collection[Node] = frozenset(),
    others: Collection[tuple[Node, int]] = frozenset(),
    shared: SharedEdges = frozenset(),
    parameter: bool = False,
) -> list[Frontier] | None:
    """`frontiers` of one output of a call, through its uses outside the call: not on the paths inside the call
    to its `others` outputs (their own gradients count those paths, through the call's rule), so neither past one
    of their edges nor at a frontier among the `inside` nodes (the call's part of the graph below them). [] where
    every path to the loss is such a path (the output's own gradient is then nothing); None where it does not reach
    the loss or some path gets there without meeting the batch."""
    found: list[Frontier] = []
    pending = [(edge.node, edge.output_nr, 0)]
    seen: set[tuple[Node, int]] = set()
    while pending:
        node, output_nr, depth = pending.pop()
        if (node, output_nr) in seen:
            continue
        seen.add((node, output_nr))
        if depth and (node, output_nr) in others:
            continue
        ours = node._input_metadata[output_nr].shape
        consumers = [(p, s) for p, s in graph.get(node, ()) if p.next_functions[s][1] == output_nr]
        if not consumers or depth >= MAX_DEPTH:
            return None  # the loss itself, or too far up
        for consumer, _ in consumers:
            carrying = [j for j, m in enumerate(consumer._input_metadata) if _introduces_batch(ours, m.shape, batch)]
            slots = tuple(s for s, child in enumerate(consumer.next_functions) if child == (node, output_nr))
            if len(carrying) > 1:
                return None  # (an op of several outputs with the batch: each sample's part is taken through one)
            if carrying and _broadcasts(consumer, slots, consumer._input_metadata[carrying[0]].shape, batch, shared):
                if consumer not in inside:
                    found.append(Frontier(consumer, carrying[0], slots, (node, output_nr)))
            elif not parameter and any(_merges_batch_sized(ours, m.shape, batch) for m in consumer._input_metadata):
                return None  # (rows of samples mixed, then broadcast: not shared, a loss mixing the samples)
            else:
                pending += [(consumer, j, depth + 1) for j in range(len(consumer._input_metadata))]
    return list(dict.fromkeys(found))


#: how many autograd nodes below a shared output's inputs are walked for rows of samples (`computed_from`); a
#: table shared across the batch is computed from parameters and positions in a few ops
MAX_PROVENANCE = 4096


def computed_from(starts: Iterable[Node], nodes: Collection[Node], is_data: Callable[[Tensor], bool]) -> bool:
    """Whether what the autograd nodes `starts` compute was computed from the output of one of `nodes` (or is one),
    from a leaf that `is_data` (a tensor requiring grad that is no parameter: the data made to require it), or from
    more ops than `MAX_PROVENANCE` (taken as such: no shared table is)."""
    pending = list(starts)
    seen: set[Node] = set()
    while pending:
        node = pending.pop()
        if node in nodes or len(seen) > MAX_PROVENANCE or is_data(getattr(node, "variable", None)):
            return True
        if node not in seen:
            seen.add(node)
            pending.extend(child for child, _ in node.next_functions if child is not None)
    return False


def shared_inputs(
    call_inputs: Sequence, shared: Collection[Node], batched: Collection[Node], batch: int
) -> frozenset[int]:
    """The indices of a call's tensor inputs (flattened, `call_inputs`) whose size looks like rows of samples (a
    multiple of B in dim 0) but that are computed from outputs shared across the batch (`shared`: their nodes) and
    parameters alone, reaching no output with the batch nor a shared output's frontier (`batched`: `x + table`
    with untracked data `x` is per sample) nor a leaf that is no parameter (DeBERTa's
    relative embeddings `[2 k, d]` with 2 k == B, a relative bias `[H, T, T]` with H == B, given to a layer); and
    the parameters given as inputs, or a view of one (`table[:T]` with T == B)."""
    return frozenset(
        i
        for i, x in enumerate(call_inputs)
        if isinstance(x, Tensor)
        and x.dim() > 0
        and x.shape[0] % batch == 0
        and (
            isinstance(x, torch.nn.Parameter)
            or _parameter_view(x.grad_fn)
            or (bool(shared) and x.grad_fn is not None and _from_shared_alone(x.grad_fn, shared, batched))
        )
    )


#: ops that take one tensor and move its elements or map each one alone (positions and sizes saved, no other
#: tensor): what they compute from a parameter is that parameter's elements, or a function of each (an op with
#: another input, even one untracked by autograd, may bring the batch's data in: `x @ w` with data `x` shows only
#: `w` in the graph; so may `table * 2.0`, whose number autograd records as such an input). Not an expand: a
#: parameter expanded to B rows is a batch of copies, one per sample.
ONE_INPUT_MAPS = frozenset(
    {
        *("SliceBackward0", "SelectBackward0", "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0"),
        *("PermuteBackward0", "TBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1"),
        *("CloneBackward0", "ToCopyBackward0", "TanhBackward0", "SigmoidBackward0", "ExpBackward0"),
        *("NegBackward0", "ReluBackward0", "GeluBackward0", "SiluBackward0"),
    }
)


def _parameter_view(node: Node | None) -> bool:
    """Whether `node` computes its output from one parameter through `ONE_INPUT_MAPS` alone (`table[:T]`,
    `table[:T].tanh()`)."""
    for _ in range(MAX_DEPTH):
        if node is None:
            return False
        variable = getattr(node, "variable", None)
        if variable is not None:
            return isinstance(variable, torch.nn.Parameter)
        tracked = [child for child, _ in node.next_functions if child is not None]
        if node.name() not in ONE_INPUT_MAPS or len(tracked) != 1:
            return False
        node = tracked[0]
    return False


def _from_shared_alone(start: Node, shared: Collection[Node], batched: Collection[Node]) -> bool:
    """Whether the graph below `start` reaches a shared output's node, and no batch output's nor a leaf that is no
    parameter within `MAX_PROVENANCE` nodes (not descending past the shared outputs)."""
    pending, seen, reached = [start], set(), False
    while pending:
        node = pending.pop()
        if node in batched or len(seen) > MAX_PROVENANCE:
            return False
        if node in shared:
            reached = True
            continue
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and not isinstance(variable, torch.nn.Parameter):
            return False  # (a leaf requiring grad that is no parameter: data made to require it)
        pending.extend(child for child, _ in node.next_functions if child is not None)
    return reached


def _merges_batch_sized(ours: torch.Size, theirs: torch.Size, batch: int) -> bool:
    """Whether an op from `ours` to `theirs` leaves fewer dims whose size is a multiple of the batch: a sum, mean,
    index or product over such a dim, on the way from an output to where the batch appears above it. A shared
    tensor whose dims are B by chance (positions, T == B) keeps them up to the broadcast; a batch's rows reduced
    and broadcast again are no shared tensor: each loss row then reads every sample (a per-sample loss taken as
    `loss.mean().expand(B)`, a layer's outputs averaged over the batch and added to every sample's: breakers'
    cases clipped the whole batch's gradient once per row)."""
    return batch > 1 and _batch_sized(theirs, batch) < _batch_sized(ours, batch)


def _batch_sized(shape: torch.Size, batch: int) -> int:
    return sum(1 for size in shape if size >= batch and size % batch == 0)


def _introduces_batch(ours: torch.Size, theirs: torch.Size, batch: int) -> bool:
    """Whether `theirs` is `ours` broadcast to the batch: aligned to the right, every dim of ours equal to theirs
    or 1, and theirs' dim 0 the batch where ours has no dim or one of size 1. (A reshape of B * T rows into
    [B, T] is no broadcast: its dims do not align.) Only where dim 0 is the one dim of size B that ours lacks:
    a row `[1, H]` written into a time-major `[T, B, H]` with T == B (a packed RNN's last steps) is one sample's,
    not shared, and sizes alone cannot tell which of the two dims is the batch."""
    if len(theirs) == 0 or theirs[0] != batch or len(ours) > len(theirs):
        return False
    offset = len(theirs) - len(ours)
    if any(o not in (1, t) for o, t in zip(ours, theirs[offset:], strict=True)):
        return False
    grown = [d for d in range(len(theirs)) if d < offset or (ours[d - offset] == 1 and theirs[d] != 1)]
    return 0 in grown and sum(theirs[d] == batch for d in grown) == 1


def _broadcasts(
    consumer: Node, slots: tuple[int, ...], theirs: torch.Size, batch: int, shared: SharedEdges = frozenset()
) -> bool:
    """Whether the op can be a broadcast of its input at `slots` over the batch of its output `theirs`: it takes
    that input alone (an expand, a repeat), or another input may carry the batch (an addition to the tokens'
    embeddings). Not a stack or a concatenation of tensors shaped alike, none with the batch (layers' states
    stacked into `[L, B, H]` with L == B: the new dim is the layers, and the batch is in theirs already), nor
    anything whose other inputs are all known and batch-free: `shared` outputs among them (a position table `[T,
    d]` with T == B plus a kind table `[1, d]` is no batch). An input that needs no gradient is not seen (no
    edge): it may carry the batch."""
    others = [child for s, child in enumerate(consumer.next_functions) if s not in slots]
    if not others:
        return True
    for node, output_nr in others:
        if node is None:
            return True
        if _batch_free(node, output_nr, shared):
            continue
        shape = node._input_metadata[output_nr].shape
        if len(shape) == len(theirs) and shape[0] == batch:
            return True
    return False


#: ops that compute elementwise, or move elements, from the tensors autograd tracks as their inputs and nothing
#: else (an index or an embedding lookup takes untracked ids, which may be the batch's: not among them)
_ELEMENTWISE = frozenset(
    {
        *("AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "NegBackward0", "CatBackward0"),
        *("TanhBackward0", "SigmoidBackward0", "ExpBackward0", "ReluBackward0", "GeluBackward0", "SiluBackward0"),
        *("CloneBackward0", "ToCopyBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0"),
    }
)


def _batch_free(node: Node, output_nr: int, shared: SharedEdges, depth: int = 0) -> bool:
    """Whether an op's input is computed from `shared` outputs and parameters alone (`tanh(table)`, `table * kind`,
    `table * 2.0`): through `_ELEMENTWISE` ops every input of which autograd tracks but scalars (an untracked
    tensor of rows may be the batch's data: `table * x`), of the same number of dims."""
    if (node, output_nr) in shared:
        return True
    variable = getattr(node, "variable", None)
    if variable is not None:
        return isinstance(variable, torch.nn.Parameter)
    if depth >= MAX_DEPTH or not shared or node.name() not in _ELEMENTWISE or not _untracked_scalars(node):
        return False
    rank = len(node._input_metadata[output_nr].shape)
    return all(
        child is None or (len(child._input_metadata[nr].shape) == rank and _batch_free(child, nr, shared, depth + 1))
        for child, nr in node.next_functions
    )


#: (op, input slot) -> the saved tensor that is that input, where the op saves it for its other input's gradient
_SAVED_INPUTS = {("MulBackward0", 0): "self", ("MulBackward0", 1): "other", ("DivBackward0", 1): "other"}


def _untracked_scalars(node: Node) -> bool:
    """Whether every input of `node` that autograd does not track is a scalar it saved (`table * 2.0`, `table /
    scale`: no rows of samples; autograd records a Python number as such a tensor). One saved through hooks is not
    unpacked (an activation checkpoint would recompute its region): taken as rows."""
    for slot, (child, _) in enumerate(node.next_functions):
        if child is not None:
            continue
        name = _SAVED_INPUTS.get((node.name(), slot))
        if name is None or getattr(node, f"_raw_saved_{name}").unpack_hook is not None:
            return False
        if getattr(node, f"_saved_{name}").numel() != 1:
            return False
    return True


#: whether a per-sample vjp of `_through` is running: autograd re-enters the frontier nodes' hooks (this module's,
#: and the verifying pass's `FrontierRows`, which must not sketch its batched gradients)
_IN_VJP = [False]


def in_per_sample_vjp() -> bool:
    return _IN_VJP[0]


@contextlib.contextmanager
def capturing_per_sample_gradients(shared: list[SharedOutput], batch: int) -> Iterator[None]:
    """While active (around the norm pass), fill each shared output's `per_sample` `[B, *shape]`. Each frontier
    counts once: the first time its node runs, in the pass's own backward (a parameter's frontier inside its call
    runs again where `norm_pass._outside_gradients` takes the call's outputs apart)."""
    busy = _IN_VJP  # the vjps below re-enter autograd through the same frontier nodes
    handles, taken = [], set()
    for output in shared:
        output.per_sample = None
        for frontier in output.frontiers:

            def hook(grad_outputs, output=output, frontier=frontier):
                if busy[0] or grad_outputs[frontier.output_nr] is None or (id(output), frontier) in taken:
                    return
                taken.add((id(output), frontier))
                busy[0] = True
                try:
                    part = _through(frontier, grad_outputs, output, batch)
                    output.per_sample = part if output.per_sample is None else output.per_sample + part
                finally:
                    busy[0] = False

            handles.append(frontier.node.register_prehook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _through(frontier: Frontier, grad_outputs: tuple, output: SharedOutput, batch: int) -> Tensor:
    """`[B, *shape]`: each sample's part of the frontier's output gradient `[B, ...]`, taken back through the
    frontier's shared-side input alone, then to the shared tensor (to its recorded edge, which for an output that
    is a reshape of an internal tensor is that tensor's: BEiT's `bias.unsqueeze(0)` of `[h, T, T]`)."""
    node, grad = frontier.node, grad_outputs[frontier.output_nr]
    child_shape = frontier.child[0]._input_metadata[frontier.child[1]].shape
    sign = _ADDITIONS.get(node.name())
    if sign is not None:  # an addition: each sample's gradient is its rows, summed to the input's shape
        alpha = float(getattr(node, "_saved_alpha", 1.0))
        scale = sum(1.0 if slot == 0 else sign * alpha for slot in frontier.slots)
        at_child = scale * _sum_to(grad, child_shape, batch)
    else:  # a product, a layer norm's affine: in one op; any other op: its backward on each sample's rows alone
        try:
            product = _rows_in_one_op(frontier, grad)
            at_child = (
                _sum_to(product, child_shape, batch)
                if product is not None
                else torch.stack(
                    [_local_backward(frontier, grad_outputs, i).sum_to_size(child_shape) for i in range(batch)]
                )
            )
        except CheckpointError as error:
            raise _checkpointed_frontier_error(node) from error
    if frontier.child == (output.edge.node, output.edge.output_nr):
        return at_child.reshape(batch, *output.shape)
    (per_sample,) = torch.autograd.grad(
        [GradientEdge(*frontier.child)], [output.edge], [at_child], retain_graph=True, is_grads_batched=True
    )
    return per_sample.reshape(batch, *output.shape)


#: the frontier ops whose backward into their shared side is taken for all samples in one op, by shared slot, with
#: the tensors it saved that this reads: an addition's or an expand's nothing (each sample's rows summed, in
#: `_through`), a product's other factor (`grad * b` for `a * b` with the shared `a`), a layer norm's weight its
#: normalised input (from its input, mean and 1 / std), its bias nothing. Any other op or slot runs its backward
#: once per sample.
_ONE_OP_READS: dict[str, dict[int, tuple[str, ...]]] = {
    "AddBackward0": {0: (), 1: ()},
    "SubBackward0": {0: (), 1: ()},
    "ExpandBackward0": {0: ()},
    "MulBackward0": {0: ("other",), 1: ("self",)},
    "NativeLayerNormBackward0": {1: ("input", "result1", "result2"), 2: ()},
}


def in_one_op(frontier: Frontier) -> bool:
    """Whether each sample's part of the frontier's output gradient is taken back through it for all samples in one
    op (`_ONE_OP_READS`): an addition on any slots, another op on one, reading no tensor saved through hooks (an
    activation checkpoint's recomputation may be unpacked once: the node's own backward reads it after this)."""
    name, slots = frontier.node.name(), frontier.slots
    reads = _ONE_OP_READS.get(name, {})
    if name in _ADDITIONS:
        return all(slot in reads for slot in slots)
    return len(slots) == 1 and slots[0] in reads and not _through_hooks(frontier.node, *reads[slots[0]])


def batch_side(frontier: Frontier) -> list[Node | None]:
    """The frontier op's inputs where the batch comes from (None: one autograd does not track): a layer norm's
    input (its weight and bias are affine); any other op's inputs off the shared side (none for an expand)."""
    inputs = frontier.node.next_functions
    if frontier.node.name() == "NativeLayerNormBackward0":
        return [inputs[0][0]]
    return [child for slot, (child, _) in enumerate(inputs) if slot not in frontier.slots]


def _rows_in_one_op(frontier: Frontier, grad: Tensor) -> Tensor | None:
    """The frontier op's backward into its shared side before the sum to its shape, `[B, ...]`, for all samples in
    one op instead of B runs of the node, for a product or a layer norm's affine (`in_one_op`); None for any other
    op (an addition's is its rows, in `_through`)."""
    node, name = frontier.node, frontier.node.name()
    if grad.is_complex() or name in _ADDITIONS or not in_one_op(frontier):
        return None
    slot = frontier.slots[0]
    if name == "MulBackward0":
        return grad * getattr(node, "_saved_other" if slot == 0 else "_saved_self")
    if slot == 2:  # (a layer norm's bias)
        return grad
    return grad * ((node._saved_input - node._saved_result1) * node._saved_result2)


def _through_hooks(node: Node, *saved: str) -> bool:
    return any(getattr(node, f"_raw_saved_{name}").unpack_hook is not None for name in saved)


def _local_backward(frontier: Frontier, grad_outputs: tuple, sample: int) -> Tensor:
    """The frontier op's backward on sample `sample`'s rows of its output gradient, summed over its shared-side
    inputs (not reduced to their shape)."""
    rows = []
    for nr, g in enumerate(grad_outputs):
        if g is None:
            meta = frontier.node._input_metadata[nr]
            g = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
        only = torch.zeros_like(g)
        only[sample] = g[sample] if nr == frontier.output_nr else 0
        rows.append(only)
    grads = frontier.node(*rows)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return sum(grads[slot] for slot in frontier.slots)


def _checkpointed_frontier_error(node: Node) -> FlashDPError:
    return FlashDPError(
        f"An output shared across the batch (a table computed without the batch dim) meets the batch through "
        f"{node.name()} inside an activation-checkpointed region (torch.utils.checkpoint, use_reentrant=False): "
        "flashdp takes each sample's gradient of it by running that op's backward once per sample, which would "
        "read the tensors the checkpoint recomputes more than once (the checkpoint allows one read; an addition "
        "reads none). Nothing was added to .grad. Compute the table and apply it outside the checkpointed function "
        "(pass the product in), add it instead of multiplying, or train without checkpointing that region."
    )


def _sum_to(grad: Tensor, shape: torch.Size, batch: int) -> Tensor:
    """`[B, *shape]`: per sample, `grad[i]` summed over the dims broadcasting added (aligned to the right)."""
    target = shape[1:] if len(shape) == grad.dim() else shape  # the shared tensor's dims past the batch's place
    rows = grad
    lead = rows.dim() - 1 - len(target)
    if lead > 0:
        rows = rows.sum(tuple(range(1, 1 + lead)))
    dims = tuple(1 + d for d, size in enumerate(target) if size == 1 and rows.shape[1 + d] != 1)
    if dims:
        rows = rows.sum(dims, keepdim=True)
    return rows.reshape(batch, *shape)
