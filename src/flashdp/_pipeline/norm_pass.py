"""The norm pass: the gradient of the summed loss at every rule site call's outputs, in one autograd pass that
computes no parameter gradient, turned by each site's rule into per-sample gradients collected per parameter."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

import torch
from torch import Tensor

from flashdp._pipeline.param_grad import ParamGradient, StrategyChoice
from flashdp._pipeline.params import TrainableParam, attribute
from flashdp._pipeline.recorder import Call
from flashdp._pipeline.scan import GradientPlan, Site
from flashdp.errors import FlashDPError
from flashdp.per_sample import LayerCall, PerSampleGrad

#: per call, the gradient at each of its output edges (None where it does not reach the loss)
OutputGrads = tuple[Tensor | None, ...]
#: (call index, output index) -> the per-sample gradient `[B, *shape]` of an output shared across the batch
SharedGrads = dict[tuple[int, int], Tensor]


def output_gradients(loss: Tensor, calls: Sequence[Call], retain_graph: bool) -> list[OutputGrads]:
    """`d sum(loss) / d output` of every output of every call, through the uses of the output outside the call
    (see `_outside_gradients`)."""
    feeding = [_feeding_outputs(call) for call in calls]
    with torch.enable_grad():
        total = loss.sum()
    grads = torch.autograd.grad(
        total,
        [e for c in calls for e in c.edges],
        retain_graph=retain_graph or any(feeding),
        allow_unused=True,
    )
    out, start = [], 0
    for call, feeds in zip(calls, feeding, strict=True):
        call_grads = grads[start : start + len(call.edges)]
        out.append(_outside_gradients(call, call_grads, feeds) if feeds else tuple(call_grads))
        start += len(call.edges)
    return out


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


def check_calls(
    plan: GradientPlan,
    calls: Sequence[Call],
    output_grads: Sequence[OutputGrads],
    batch: int,
    shared: Collection[tuple[int, int]] = (),
) -> None:
    """Each call whose outputs reach the loss was made on this batch, batch first (or shared across it), and its
    gradient is visible."""
    for index, (call, grads) in enumerate(zip(calls, output_grads, strict=True)):
        site = plan.site(call.module)
        if all(g is None for g in grads):
            if call.modified_in_place():
                raise call.hidden_by_in_place_error(site.label)
            continue
        dims = batch_dims(site, call)
        for j, (meta, grad, dim) in enumerate(zip(call.output_meta, grads, dims, strict=True)):
            if grad is not None and (index, j) not in shared:
                _check_batch(site, meta.shape[dim] if len(meta.shape) > dim else 1, batch)


def per_param_gradients(
    plan: GradientPlan,
    calls: Sequence[Call],
    output_grads: Sequence[OutputGrads],
    batch: int,
    strategy: StrategyChoice,
    shared: SharedGrads | None = None,
) -> list[tuple[TrainableParam, ParamGradient]]:
    """Every trainable parameter reached by the loss, with its per-sample contributions from every call (checked
    by `check_calls`)."""
    by_param: dict[Hashable, tuple[TrainableParam, ParamGradient]] = {}
    for index, (call, grads) in enumerate(zip(calls, output_grads, strict=True)):
        if all(g is None for g in grads):
            continue  # this call's outputs do not reach the loss
        site = plan.site(call.module)
        params = [plan.param_of[(id(call.module), name)] for name in site.trainable]
        mine = {j: g for (i, j), g in (shared or {}).items() if i == index}
        if batch == 0:  # a rank without samples this step: nothing to add, but the same parameters as others
            per_sample = {n: grads[0].new_zeros(0, *p.shape) for n, p in zip(site.trainable, params, strict=True)}
        else:
            per_sample = _run_rule(site, call, grads, batch, mine)
        missing = set(site.trainable) - set(per_sample)
        if missing:
            raise FlashDPError(
                f"Rule {site.match.rule.name} returned no per-sample gradient for {sorted(missing)} of layer "
                f"{site.label}."
            )
        for name, param in zip(site.trainable, params, strict=True):
            if param.key not in by_param:
                by_param[param.key] = (param, ParamGradient(param.name, param.shape, batch, strategy))
            by_param[param.key][1].add(per_sample[name], site.label, generic=site.is_generic)
    if not by_param:
        raise FlashDPError(
            "The loss does not depend on any trainable layer recorded in the last forward pass: compute the "
            "per-sample losses from this model's output."
        )
    return list(by_param.values())


def _run_rule(
    site: Site, call: Call, grads: OutputGrads, batch: int, shared: dict[int, Tensor]
) -> dict[str, PerSampleGrad]:
    """The site's rule on one call. An output shared across the batch brings its per-sample gradient
    `[B, *shape]`; a simple rule then sees B copies of the call's inputs."""
    rule = site.match.rule
    rows = _rows_per_sample(call, site, batch, shared)
    if not rule.per_call:
        inputs, shape = call.inputs, call.output_meta[0].shape
        grad_output = _scaled(grads[0].view(shape), site.match.output_scale)
        if 0 in shared:
            grad_output, inputs = _as_batch(_scaled(shared[0], site.match.output_scale), shape, inputs, batch)
        elif rows > 1:  # B * k rows: as [B, k, ...]
            grad_output, inputs = _unfold_rows(grad_output, batch), tuple(_unfold_rows(x, batch) for x in inputs)
        elif site.match.batch_dim:  # a position-wise layer called with the batch in another dim: moved to dim 0
            dim = site.match.batch_dim
            grad_output, inputs = grad_output.movedim(dim, 0), tuple(_batch_first(x, dim, batch) for x in inputs)
        return rule.per_sample_grads(call.module, inputs, grad_output, frozenset(site.trainable))
    params = {
        name: call.params[name] if name in call.params else attribute(call.module, name) for name in site.trainable
    }
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
        rng_state=call.rng_state,
        frozen=call.frozen,
        label=site.label,
    )
    return rule.per_sample_grads(layer_call)


def _rows_per_sample(call: Call, site: Site, batch: int, shared: dict[int, Tensor]) -> int:
    """k when the call's batch outputs have B * k rows (a batch folded into rows, k per sample, sample-major: the
    batch-independence check verifies it on every new forward structure), else 1."""
    sizes = {
        meta.shape[dim]
        for j, (meta, dim) in enumerate(zip(call.output_meta, batch_dims(site, call), strict=True))
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
