"""The norm pass: the gradient of the summed loss at every rule site call's outputs, in one autograd pass that
computes no parameter gradient (all at once, or streamed call by call as autograd computes them), and each site's
rule turning one call's output gradients into per-sample gradients."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.plan import Site
from flashdp._pipeline.recorder import Call
from flashdp.errors import FlashDPError
from flashdp.per_sample import LayerCall, PerSampleGrad, accumulation_dtype

#: per call, the gradient at each of its output edges (None where it does not reach the loss)
OutputGrads = tuple[Tensor | None, ...]


def output_gradients(
    loss: Tensor, calls: Sequence[Call], retain_graph: bool, reach: Sequence[GradientEdge] = ()
) -> list[OutputGrads]:
    """`d sum(loss) / d output` of every output of every call, through the uses of the output outside the call
    (see `_outside_gradients`). Autograd runs the ops on the way to `reach` too (their gradients are dropped):
    the frontiers of parameters counted where they meet the batch, whose hooks take those."""
    feeding = [_feeding_outputs(call) for call in calls]
    with torch.enable_grad():
        total = loss.sum()
    grads = torch.autograd.grad(
        total,
        [e for c in calls for e in c.edges] + list(reach),
        retain_graph=retain_graph or any(feeding),
        allow_unused=True,
    )
    out, start = [], 0
    for call, feeds in zip(calls, feeding, strict=True):
        call_grads = grads[start : start + len(call.edges)]
        out.append(_outside_gradients(call, call_grads, feeds) if feeds else tuple(call_grads))
        start += len(call.edges)
    return out


def stream_output_gradients(
    graph: LossGraph,
    calls: list[Call],
    receive: Callable[[int, OutputGrads], None],
    held: Collection[int],
    retain_graph: bool,
    prepare: Callable[[int], None] = lambda index: None,
    reach: Sequence[GradientEdge] = (),
) -> None:
    """`output_gradients` of `graph.loss`, handed to `receive(index, grads)` call by call; each gradient of a
    one-output call not in `held` is handed over as autograd computes it and lives no longer than in a plain
    backward.

    Autograd keeps every gradient it is asked for until the pass ends. So only the gradients at the bottom of the
    graph are asked for: those of `held` calls, and of calls below which no other call's output lies. Every other
    call's output is on the way to one of those, so autograd runs its node, and a pre-hook on that node takes the
    gradient flowing in. `calls` is emptied: this function keeps only the edges of the calls it does not ask
    autograd about (whoever receives a call's gradients holds the call). `prepare(index)` runs for each asked
    call as the pass begins, before any of the graph is freed (to unpack its inputs: `Call.unpacked`). `reach`: see
    `output_gradients`."""
    loss = graph.loss
    above = graph.above({(e.node, e.output_nr) for c in calls for e in c.edges})
    single = {
        i: c.edges[0] for i, c in enumerate(calls) if i not in held and len(c.edges) == 1 and c.edges[0].node in above
    }
    asked = {i: c for i, c in enumerate(calls) if i not in single}
    calls.clear()
    hooked: dict[Node, list[tuple[int, int]]] = {}  # node -> (output_nr, call index)
    for index, edge in single.items():
        hooked.setdefault(edge.node, []).append((edge.output_nr, index))
    packed = [i for i, call in asked.items() if call.packed]
    handles = [loss.grad_fn.register_prehook(_Once(lambda: [prepare(i) for i in packed]))] if packed else []
    handovers = [_Handover(slots, receive) for slots in hooked.values()]
    handles += [node.register_prehook(h) for node, h in zip(hooked, handovers, strict=True)]
    try:
        grads = output_gradients(loss, list(asked.values()), retain_graph, reach)
    finally:
        for handle in handles:
            handle.remove()
    for index, call_grads in zip(asked, grads, strict=True):
        receive(index, call_grads)
    for handover in handovers:
        if not handover.ran:  # (autograd runs a node on the way to an asked gradient unless none flows into it)
            for _, index in handover.slots:
                receive(index, (None,))


class _Once:
    """A pre-hook that runs `action` the first time its node runs."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.action, self.ran = action, False

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        if not self.ran:
            self.ran = True
            self.action()


class _Handover:
    """A pre-hook on one node: hands the gradient flowing into each recorded output of the node to its call."""

    def __init__(self, slots: list[tuple[int, int]], receive: Callable[[int, OutputGrads], None]) -> None:
        self.slots, self.receive, self.ran = slots, receive, False

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:
        if self.ran:  # a later pass over the same nodes (`_outside_gradients` for the held calls)
            return
        self.ran = True
        for output_nr, index in self.slots:
            self.receive(index, (grad_outputs[output_nr],))


def _feeding_outputs(call: Call) -> dict[int, list[int]]:
    """Output j -> the outputs k of the same call computed from it inside the call (HF attention returning its
    weights with the output computed from them). Found by walking the call's own graph, from each output back to
    the call's inputs."""
    if len(call.edges) < 2:
        return {}
    position = {(e.node, e.output_nr): j for j, e in enumerate(call.edges)}
    stop = {(e.node, e.output_nr) for e in call.input_edges}
    feeds: dict[int, list[int]] = {}
    for k, edge in enumerate(call.edges):
        seen = {(edge.node, edge.output_nr)}
        stack = [edge.node]
        while stack:
            node = stack.pop()
            for child in node.next_functions:
                if child[0] is None or child in seen or child in stop:
                    continue
                seen.add(child)
                j = position.get(child)
                if j is not None and j != k:
                    feeds.setdefault(j, []).append(k)
                stack.append(child[0])
    return feeds


def _outside_gradients(call: Call, totals: Sequence[Tensor | None], feeds: dict[int, list[int]]) -> OutputGrads:
    """Autograd's gradient at an output that other outputs of the call are computed from also counts the paths
    through them; a rule needs the gradient through the output's own uses outside the call. Outputs computed
    from others first: `outside_j = total_j - vjp_j(sum_k <output_k, outside_k>)` over the outputs k fed by j."""
    outside = list(totals)
    order = sorted(range(len(call.edges)), key=lambda j: call.edges[j].node._sequence_nr(), reverse=True)
    for j in order:
        fed = [k for k in feeds.get(j, ()) if outside[k] is not None]
        if not fed or totals[j] is None:
            continue
        with torch.enable_grad():
            (through,) = torch.autograd.grad(
                [call.edges[k] for k in fed],
                [call.edges[j]],
                [outside[k] for k in fed],
                retain_graph=True,
                allow_unused=True,
            )
        if through is not None:
            outside[j] = totals[j] - through
    return tuple(outside)


def batch_dims(site: Site, call: Call) -> tuple[int, ...]:
    """Per recorded output of a rule site's call, the dim its batch is in (0 unless the rule says otherwise:
    time-major recurrent and attention layers)."""
    rule, dims = site.match.rule, site.match.batch_dim  # (learnt for a position-wise layer called time-major)
    if dims is None:
        dims = rule.batch_dim(site.module) if rule.batch_dim else 0
    return tuple(dims if isinstance(dims, int) else dims[meta.slot] for meta in call.output_meta)


def check_call(
    site: Site, call: Call, grads: OutputGrads, index: int, batch: int, shared: Collection[tuple[int, int]]
) -> tuple[int, ...]:
    """One call whose outputs reach the loss was made on this batch, batch first (or shared across it). Returns
    its outputs' batch dims (`batch_dims`)."""
    dims = batch_dims(site, call)
    for j, (meta, grad, dim) in enumerate(zip(call.output_meta, grads, dims, strict=True)):
        if grad is not None and (index, j) not in shared:
            _check_batch(site, meta.shape[dim] if len(meta.shape) > dim else 1, batch)
    return dims


class Sharing(NamedTuple):
    """What of one call is shared across the batch."""

    #: output index -> the per-sample gradient `[B, *shape]` of an output shared across the batch
    outputs: dict[int, Tensor]
    #: `LayerCall.shared_inputs`, for a per-call rule
    inputs: frozenset[int]
    #: parameter name -> its per-sample gradient `[B, *shape]` (None where no gradient reached it), taken where it
    #: meets the batch (`broadcast_params`): the generic rule does not run where it has them all
    params: dict[str, Tensor | None]


def per_sample_gradients(
    site: Site, call: Call, grads: OutputGrads, batch: int, shared: Sharing, dims: tuple[int, ...]
) -> dict[str, PerSampleGrad]:
    """Per trainable parameter of a rule site, its per-sample gradient from one call (checked by `check_call`,
    which gave its outputs' batch `dims`)."""
    per_sample = _run_rule(site, call, grads, batch, shared, dims)
    missing = set(site.trainable) - set(per_sample)
    if missing:
        raise FlashDPError(
            f"Rule {site.match.rule.name} returned no per-sample gradient for {sorted(missing)} of layer {site.label}: "
            "the layer holds parameters its rule does not know, from which a forward pre-hook computes the weight it "
            "uses (as torch.nn.utils.prune does with weight_orig, and the legacy torch.nn.utils.weight_norm with "
            "weight_g and weight_v). Express that computation as a torch parametrization "
            "(torch.nn.utils.parametrizations.weight_norm; a pruning mask as a module multiplying the weight, with "
            "torch.nn.utils.parametrize.register_parametrization), or register a rule for the layer with "
            "flashdp.register_rule(...)."
        )
    return per_sample


def _run_rule(
    site: Site, call: Call, grads: OutputGrads, batch: int, sharing: Sharing, dims: tuple[int, ...]
) -> dict[str, PerSampleGrad]:
    """The site's rule on one call. An output shared across the batch brings its per-sample gradient
    `[B, *shape]`; a simple rule then sees B copies of the call's inputs."""
    rule, shared = site.match.rule, sharing.outputs
    if sharing.params and set(site.trainable) <= set(sharing.params):
        return {name: _captured(sharing.params[name], call, name, batch) for name in site.trainable}
    rows = _rows_per_sample(call, dims, batch, shared)
    if not rule.per_call:
        inputs, shape = call.inputs, call.output_meta[0].shape
        grad_output = _scaled(grads[0] if grads[0].shape == shape else grads[0].view(shape), site.match.output_scale)
        if 0 in shared:
            grad_output, inputs = _as_batch(_scaled(shared[0], site.match.output_scale), shape, inputs, batch)
        elif rows > 1:  # B * k rows: as [B, k, ...]
            grad_output, inputs = _unfold_rows(grad_output, batch), tuple(_unfold_rows(x, batch) for x in inputs)
        elif site.match.batch_dim:  # a position-wise layer called with the batch in another dim: moved to dim 0
            dim = site.match.batch_dim
            grad_output, inputs = grad_output.movedim(dim, 0), tuple(_batch_first(x, dim, batch) for x in inputs)
        return rule.per_sample_grads(call.module, inputs, grad_output, frozenset(site.trainable))
    if call.rerun_refusal is not None:
        raise call.rerun_refusal
    params = {name: call.to_run_with(name) for name in site.trainable}
    layer_call = LayerCall(
        module=call.module,
        args=call.args,
        kwargs=call.kwargs,
        outputs=call.outputs,
        output_meta=call.output_meta,
        grad_outputs=tuple(shared.get(j, g) for j, g in enumerate(grads)),
        shared=tuple(j in shared for j in range(len(grads))),
        params=params,
        batch_size=batch,
        rows_per_sample=rows,
        autocast=call.autocast,
        default_device=call.default_device,
        rng_state=call.rng_state,
        frozen=call.frozen,
        label=site.label,
        shared_inputs=sharing.inputs,
    )
    return rule.per_sample_grads(layer_call)


def _captured(per_sample: Tensor | None, call: Call, name: str, batch: int) -> Tensor:
    """A parameter's per-sample gradient taken where it meets the batch, in the accumulation dtype; zeros where no
    gradient reached it on this pass."""
    if per_sample is None:
        param = call.parameter(name)
        return param.new_zeros(batch, *param.shape, dtype=accumulation_dtype(param))
    return per_sample.to(accumulation_dtype(per_sample))


def _rows_per_sample(call: Call, dims: tuple[int, ...], batch: int, shared: dict[int, Tensor]) -> int:
    """k when the call's batch outputs have B * k rows (a batch folded into rows, k per sample, sample-major: the
    batch-independence check verifies it on every new forward structure), else 1."""
    sizes = {
        meta.shape[dim]
        for j, (meta, dim) in enumerate(zip(call.output_meta, dims, strict=True))
        if j not in shared and len(meta.shape) > dim
    }
    return max(sizes, default=batch) // batch if batch else 1


def _scaled(grad: Tensor, scale: float) -> Tensor:
    """The output gradient a rule sees for a module computing `scale` times its forward (no copy when 1)."""
    return grad if scale == 1.0 else grad * scale


def _batch_first(x: object, dim: int, batch: int) -> object:
    if isinstance(x, Tensor) and x.dim() > dim and x.shape[dim] == batch:
        return x.movedim(dim, 0)
    return x


def _unfold_rows(x: object, batch: int) -> object:
    if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] % batch == 0 and x.shape[0] > batch:
        return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])
    return x


def _as_batch(per_sample: Tensor, shape: torch.Size, inputs: tuple, batch: int) -> tuple[Tensor, tuple]:
    """A shared output's per-sample gradient as a batch `[B, ...]` of outputs, and the inputs as B copies."""
    if shape and shape[0] == 1:  # called on a batch of 1: its dim 0 becomes the batch
        grad = per_sample.view(batch, *shape[1:])
        copies = tuple(x.expand(batch, *x.shape[1:]) if _unit_batch(x) else x for x in inputs)
    else:  # no batch dim at all: a new one
        grad = per_sample
        copies = tuple(x.expand(batch, *x.shape) if isinstance(x, Tensor) else x for x in inputs)
    return grad, copies


def _unit_batch(x: object) -> bool:
    return isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == 1


def _check_batch(site: Site, size: int, batch: int) -> None:
    if size == 1 and batch > 1:
        raise FlashDPError(
            f"Layer {site.label} was called on a batch of 1 while the loss has {batch} samples: its output "
            "was shared across the batch by broadcasting (e.g. position embeddings looked up with "
            "position_ids of shape [1, T]), so autograd only sees the gradient summed over samples. Give it "
            "each sample's own input (for HF models: position_ids=torch.arange(T).expand(B, T)) or freeze it."
        )
    if batch and size % batch:  # (B * k rows, k per sample, are a batch folded into rows: checked as rows)
        raise batch_mismatch_error(site.label, size, batch)


def batch_mismatch_error(label: str, size: int, batch: int) -> FlashDPError:
    return FlashDPError(
        f"Batch size mismatch: the loss has {batch} per-sample values, but layer {label} was called on a batch "
        f"of {size} (its output's batch dim). flashdp needs the batch as the first dim of every layer's input and "
        "output (or B * k rows, k per sample), and one loss per sample."
    )
