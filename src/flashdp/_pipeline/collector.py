"""From each call's output gradients to every trainable parameter's per-sample norms, as the gradients arrive.

The norm pass hands the collector one call's output gradients at a time (`receive`), in whatever order autograd
produces them. The call's rule turns them into per-sample gradients; as soon as every call that counts a parameter
has been received, the parameter's norms and clipped-sum plan are computed and its contributions dropped, so that
an output gradient lives no longer than in a non-private backward (plus what the plan keeps). The results do not
depend on the arrival order: each parameter's contributions are summed in call order, as one pass over all of them
would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils._pytree import tree_flatten

from flashdp._pipeline.broadcast_params import parameters_of
from flashdp._pipeline.norm_pass import OutputGrads, Sharing, check_call, per_sample_gradients
from flashdp._pipeline.param_grad import ParamGradient, ParamNorm, StrategyChoice, norms_together
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.plan import GradientPlan, Site
from flashdp._pipeline.recorder import Call, Recorder, as_called
from flashdp._pipeline.shared_outputs import SharedOutput, shared_inputs
from flashdp._pipeline.users import UserGroups
from flashdp.errors import FlashDPError
from flashdp.kernels import Backend
from flashdp.kernels import backend as kernels_backend
from flashdp.per_sample import DeferredOuterGrad, OuterGrad, PerSampleGrad
from flashdp.rules.recompute import DeferredCheck, deferring_checks

#: the forms of per-sample gradients a second pass sums (`fingerprint`)
_FACTORED = (OuterGrad, DeferredOuterGrad)

#: the most elements the gradients waiting for `norms_together` may hold (a pass holds them a little longer than
#: one parameter at a time would)
STACKING_BUDGET = 1 << 20


@dataclass(frozen=True)
class _Part:
    call_index: int
    grad: PerSampleGrad
    source: str
    #: `ParamGradient.counted_by`
    counted_by: str | None


class NormCollector:
    """Per-sample norms of every trainable parameter reached by the loss, from the calls' output gradients.

    keep_calls: keep each call (without its outputs) after receiving it, for a second norm pass over the same
        graph; else it is released at once (its inputs are then freed with the graph, as in a plain backward).
    keep_gradients: keep each parameter's `ParamGradient` (its contributions) after its norms, for a float64
        recomputation of a norm that overflowed float32.
    shared: the outputs shared across the batch, by (call index, output index); their per-sample gradients are
        read when their call is received.
    defer_checks: the rules' checks of their recomputations are left on the device, in `deferred`, for the
        caller to read with its own sync (`recompute.raise_failed`) before it uses the norms.
    users: the rows' users, when each user's rows are clipped together: the norms are then per user.
    sums: a pass for the clipped sums alone (ghost's second pass): each parameter's contributions are handed to it
        as soon as they are complete, with whether every call counting it received the gradients a first pass did
        (`fingerprints` given), and no norm is taken.
    fingerprints: per call, the fingerprint of the gradients a first pass over the same calls received, to compare
        with (a collector keeping its calls records its own in `fingerprints`).
    """

    def __init__(
        self,
        plan: GradientPlan,
        calls: Sequence[Call],
        batch: int,
        *,
        strategy: StrategyChoice,
        keep_for_sum: bool,
        backend: Backend,
        recorder: Recorder,
        shared: Mapping[tuple[int, int], SharedOutput] | None = None,
        keep_calls: bool = False,
        keep_gradients: bool = False,
        defer_checks: bool = False,
        users: UserGroups | None = None,
        sums: Callable[[TrainableParam, ParamGradient, Tensor | None], None] | None = None,
        fingerprints: Sequence[Tensor | None] | None = None,
    ) -> None:
        self.plan, self.batch, self._sums = plan, batch, sums
        self._calls: list[Call | None] = list(calls)
        # (a per-call rule's outputs kept with its call: it compares its re-run with them, else runs the forward)
        self._kept: list[Call] = (
            [c if plan.site(c.module).match.rule.per_call else c.without_outputs() for c in calls] if keep_calls else []
        )
        #: per call, its gradients' fingerprint (`_fingerprint`), where the calls are kept for a second pass
        self.fingerprints: list[Tensor | None] = [None] * len(calls) if keep_calls else []
        self._expected = fingerprints
        self._fingerprinting = keep_calls or fingerprints is not None
        #: calls whose inputs a checkpoint recomputes in each pass (fingerprinted too: a pass may recompute others)
        self._recomputed = {i for i, c in enumerate(calls) if c.packed} if self._fingerprinting else set()
        self._matched: dict[int, Tensor] = {}  # call -> whether its gradients' fingerprint is the first pass's
        self._missed: set[Hashable] = set()  # parameters of calls the first pass fingerprinted and this one missed
        self._strategy, self._keep_for_sum, self._backend = strategy, keep_for_sum, backend
        self._recorder, self._shared = recorder, shared or {}
        self._shared_of: dict[int, dict[int, SharedOutput]] = {}  # call -> its entries in `shared`, by output
        for (index, j), output in self._shared.items():
            self._shared_of.setdefault(index, {})[j] = output
        #: (the shared outputs' nodes, the others' and the shared outputs' frontiers): `_shared_inputs`
        self._output_nodes = _split_output_nodes(calls, self._shared)
        self._keep_gradients, self._users = keep_gradients, users
        self._pending: dict[Hashable, int] = {}  # parameter -> calls counting it not yet received
        self._params: dict[Hashable, TrainableParam] = {}
        self._sites: list[tuple[Site, dict[str, Hashable]]] = []  # per call: its site, its parameters' keys
        for call in calls:
            site = plan.site(call.module)
            params = {name: plan.param_of[(id(call.module), name)] for name in site.trainable}
            self._sites.append((site, {name: param.key for name, param in params.items()}))
            for param in params.values():
                self._params[param.key] = param
                self._pending[param.key] = self._pending.get(param.key, 0) + 1
        self._parts: dict[Hashable, list[_Part]] = {}
        self._first_call: dict[Hashable, int] = {}
        self._norms: dict[Hashable, ParamNorm] = {}
        #: parameters whose norms wait to be taken together (`norms_together`), by stacking key, and their elements
        self._stacking: dict[Hashable, list[tuple[Hashable, ParamGradient]]] = {}
        self._stacking_elements = 0
        self.gradients: dict[Hashable, ParamGradient] = {}
        self._unreached: list[Call] = []
        self.deferred: list[DeferredCheck] | None = [] if defer_checks else None

    @property
    def calls(self) -> list[Call]:
        """The calls (without their outputs), when kept."""
        return self._kept

    def unpack(self, index: int) -> None:
        """Unpack call `index`'s inputs now (inside the norm pass: see `Call.unpacked`), for a call whose
        gradients are received after the pass."""
        self._calls[index] = self._calls[index].unpacked()

    def receive(self, index: int, grads: OutputGrads) -> None:
        """Call `index`'s output gradients (None where an output does not reach the loss); they are not kept.
        The rules and norms run here, on autograd's thread under CUDA, where no context of the caller's is set."""
        # (unpacked outside: inside a checkpointed region this recomputes the region's forward, with gradients)
        self._calls[index] = self._calls[index].unpacked()
        deferring = deferring_checks(self.deferred) if self.deferred is not None else contextlib.nullcontext()
        with torch.no_grad(), kernels_backend(self._backend), self._recorder.paused(), deferring:
            self._receive(index, grads)

    def _receive(self, index: int, grads: OutputGrads) -> None:
        call, self._calls[index] = self._calls[index], None
        site, keys = self._sites[index]
        if all(g is None for g in grads):
            self._unreached.append(call)  # (checked at the end: an output modified in place hides its gradient)
            self._miss(index)
        else:
            if call.input_modified():
                raise call.input_modified_error(site.label)
            dims = check_call(site, call, grads, index, self.batch, self._shared)
            with call.as_called():
                per_sample = self._per_sample(index, site, call, grads, dims)
            # (a second pass sums factored contributions alone: the others' rows are kept from this one)
            if self._fingerprinting and (
                self._expected is not None or any(isinstance(g, _FACTORED) for g in per_sample.values())
            ):
                self._fingerprint(index, call, grads, dims)
            if any(isinstance(g, DeferredOuterGrad) for g in per_sample.values()):
                per_sample = {name: _as_called_later(g, call.attributes) for name, g in per_sample.items()}
            by = self._counted_by(index, site, call)
            for name, key in keys.items():
                self._parts.setdefault(key, []).append(_Part(index, per_sample[name], site.label, by))
                self._first_call.setdefault(key, index)
        del call, grads
        for key in keys.values():
            self._pending[key] -= 1
            if not self._pending[key] and key in self._parts:
                self._finalise(key)

    def _fingerprint(self, index: int, call: Call, grads: OutputGrads, dims: tuple[int, ...]) -> None:
        """Record call `index`'s fingerprint (a first pass), or compare it with the first pass's: its output
        gradients' row by row (`dims`: their batch dims), its shared outputs' per-sample gradients, and, where a
        checkpoint recomputes them, its inputs."""
        # (as the rule reads them: an output recorded through the tensor it views, such as attention's [L * B, E]
        # for its [L, B, E], in the output's shape, where its batch dim is)
        metas = call.output_meta
        shaped = [g if g is None or g.shape == m.shape else g.view(m.shape) for g, m in zip(grads, metas, strict=True)]
        rows = [*zip(shaped, dims, strict=True), *((g, 0) for g in self._shared_per_sample(index).values())]
        if index in self._recomputed:
            rows += [(x, None) for x in call.tensor_inputs()]
        found = fingerprint(rows)
        if self._expected is None:
            self.fingerprints[index] = found
            return
        expected = self._expected[index]
        same_shape = expected is not None and expected.shape == found.shape
        self._matched[index] = (found == expected).all() if same_shape else found.new_zeros((), dtype=torch.bool)

    def _miss(self, index: int) -> None:
        """Call `index` reached no loss in a pass compared with a first that fingerprinted it (a custom Function's
        backward returning None when run again: its part, which cancelled another call's, left out; a breaker's
        sample added 239 C): its parameters' sums are not added."""
        if self._expected is not None and self._expected[index] is not None:
            self._missed.update(self._sites[index][1].values())

    def _all_matched(self, parts: list[_Part]) -> Tensor | None:
        """Whether every call of a parameter received the first pass's gradients (a device bool); None where none
        was compared."""
        matched = [self._matched[p.call_index] for p in parts if p.call_index in self._matched]
        if not matched:
            return None
        return matched[0] if len(matched) == 1 else torch.stack(matched).all()

    def _shared_per_sample(self, index: int) -> dict[int, Tensor]:
        """The per-sample gradients of call `index`'s outputs shared across the batch, by output."""
        return {j: output.per_sample for j, output in self._shared_of.get(index, {}).items()}

    def _per_sample(
        self, index: int, site: Site, call: Call, grads: OutputGrads, dims: tuple[int, ...]
    ) -> dict[str, PerSampleGrad]:
        if self.batch == 0:  # a rank without samples this step: nothing to add, but the same parameters as others
            shapes = [self.plan.param_of[(id(call.module), name)].shape for name in site.trainable]
            like = next(g for g in grads if g is not None)
            return {name: like.new_zeros(0, *shape) for name, shape in zip(site.trainable, shapes, strict=True)}
        inputs = self._shared_inputs(call) if site.match.rule.per_call else frozenset()
        sharing = Sharing(self._shared_per_sample(index), inputs, self._broadcast(index, site, call))
        return per_sample_gradients(site, call, grads, self.batch, sharing, dims)

    def _counted_by(self, index: int, site: Site, call: Call) -> str | None:
        """`ParamGradient.counted_by` of call `index`'s parameters."""
        if not site.is_generic:
            return None
        return "broadcast" if set(site.trainable) <= set(self._broadcast(index, site, call)) else "generic"

    def _broadcast(self, index: int, site: Site, call: Call) -> dict[str, Tensor | None]:
        """Call `index`'s parameters counted where they meet the batch (`broadcast_params`), by name."""
        return parameters_of(self._shared_of.get(index, {}), site.trainable, len(call.edges))

    def _shared_inputs(self, call: Call) -> frozenset[int]:
        """`LayerCall.shared_inputs` of a call (of its parameters alone where no output is shared in this pass)."""
        leaves, _ = tree_flatten((call.args, call.kwargs))
        return shared_inputs(leaves, *self._output_nodes, self.batch)

    def _finalise(self, key: Hashable) -> None:
        param, parts = self._params[key], self._parts.pop(key)
        gradient = ParamGradient(
            param.name, param.shape, self.batch, self._strategy, self._users, sum_only=self._sums is not None
        )
        for part in sorted(parts, key=lambda p: p.call_index) if len(parts) > 1 else parts:
            gradient.add(part.grad, part.source, counted_by=part.counted_by)
        if self._sums is not None:
            missed = torch.zeros((), dtype=torch.bool, device=param.param.device) if key in self._missed else None
            self._sums(param, gradient, self._all_matched(parts) if missed is None else missed)
            return
        if self._keep_gradients:
            self.gradients[key] = gradient
        stacking = gradient.stacking_key()
        if stacking is None:
            self._norms[key] = gradient.norm_sq(self._keep_for_sum)
            return
        self._stacking.setdefault(stacking, []).append((key, gradient))
        self._stacking_elements += gradient.elements
        if self._stacking_elements > STACKING_BUDGET:
            self._norms_of_stacked()

    def _norms_of_stacked(self) -> None:
        for waiting in self._stacking.values():
            keys = [key for key, _ in waiting]
            self._norms.update(zip(keys, norms_together([g for _, g in waiting], self._keep_for_sum), strict=True))
        self._stacking, self._stacking_elements = {}, 0

    def finish(self) -> list[tuple[TrainableParam, ParamNorm]]:
        """Every reached parameter's norms, in the order of the first call counting it (as a single pass over the
        calls in forward order would list them). Raises if the loss reached no trainable layer."""
        for call in self._unreached + [c for c in self._calls if c is not None]:
            if call.modified_in_place():
                raise call.hidden_by_in_place_error(self.plan.site(call.module).label)
        for index in (i for i, c in enumerate(self._calls) if c is not None):
            self._miss(index)
        self._calls = []
        with torch.no_grad(), kernels_backend(self._backend):
            for key in list(self._parts):  # parameters some of whose calls do not reach the loss
                self._finalise(key)
            self._norms_of_stacked()
        if not self._norms and self._sums is None:
            raise no_trainable_layer_error()
        order = sorted(self._norms, key=self._first_call.__getitem__)
        return [(self._params[key], self._norms[key]) for key in order]


def fingerprint(tensors: Sequence[tuple[Tensor | None, int | None]]) -> Tensor:
    """Integers, per row of each tensor along its given dim (the batch's; None: the whole tensor as one row; None
    tensors skipped): the sum of its elements' bits read as integers, exact modulo 2^32 (2^64 for float64), so
    that an element whose bits change changes it (unless another's change cancels it to the bit), and the bits of
    its norm (accumulated in float32, float64 for float64 tensors); of an integer or boolean tensor (a recomputed
    call's ids), the sums of its values and of their squares, exact modulo 2^64. Equal for tensors equal bit for bit;
    different where a row's values changed (also below their sums' rounding: a breaker's 0.03 next to 1e6,
    amplified by its input to 300 C, passed sums and norms of the values), or rows swapped; not where elements
    only swap places within one row."""
    parts = []
    for t, dim in tensors:
        if t is None:
            continue
        # (rows flattened, the bits summed wrapping around in their own width: each several times faster on the CPU)
        rows = t.reshape(1, -1) if dim is None or t.dim() <= dim else _rows_in_memory_order(t, dim)
        if not t.is_floating_point():  # (a recomputed call's ids or mask: values and squares summed, wrapping)
            values = rows.to(torch.int64)
            parts += [values.sum(1), values.square().sum(1)]
            continue
        wide = t.dtype in (torch.float32, torch.float64)
        norm = torch.linalg.vector_norm(rows, dim=1, dtype=None if wide else torch.float32)
        bits = rows.view(_BITS[t.dtype])
        sums = bits.sum(1, dtype=torch.int64 if bits.dtype == torch.int64 else torch.int32)
        parts += [sums, norm.view(_BITS[norm.dtype])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)  # (cat widens to the widest part)


def _rows_in_memory_order(t: Tensor, dim: int) -> Tensor:
    """`[t.shape[dim], -1]`: the rows of `t` along `dim`, each row's elements in the order they lie in memory, a view
    where that order is dense (an output gradient of transposed layout, such as a language model's logits read by a
    loss through `.transpose(1, 2)`: flattened in its own dim order, 64 MB were copied twice a step)."""
    moved = t.movedim(dim, 0)
    order = sorted(range(1, moved.dim()), key=lambda d: -moved.stride(d))
    rows = moved.permute(0, *order)
    return (rows if rows.is_contiguous() else moved).reshape(t.shape[dim], -1)


#: the integers a float's bits are read as (`fingerprint`)
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def _as_called_later(grad: PerSampleGrad, attributes: tuple) -> PerSampleGrad:
    """A deferred gradient's routines, which read the module when they run (a convolution's dilation and padding:
    at its norm, or at bk's clipped sum), run with the module's attributes as at the call."""
    if not isinstance(grad, DeferredOuterGrad):
        return grad

    def under(routine: Callable | None) -> Callable | None:
        if routine is None:
            return None

        def run(*args: object) -> object:
            with as_called(attributes):
                return routine(*args)

        return run

    routines = ("factors", "dense", "weighted_sum", "parts_norm")
    return replace(grad, **{name: under(getattr(grad, name)) for name in routines})


def _split_output_nodes(
    calls: Sequence[Call], shared: Mapping[tuple[int, int], SharedOutput]
) -> tuple[set[Node], set[Node]]:
    """The shared outputs' nodes, and the other outputs' with the shared outputs' frontiers (where the batch
    appears: what is computed through one is per sample); both empty where no output is shared."""
    if not shared:
        return set(), set()
    nodes = {output.edge.node for output in shared.values()}
    frontiers = {frontier.node for output in shared.values() for frontier in output.frontiers}
    return nodes, {e.node for c in calls for e in c.edges if e.node not in nodes} | frontiers


def no_trainable_layer_error() -> FlashDPError:
    return FlashDPError(
        "The loss does not depend on any trainable layer recorded in the last forward pass: compute the "
        "per-sample losses from this model's output."
    )
