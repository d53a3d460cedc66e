"""The generic rule: per-sample gradients of any module's parameters by `torch.func`, for modules without a rule of
their own, raw parameters on containers, and parameters a module's forward uses outside the layer that owns them.

For each sample i: the vjp of `functional_call(module, params, inputs_i)` against the gradient of the call's
outputs, where inputs_i is sample i's slice of every input whose dim 0 is the batch (kept as a batch of 1, so the
module's code sees the shapes it expects) and every other input is shared; vmapped over the batch. The outputs it
recomputes must equal the recorded ones (else the forward is random, stateful or not batch-first: refused).

Cost: one more forward and backward of the module, batched, and the per-sample gradients of the parameters it
counts, `[B, *shape]` each.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from flashdp.errors import FlashDPError, FlashDPWarning
from flashdp.per_sample import LayerCall, OutputMeta, accumulation_dtype
from flashdp.rules.recompute import as_in_the_forward, check_recomputed
from flashdp.rules.registry import Rule


def generic_grads(call: LayerCall) -> dict[str, Tensor]:
    """`[B, *shape]` per parameter by `torch.func`: a vmap of the vjp of the module's forward, sample by sample;
    costs one more forward and backward of the module and holds B gradients of its parameters.

    Returns `{name: [B, *shape]}` for every parameter in `call.params`."""
    batch, rows = call.batch_size, call.rows_per_sample
    leaves, spec = tree_flatten((call.args, call.kwargs))
    untracked = [i for i, x in enumerate(leaves) if _may_be_data(x, batch)]
    leaves = [x.detach() if isinstance(x, Tensor) else x for x in leaves]
    # (`.data`: the re-run's own version counters: a forward that writes to a parameter in place is refused here,
    # `_refuse_modified_params`, before autograd, holding the parameter, fails on its version in a later pass)
    params = {name: p.data for name, p in call.params.items()}
    # only the outputs that reach the loss: the others add nothing (and may mix samples, like CLIP's logits)
    used = [j for j, g in enumerate(call.grad_outputs) if g is not None]
    shared = tuple(bool(call.shared and call.shared[j]) for j in used)
    all_shared = bool(shared) and all(shared)
    output_slots = tuple(call.output_meta[j].slot for j in used)
    batched = [i for i in _inputs_by_sample(leaves, batch, rows, all_shared) if i not in call.shared_inputs]
    if all_shared and untracked:
        _refuse_reading_the_data(call, params, (leaves, spec), untracked, output_slots)
    cotangents = tuple(
        _cotangent(call.output_meta[j], call.grad_outputs[j], is_shared, batch)
        for j, is_shared in zip(used, shared, strict=True)
    )

    def one_sample(sample_inputs: tuple[Tensor, ...], sample_cotangents: tuple[Tensor, ...], pullback_of=vjp):
        inputs = list(leaves)
        for i, x in zip(batched, sample_inputs, strict=True):
            inputs[i] = x  # its rows: a batch of 1, or the k rows of a batch folded into rows
        args, kwargs = tree_unflatten(inputs, spec)

        outputs, pullback = pullback_of(lambda p: _outputs(call, p, (args, kwargs), output_slots), params)
        (grads,) = pullback(sample_cotangents)
        return grads, outputs

    per_sample_inputs = tuple(_by_sample(leaves[i], batch) for i in batched)
    versions = [p._version for p in params.values()]
    with as_in_the_forward(call), torch.enable_grad():
        grads, outputs = _each_sample(call, one_sample, per_sample_inputs, cotangents)
    _refuse_modified_params(call, params, versions)
    recorded = [call.outputs[j] for j in used]
    if any(r is None for r in recorded):  # a module first recorded only as an enclosing scope: no outputs kept
        recorded = _batch_outputs(call, params, tree_unflatten(leaves, spec), output_slots)
    _check_recomputed(call, recorded, outputs, shared)
    _refuse_unswapped_reads(call, outputs)
    return {name: g.to(accumulation_dtype(g)) for name, g in grads.items()}


#: what torch.func raises for a forward it cannot transform
_TRANSFORM_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


def _each_sample(call: LayerCall, one_sample: Callable, inputs: tuple[Tensor, ...], cotangents: tuple[Tensor, ...]):
    """`one_sample` over the samples (dim 0 of `inputs` and `cotangents`), its results stacked: one vmap, or, where
    vmap cannot run the forward (an op without a batching rule, such as `nn.GRU` with a per-sample initial state,
    boolean indexing, control flow on the values), one run per sample by plain autograd (`_runs_by_autograd`): the
    same function on the same rows, B times slower (warned)."""
    try:
        return vmap(one_sample, randomness="different")(inputs, cotangents)
    except _TRANSFORM_ERRORS as error:
        vmap_error = error
    try:
        runs = _runs_by_autograd(call, one_sample, inputs, cotangents)
    except FlashDPError:  # (a refusal of its own: a parameter read without the swap, an input written to)
        raise
    except _TRANSFORM_ERRORS as error:
        raise _vmap_error(call.label, vmap_error, error) from error
    warnings.warn(
        f"The generic rule re-runs {call.label} one sample at a time, B runs per backward: torch.func.vmap cannot "
        f"run its forward ({_said(vmap_error, 200)}). Register a rule for its type with flashdp.register_rule(...) "
        "for speed.",
        FlashDPWarning,
        stacklevel=2,
    )
    grads = {name: torch.stack([g[name] for g, _ in runs]) for name in runs[0][0]}
    outputs = tuple(torch.stack([o[j] for _, o in runs]) for j in range(len(runs[0][1])))
    return grads, outputs


def _runs_by_autograd(
    call: LayerCall, one_sample: Callable, inputs: tuple[Tensor, ...], cotangents: tuple[Tensor, ...]
) -> list[tuple[dict[str, Tensor], tuple[Tensor, ...]]]:
    """`one_sample` on each sample by plain autograd (cuDNN's RNNs, autograd.Functions without `setup_context` and
    checkpoints run under no torch.func transform), on copies of the sample's rows and of the module's buffers: a
    forward that writes to its input in place, or updates running statistics, writes to the copies, not to the
    recorded activations or the model's state (vmap refuses such writes). An input shared by the samples that the
    re-run writes to is refused."""
    pullback_of = functools.partial(_autograd_vjp, call, _state_copies(call))
    shared = [(t, t._version) for t in tree_leaves((call.args, call.kwargs)) if isinstance(t, Tensor)]
    runs = [
        one_sample(tuple(x[b].clone() for x in inputs), tuple(c[b] for c in cotangents), pullback_of=pullback_of)
        for b in range(cotangents[0].shape[0])
    ]
    if any(t._version != version for t, version in shared):
        raise FlashDPError(
            f"The forward of {call.label} writes to one of its inputs in place: flashdp's generic rule re-runs it "
            "one sample at a time and would write again. Nothing was added to .grad. Make that write out of place, "
            "or register a rule for the layer with flashdp.register_rule(...)."
        )
    return runs


def _autograd_vjp(
    call: LayerCall, state: dict[str, Tensor], forward: Callable, params: dict[str, Tensor]
) -> tuple[tuple[Tensor, ...], Callable]:
    """`torch.func.vjp(forward, params)` by plain autograd, for one sample's run with the module's tensors `state`:
    the outputs, detached, and the pullback of their cotangents to `({name: gradient},)` (zeros for a parameter
    the outputs do not read). A parameter read without the swap is refused (`_refuse_unswapped_reads`)."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    outputs = forward({**state, **leaves})
    _refuse_unswapped_reads(call, outputs)

    def pullback(cotangents: tuple[Tensor, ...]) -> tuple[dict[str, Tensor]]:
        read = [(o, c) for o, c in zip(outputs, cotangents, strict=True) if o.requires_grad]
        grads = (None,) * len(leaves)
        if read:
            grads = torch.autograd.grad(
                [o for o, _ in read], list(leaves.values()), [c for _, c in read], allow_unused=True
            )
        return ({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(leaves.items(), grads, strict=True)},)

    return tuple(o.detach() for o in outputs), pullback


def _batch_outputs(
    call: LayerCall, params: dict[str, Tensor], inputs: tuple[tuple, dict], slots: tuple[int, ...]
) -> list[Tensor]:
    """The module's outputs on the whole batch, recomputed: what the per-sample re-run is compared with where the
    forward kept none (a module that became a generic rule site on this backward, recorded as a scope). Without
    it, a module whose samples' outputs depend on each other (rows flipped over the batch) would be counted as
    if each ran alone, checked by nothing but the self-check's few samples. Run over copies of the module's buffers:
    a forward that updates them (running statistics) updates the copies."""
    with as_in_the_forward(call), torch.no_grad():
        return list(_outputs(call, {**_state_copies(call), **params}, inputs, slots))


def _state_copies(call: LayerCall) -> dict[str, Tensor]:
    """Copies of the module's buffers and frozen tensors, for a re-run that may write to them."""
    return {name: t.clone() for name, t in {**dict(call.module.named_buffers()), **call.frozen}.items()}


def _outputs(
    call: LayerCall, params: dict[str, Tensor], inputs: tuple[tuple, dict], slots: tuple[int, ...]
) -> tuple[Tensor, ...]:
    """The module's tensor outputs at `slots`, run with `params` over its frozen tensors."""
    args, kwargs = inputs
    out = functional_call(call.module, {**call.frozen, **params}, args, kwargs)
    out = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
    return tuple(out[slot] for slot in slots)


def _said(error: Exception, limit: int) -> str:
    """An error's type and the first `limit` characters of its first line, for a message that names it."""
    first = (str(error).splitlines() or [""])[0]  # (an error raised without a message has no line)
    return f"{type(error).__name__}: {first[:limit]}"


def _vmap_error(label: str, vmap_error: Exception, run_error: Exception) -> FlashDPError:
    return FlashDPError(
        f"The generic rule cannot compute per-sample gradients for {label}: torch.func.vmap cannot run its forward "
        f"one sample at a time ({_said(vmap_error, 300)}), nor can plain autograd on one sample's rows "
        f"({_said(run_error, 300)}): "
        "this happens with inputs that fold the batch into another dim, or a cache the forward updates (train "
        "with use_cache=False). Freeze its parameters, or register a rule for its type with "
        "flashdp.register_rule(...)."
    )


def _refuse_modified_params(call: LayerCall, params: dict[str, Tensor], versions: list[int]) -> None:
    """The re-run must not write to the parameters (it reads them through `.data`: their storage, their own version
    counters): a forward that writes to one in place (a weight clamped in the forward) writes again, behind the
    back of autograd, which holds the parameter for the rest of the backward."""
    changed = [name for (name, p), then in zip(params.items(), versions, strict=True) if p._version != then]
    if changed:
        raise FlashDPError(
            f"The forward of {call.label} modifies its parameters {changed} in place (a weight clamped or "
            "renormalised in the forward): flashdp's generic rule re-runs that forward to count the per-sample "
            "gradients, and would modify them again while autograd holds them. Nothing was added to .grad. Modify "
            "them outside the forward (under torch.no_grad() after each step), or register a rule for the layer "
            "with flashdp.register_rule(...)."
        )


def _refuse_unswapped_reads(call: LayerCall, outputs: tuple[Tensor, ...]) -> None:
    """The re-run must read the parameters it counts from the module, where `functional_call` swaps them for the
    copies whose vjp is taken. One it reads another way (held in a Python list or a closure, or a tensor cached
    from them on an earlier call) is the parameter itself in the re-run: its gradient is missing from the copies'
    (0 for a module returning `self.alias[0]`), silently. Such a read leaves the re-run's outputs with autograd
    history (outside torch.func's transforms) down to the parameter: walked here, only where an output has any
    (the outputs of a re-run reading only its copies, its detached inputs and frozen tensors have none)."""
    with_history = [t for t in outputs if t.grad_fn is not None]
    if not with_history:
        return
    read = {id(t): name for name, t in call.params.items() if t.requires_grad}
    nodes = {t.grad_fn: name for name, t in call.params.items() if t.requires_grad and t.grad_fn is not None}
    if not read:
        return
    seen: set[object] = set()
    pending = [t.grad_fn for t in with_history]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        name = nodes.get(node)
        if name is None and type(node) is _ACCUMULATOR:
            variable = node.variable
            name = read.get(id(variable))
            if name is not None and call.params[name] is not variable:
                name = None
        if name is not None:
            raise FlashDPError(
                f"The generic rule re-runs layer {call.label}'s forward with its parameters swapped for copies "
                f"(torch.func.functional_call), and the re-run read '{name}' without the swap: through a reference "
                "the swap cannot reach (a Python list, dict or closure holding it, or a tensor computed from it on an "
                "earlier call). Its per-sample gradient would be missing. Nothing was added to .grad. Read the "
                f"parameter from the module in forward (`self.{name.rpartition('.')[2]}`), or register a rule for "
                "the layer with flashdp.register_rule(...)."
            )
        pending.extend(child for child, _ in node.next_functions if child is not None)


#: the node of a leaf tensor that requires grad: its gradient accumulator
_ACCUMULATOR = torch._C._functions.AccumulateGrad


def _inputs_by_sample(leaves: list, batch: int, rows: int, all_shared: bool) -> list[int]:
    """The inputs read one sample at a time: those of B * k rows where the outputs have k rows per sample, or,
    where no input has, those of B rows (a router folding `[B, T, d]` into `x.view(-1, d)`): beside inputs of
    B * k rows, an input of B rows is another table (Swin's attention mask of one row per window, `[nW, n, n]`,
    with nW equal to B, beside `[B * nW, n, d]` windows). None where every output reaching the loss is shared
    across the batch: such an output is one tensor for all samples, recomputed from the whole inputs (a position
    embedding's `[T]` ids with T equal to B are positions, not samples)."""
    if all_shared:
        return []
    folded = [i for i, x in enumerate(leaves) if _has_batch(x, batch * rows)]
    if rows == 1 or folded:
        return folded
    return [i for i, x in enumerate(leaves) if _has_batch(x, batch)]


def _may_be_data(x: object, batch: int) -> bool:
    """Floating-point or boolean, untracked by autograd, no parameter, a multiple of B rows: what may be the batch's
    data or its masks (integers may be positions: `[T]` ids with T == B)."""
    return (
        isinstance(x, Tensor)
        and (x.is_floating_point() or x.dtype == torch.bool)
        and x.grad_fn is None
        and not isinstance(x, torch.nn.Parameter)
        and x.dim() > 0
        and x.shape[0] % batch == 0
    )


def _refuse_reading_the_data(
    call: LayerCall, params: dict[str, Tensor], inputs: tuple[list, object], data: list[int], slots: tuple[int, ...]
) -> None:
    """Where every output reaching the loss is shared across the batch, the module re-runs on its whole inputs, so
    its outputs must not read the batch's rows. Autograd does not record what an input untracked by it is (data,
    a mask, a table): each one that may be data (`_may_be_data`) is replaced by other values (`_PROBES`) and the
    outputs must be the same to the bit (BioGPT's positions take the float attention mask for its shape alone; a
    module returning `x.mean(0, keepdim=True) @ w` reads the samples: refused). A module reading the batch only
    through what two probes leave the same (a count that neither an affine change nor random values move) is not
    seen: docs/assumptions.md."""
    leaves, spec = inputs
    same = _batch_outputs(call, params, tree_unflatten(leaves, spec), slots)

    def unmoved_by(change: Callable[[Tensor], Tensor]) -> bool:
        """Whether the outputs stay `same` to the bit with the inputs that may be data changed by `change`."""
        probe = [change(x) if i in data else x for i, x in enumerate(leaves)]
        try:
            other = _batch_outputs(call, params, tree_unflatten(probe, spec), slots)
        except _TRANSFORM_ERRORS:  # (values used as indices, say: read all the same)
            return False
        return all(torch.equal(a, b) for a, b in zip(same, other, strict=True))

    if not all(unmoved_by(change) for change in _PROBES):
        shapes = ", ".join(str(tuple(leaves[i].shape)) for i in data)
        raise FlashDPError(
            f"The output of {call.label} has no batch dim and is broadcast over the batch, yet it changes with the "
            f"values of its floating-point or boolean input(s) of shape {shapes}, which may be the batch's data "
            "(rows of samples): an output shared by every sample must not read them, or each sample's gradient "
            "would carry the others' rows. Nothing was added to .grad. Keep the batch in dim 0 of that output "
            "(compute it per sample), or, if that input is a table rather than data, give it a leading dim of 1 "
            "(`table[None]`)."
        )


def _changed(x: Tensor) -> Tensor:
    """Other values for every element: a mask negated; numbers as `1 - 2 x` (signs and zeros change), NaN and
    infinities made finite (a breaker's module read only which values were NaN)."""
    if x.dtype == torch.bool:
        return ~x
    return torch.nan_to_num(1 - 2 * x, nan=0.5, posinf=0.25, neginf=-0.25)


def _drawn(x: Tensor) -> Tensor:
    """Values unrelated to x's (a fixed draw): a breaker's module read the batch's share of outliers, which
    `_changed`, an affine map, leaves the same."""
    generator = torch.Generator(device=x.device).manual_seed(len(x))
    if x.dtype == torch.bool:
        return torch.rand(x.shape, generator=generator, device=x.device) < 0.5
    return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)


#: how each input that may be data is changed to see whether a shared output reads it
_PROBES = (_changed, _drawn)


def _has_batch(x: object, batch: int) -> bool:
    return isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch


def _by_sample(x: Tensor, batch: int) -> Tensor:
    """`[B, k, ...]`: the batch's rows grouped by sample (k = 1 for a plain batch: a batch of 1 per sample)."""
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])


def _cotangent(meta: OutputMeta, grad: Tensor, shared: bool, batch: int) -> Tensor:
    """`[B, ...]`: a batch output's gradient grouped by sample, or a shared output's per-sample gradient."""
    return grad if shared else _by_sample(grad.view(meta.shape), batch)


def _check_recomputed(
    call: LayerCall, recorded_outputs: list[Tensor], outputs: tuple[Tensor, ...], shared: tuple[bool, ...]
) -> None:
    for recorded, again, is_shared in zip(recorded_outputs, outputs, shared, strict=True):
        # every sample recomputes the same shared output; batch outputs come back grouped by sample
        again = again[0] if is_shared else again.reshape(-1, *again.shape[2:])
        check_recomputed(call.label, recorded, again, "one sample at a time with the generic rule")


#: the rule of every module without one of its own (and of promotion targets)
GENERIC = Rule(generic_grads, per_call=True, recomputes=True)
