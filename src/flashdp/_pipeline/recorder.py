"""Forward hooks on every site of the gradient plan. A call records references to its inputs and the gradient
edges of its outputs (taken before any later in-place op can move them); a rule site's call also keeps its
outputs and the parameters its rule counts, as the module held them during the call."""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_leaves, tree_map

from flashdp._pipeline.params import TrainableParam, attribute
from flashdp._pipeline.plan import GradientPlan, Site
from flashdp.errors import FlashDPError
from flashdp.per_sample import OutputMeta, RngState, rng_state, rounding_dtype

#: Relative error allowed when checking a module's forward against its rule's. It catches a different function
#: (errors of order 1), not rounding: HF norms compute in float32 even for float64 inputs.
_FORWARD_CHECK_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}


@dataclass(frozen=True)
class Call:
    """One forward call of a hooked module.

    edges: where the norm pass takes the gradient of each output. For an output that is a full reshape of an
    internal tensor (nn.Linear on a 3-D input returns a view), the edge of that base: a later in-place op on the
    view (ReLU(inplace=True)) re-routes the graph around the view's own node, never around the base's.
    """

    module: nn.Module
    args: tuple
    kwargs: dict
    #: the gradient edges of every tensor input that requires grad: where the call's part of the graph ends
    input_edges: tuple[GradientEdge, ...]
    #: per output tensor that requires grad: where it sits in the output, its shape and dtype
    output_meta: tuple[OutputMeta, ...]
    edges: tuple[GradientEdge, ...]
    #: the outputs a per-call rule reads, and those an in-place op could hide from the norm pass (see `_hideable`);
    #: None for the others, which a plain backward would free (e.g. the logits, once the loss has its log-softmax)
    outputs: tuple[Tensor | None, ...]
    output_versions: tuple[int, ...]
    #: a rule site's counted parameters, as held during the call (the tensors the forward's graph reads)
    params: dict[str, Tensor]
    #: under a wrapper that replaces parameters after the forward (FSDP), a per-call rule's copies of `params`, to
    #: run the call again with, and its site's other tensors as held
    copies: dict[str, Tensor]
    frozen: dict[str, Tensor]
    autocast: tuple[str, torch.dtype] | None
    #: for a per-call rule, or a scope (the generic rule may count it later), either of which may run the forward
    #: again: the default device where it is not the CPU
    default_device: torch.device | None = None
    #: the random number generators' state as the call began, for a rule that replays its random draws
    rng_state: RngState | None = None
    #: an output was modified in place before `without_outputs` dropped them
    was_modified: bool = False
    #: the tensors among args and kwargs are `_Packed` (see `unpacked`)
    packed: bool = False
    #: each tensor input (in `_tensor_leaves` order of args, then kwargs), weakly referenced, with its version as the
    #: call returned: the rules read the inputs in the backward
    watched_inputs: tuple[tuple[weakref.ref, int], ...] = ()
    #: why a per-call rule may not run this call's forward again (`Adapter.rerun_error`), raised where it would
    rerun_refusal: Exception | None = None
    #: the module's and its descendants' attributes as the call saw them (`_attributes`): a rule reads a
    #: convolution's dilation or a norm's eps from the module in the backward, when they may have been set back
    attributes: tuple[tuple[nn.Module, dict[str, object]], ...] = ()

    @property
    def inputs(self) -> tuple:
        """The positional inputs, or without any, the keyword inputs' values: what a simple rule takes."""
        return self.args or tuple(self.kwargs.values())

    def parameter(self, name: str) -> Tensor:
        """The tensor the call used for its module's parameter `name` (dotted): as held during the call where a
        wrapper replaced it, else the module's own."""
        return self.params[name] if name in self.params else attribute(self.module, name)

    def to_run_with(self, name: str) -> Tensor:
        """`parameter(name)`, or its copy where a wrapper has resharded it since the call (a per-call rule runs the
        call again with it)."""
        return self.copies[name] if name in self.copies else self.parameter(name)

    def modified_in_place(self) -> bool:
        return self.was_modified or any(
            o is not None and o._version != v for o, v in zip(self.outputs, self.output_versions, strict=True)
        )

    def input_modified(self) -> bool:
        """Whether a tensor input the rules will read is the call's own tensor, modified in place since the call
        returned (its values are then not the call's). Inputs packed by saved-tensor hooks are known once unpacked:
        a hook may hand back the tensor itself (an identity hook, `save_on_cpu` on the CPU) or a copy or
        recomputation made in the forward's image (a checkpointed region), which no later change reaches."""
        if self.packed:
            return False
        return any(
            t is held() and t._version != version
            for t, (held, version) in zip(self.tensor_inputs(), self.watched_inputs, strict=True)
        )

    def tensor_inputs(self) -> list[Tensor]:
        """The tensors among the call's arguments, in pytree order."""
        return _tensor_leaves(self.args) + _tensor_leaves(self.kwargs)

    def as_called(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the module (and its descendants) hold the attributes they held at the call (`as_called`)."""
        return as_called(self.attributes)

    def unpacked(self) -> Call:
        """This call with its inputs as tensors. A call made where autograd's saved-tensor hooks are set keeps its
        inputs the way autograd keeps saved tensors there: inside a checkpointed region they are recomputed in the
        backward rather than held. Unpack inside the norm pass, where autograd's own recomputation is shared;
        outside any backward, each unpack recomputes the region's forward."""
        if not self.packed:
            return self
        args, kwargs = tree_map(lambda x: x.unpack(x.holder) if isinstance(x, _Packed) else x, (self.args, self.kwargs))
        return replace(self, args=args, kwargs=kwargs, packed=False)

    def without_outputs(self) -> Call:
        """This call without its outputs, which a plain backward would have freed (the logits, once the loss has
        its log-softmax), for a rule that does not read them; whether one was modified in place is kept (the
        forward is over: nothing modifies them any more)."""
        if all(o is None for o in self.outputs):  # (none recorded: nothing to drop, nothing to compare)
            return self
        return replace(self, outputs=(None,) * len(self.outputs), was_modified=self.modified_in_place())

    def with_outputs(self, kept: list[int]) -> Call:
        """This call with only its outputs at positions `kept` (the others' gradients are counted through another
        recorded output with the same gradient edge: `aliasing.one_holder_per_edge`). A rule reads an output by its
        slot (`OutputMeta.slot`): an output left out is one whose gradient is None."""
        return replace(
            self,
            output_meta=tuple(self.output_meta[j] for j in kept),
            edges=tuple(self.edges[j] for j in kept),
            outputs=tuple(self.outputs[j] for j in kept),
            output_versions=tuple(self.output_versions[j] for j in kept),
            was_modified=self.modified_in_place(),
        )

    def hidden_by_in_place_error(self, label: str) -> FlashDPError:
        return FlashDPError(
            f"The output of layer {label} was modified in place after the layer returned it (e.g. "
            "ReLU(inplace=True) or `out += x`), which hides its gradient. Make that operation out of place "
            "(inplace=False, `out = out + x`; flashdp.fix_model(model) turns off inplace=True on every module)."
        )

    def input_modified_error(self, label: str) -> FlashDPError:
        return FlashDPError(
            f"An input of layer {label} was modified in place after the layer ran (e.g. `r.add_(...)` or "
            "`r[mask] = ...` on the tensor it read, or on a view of it; autograd may not notice where it saved a copy "
            "of its own). flashdp computes the layer's per-sample gradients from its inputs in the backward, so it "
            "would read the new values. Make that operation out of place (`r = r + ...`), or call the layer on a "
            "copy (`layer(r.clone())`)."
        )


@dataclass(frozen=True)
class _Packed:
    """A call's input tensor as autograd's saved-tensor hooks packed it."""

    holder: object
    unpack: Callable[[object], Tensor]


def _saved_tensor_hooks() -> tuple[Callable, Callable] | None:
    """The (pack, unpack) saved-tensor hooks autograd would use here (a checkpointed region's), or None. Read from
    a private torch function; where this torch lacks it, inputs are held as outside such regions."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        return top(False)
    except TypeError:  # an older signature without ignore_is_tracing
        return top()


def _packed(tree: object, hooks: tuple[Callable, Callable]) -> object:
    pack, unpack = hooks
    return tree_map(lambda x: _Packed(pack(x), unpack) if isinstance(x, Tensor) else x, tree)


@dataclass(frozen=True)
class Forward:
    """What one forward recorded: its calls, in order, and the plan they were recorded under: the engine's, with
    the forward's own verdicts on modules whose rule is checked on their first call (`Site.match.verify_with`:
    the rule's scale, or the generic rule)."""

    calls: list[Call]
    plan: GradientPlan


class Recorder:
    """Records calls made with gradients enabled, outside any backward pass (a non-reentrant checkpoint
    recomputes its segment inside the backward: those calls are not the forward's) and outside the engine's own
    recomputations (`paused`); `take()` hands them over and forgets them. It records under the plan it was last
    told to `follow`, and never changes the engine's.

    holds_own: under a wrapper that swaps parameters in for the forward and out after it (FSDP), whether a tensor a
    module holds is the one the wrapper swaps in for a parameter (`Adapter.holds_own`); per-call rules' sites then
    copy theirs. None: no such wrapper.
    """

    def __init__(
        self,
        plan: GradientPlan,
        on_call: Callable[[], None] = lambda: None,
        holds_own: Callable[[TrainableParam, object], bool] | None = None,
        rerun_error: Callable[[nn.Module, str], Exception | None] = lambda module, label: None,
    ):
        self._plan = plan
        #: the plan the latest forward was recorded under: a checkpoint's recomputation of that forward (in its
        #: backward, or in a pass of the user's own) packs as that forward did, whatever plan a backward committed since
        self._forward_plan = plan
        self.calls: list[Call] = []
        #: what the model's hooks keep alive with the recorder (a training engine: it lives until detached)
        self.owner: object | None = None
        self._on_call = on_call
        self._holds_own, self._rerun_error = holds_own, rerun_error
        self._keep_params = holds_own is not None
        self._paused = False
        self._probes: dict[Hashable, float | None] = {}  # probe verdicts shared by alike modules (`_probe_key`)
        self._rng_states: dict[int, list[RngState]] = {}
        #: id(module) -> (the plan, `_subtree_params` under it)
        self._subtree_params: dict[int, tuple[GradientPlan, tuple[tuple[nn.Module, str, TrainableParam], ...]]] = {}
        # prepend: run before a wrapper's own post-forward hook (FSDP2 reshards its parameters there)
        self._handles = [
            site.module.register_forward_hook(_Hook(self), with_kwargs=True, prepend=True)
            for site in plan.sites.values()
        ]
        #: id(module) -> the id of the engine's forward hook on it (first among its forward hooks, unless one was
        #: prepended since)
        self._hook_ids = {id(site.module): h.id for site, h in zip(plan.sites.values(), self._handles, strict=True)}
        #: id(module) -> what its rule's last verdict rested on
        self._verified: dict[int, _Evidence] = {}
        self._handles += [
            site.module.register_forward_pre_hook(_Hook(self, before=True), with_kwargs=True)
            for site in plan.rule_sites
            if site.match.rule.random is not None
        ]

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Save the random state where the module's forward will draw random numbers (its rule replays them)."""
        site = self._plan.sites.get(id(module))
        if site is not None and site.match is not None and site.match.rule.random and site.match.rule.random(module):
            device = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)), None)
            self._rng_states.setdefault(id(module), []).append(rng_state(device))

    def record(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        saved = self._rng_states.get(id(module))
        rng = saved.pop() if saved else None
        if self._paused or not torch.is_grad_enabled():
            return
        recomputing = torch._C._current_graph_task_id() != -1  # a checkpoint recomputing its segment in the backward
        if not recomputing:
            self._forward_plan = self._plan
        site = self._forward_plan.sites.get(id(module))
        if site is None or self._substituted(module):
            return
        leaves = _tensor_leaves(output)
        slots = _distinct_slots(leaves)
        hooks = _saved_tensor_hooks()
        if recomputing:
            if slots and hooks is not None:  # packed as in the forward: the recomputation matches saves by order
                _packed((args, kwargs), hooks)
            return
        if site.match is not None:
            site = self._checked_against_its_rule(site, module, (args, kwargs), output)
            _check_call(site, args, kwargs, output)
        if not slots:
            return
        self._on_call()
        outputs = [leaves[i] for i in slots]
        tensor_inputs = _tensor_leaves(args) + _tensor_leaves(kwargs)
        input_edges = tuple(_edge(t) for t in tensor_inputs if t.requires_grad)
        watched = tuple((weakref.ref(t), t._version) for t in tensor_inputs)
        if hooks is not None:  # (inside a checkpointed region, or one offloading its saved tensors)
            args, kwargs = _packed((args, kwargs), hooks)
        counting = site.match is not None
        params = {name: attribute(module, name) for name in site.trainable}
        copies, frozen, rerun_refusal = self._kept_for_a_rerun(site, module, params)
        self.calls.append(
            Call(
                module=module,
                args=args,
                kwargs=kwargs,
                input_edges=input_edges,
                output_meta=tuple(OutputMeta(i, leaves[i].shape, leaves[i].dtype) for i in slots),
                edges=tuple(_edge(_reshape_base(t)) for t in outputs),
                outputs=tuple(t if counting and (site.match.rule.per_call or _hideable(t)) else None for t in outputs),
                output_versions=tuple(t._version for t in outputs),
                params=params,
                copies=copies,
                frozen=frozen,
                autocast=_autocast_state(outputs[0].device.type),
                default_device=_default_device() if not counting or site.match.rule.per_call else None,
                rng_state=rng,
                packed=hooks is not None,
                watched_inputs=watched,
                rerun_refusal=rerun_refusal,
                attributes=_configurations(module),
            )
        )

    def _kept_for_a_rerun(
        self, site: Site, module: nn.Module, params: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Exception | None]:
        """Under a wrapper that replaces the parameters after the forward, for a per-call rule (which reads them
        from the call): copies of the parameters and of the module's other tensors, and why the rule may not run
        the call again (`Adapter.rerun_error`); nothing otherwise."""
        if not (self._keep_params and site.match is not None and site.match.rule.per_call):
            return {}, {}, None
        copies = {n: p.detach().clone() for n, p in params.items()}
        frozen = {n: t.detach().clone() for n, t in _tensors_of(module) if n not in params}
        return copies, frozen, self._rerun_error(module, site.label)

    def _checked_against_its_rule(self, site: Site, module: nn.Module, call: tuple, output: object) -> Site:
        """The site a call is counted under. A rule is trusted with a call's output on evidence only. A module
        matched by duck typing, or overriding its class's forward, is checked against its rule's forward on its
        first call (the plan it gives has no `verify_with`). The module of a rule that does not recompute its
        outputs itself is checked again on any call where what its verdict rested on changed (its and its
        descendants' attributes, `training` included, and tensors other than trainable parameters), the instance
        holds its own `forward`, its class changed, or hooks may change what its descendants compute: a verdict
        other than the one it is counted under moves it to the generic rule. A call whose output a forward hook
        may have changed before the engine's saw it is refused unless the output is the rule's forward's (see
        `_hooked_before`). call: its (args, kwargs). The rule's check of the module's settings runs at every call:
        make_private refused what it refuses, and a setting may be changed later."""
        match, inputs = site.match, None
        reason = match.rule.check(module) if match.rule.check else None
        if reason:
            raise FlashDPError(
                f"Layer {site.label}: {reason}. make_private refuses this setting, set since: nothing was computed. "
                "Set it back, or freeze the layer (p.requires_grad_(False)) and call make_private again."
            )
        if match.verify_with is not None or (not match.rule.recomputes and self._in_doubt(site)):
            inputs = _positional(module, *call)
            reference = match.verify_with or match.reference
            scale = _scale_of_its_rule(site, reference, inputs, output, self._probes) if reference else None
            if match.rule.per_call and scale != 1.0:  # (a rule of the whole call applies no output scale)
                scale = None
            if scale is not None and match.verify_with is not None:
                self._plan = self._plan.with_scale(module, scale)
            elif scale is None or not _close(scale, match.output_scale):
                self._plan = self._plan.with_generic(module)
            self._verified[id(module)] = _Evidence.of(module)
            site = self._plan.site(module)
        hooked = None if site.match.rule.recomputes else _hooked_before(module, self._hook_ids)
        if hooked:
            _refuse_unless_its_rules(site, inputs or _positional(module, *call), output, hooked)
        return site

    def _in_doubt(self, site: Site) -> bool:
        """Whether a module may no longer compute what its rule was last found to (times its scale)."""
        module, then = site.module, self._verified.get(id(site.module))
        return (
            "forward" in module.__dict__
            or (site.match.layer_type is not None and type(module) is not site.match.layer_type)
            or _descendants_hooked(module)
            or (then is not None and then.changed(module))
        )

    def paused(self) -> _Paused:
        """Record nothing meanwhile (the generic rule re-runs forwards)."""
        return _Paused(self)

    def _substituted(self, module: nn.Module) -> bool:
        """Whether the module was called with other tensors in place of trainable parameters of it or of its
        descendants (`torch.func.functional_call(layer, {"weight": 3 * layer.weight}, ...)`, on a layer or on a
        block holding it, another layer's weight): a rule would count the gradient of the tensor used as the
        parameter's (3x too small for `3 * W`), a generic rule would re-run the forward with the parameters
        themselves. Such a call is not recorded: the parameters' uses through it are uses outside any call of
        theirs, which the coverage walk moves to the generic rule of an enclosing module called with its own
        parameters (whose forward makes the substitution again), or refuses; a parameter the call did not use
        gets nothing from it. Asked in the forward hook, after the module's forward: a module whose forward
        substitutes and restores (around a child's call) is called with its own. Under a wrapper that swaps
        parameters in for the forward, its own are the ones it swaps in (`Adapter.holds_own`: FSDP2's unsharded
        parameters, FSDP1's views of its flat parameters)."""
        plan = self._forward_plan
        cached = self._subtree_params.get(id(module))
        if cached is None or cached[0] is not plan:
            cached = (plan, _subtree_params(plan, module))
            self._subtree_params[id(module)] = cached
        if self._holds_own is None:  # (no wrapper: the plan's own tensors)
            return any(owner._parameters.get(name) is not param.param for owner, name, param in cached[1])
        return any(not self._holds_own(param, _held(owner, name)) for owner, name, param in cached[1])

    def follow(self, plan: GradientPlan) -> None:
        """Record the next forwards under `plan` (the engine's, once a backward committed it)."""
        self._plan = plan

    def take(self) -> Forward:
        calls, self.calls = self.calls, []
        return Forward(calls, self._plan)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.calls = []
        self.owner = None


def _close(scale: float, other: float) -> bool:
    return abs(scale - other) <= _FORWARD_CHECK_TOLERANCE[torch.float64] * abs(scale)


def _hooked_before(module: nn.Module, hook_ids: dict[int, int]) -> str | None:
    """Which forward hooks ran before the engine's on this call, if any: hooks run in order, global ones first."""
    if nn.modules.module._global_forward_hooks:
        return "a global forward hook (torch.nn.modules.module.register_module_forward_hook)"
    if next(iter(module._forward_hooks), None) != hook_ids.get(id(module)):
        return "a forward hook registered with prepend=True after make_private"
    return None


@torch.no_grad()
def _refuse_unless_its_rules(site: Site, inputs: tuple, output: object, hooked: str) -> None:
    """Raise unless a call's output is its rule's forward (times the scale it is counted at): a hook that ran
    before the engine's hook and returned another output would have it count that output as the layer's."""
    reference, match = site.match.reference, site.match
    try:
        scale = _output_scale(output, reference(site.module, inputs)) if reference else None
    except Exception:  # (the rule's forward cannot run on these inputs: nothing shows the output is its)
        scale = None
    if scale is None or not _close(scale, match.output_scale):
        raise FlashDPError(
            f"Layer {site.label}: {hooked} ran before flashdp's and its output is not "
            "the layer's forward's: flashdp would count the hook's output as the layer's. Register the hook on the "
            "module with register_forward_hook without prepend=True (flashdp's hook, registered first, then "
            "records the layer's own output and autograd carries the hook's change), or make the change part of "
            "the model's forward."
        )


@dataclass(frozen=True)
class _Evidence:
    """What a verdict on a module's forward rested on, besides its class, inputs and trainable parameters: its and
    its descendants' attributes (`_attributes`), their public dict attributes (copied), and their other tensors
    (buffers, frozen parameters, tensors held as attributes) by identity and in-place version."""

    attributes: tuple[tuple[nn.Module, dict[str, object]], ...]
    dicts: tuple[tuple[nn.Module, str, dict], ...]
    tensors: tuple[tuple[int, str, int, int], ...]

    @classmethod
    def of(cls, module: nn.Module) -> _Evidence:
        modules = _with_descendants(module)
        dicts = tuple(
            (m, k, dict(v)) for m in modules for k, v in vars(m).items() if type(v) is dict and not k.startswith("_")
        )
        return cls(_configurations(module), dicts, _tensor_state(modules))

    def changed(self, module: nn.Module) -> bool:
        modules = _with_descendants(module)
        return (
            any(_changed(m, then) for m, then in self.attributes)
            or any(not _same_dict(vars(m).get(k), then) for m, k, then in self.dicts)
            or _tensor_state(modules) != self.tensors
        )


def _held(module: nn.Module, name: str) -> object:
    """What the module's forward reads as its parameter `name` now: a plain attribute (FSDP1's views, which take
    precedence over a parameter registered under the name), else the registered one."""
    return getattr(module, name, None)


def _subtree_params(plan: GradientPlan, module: nn.Module) -> tuple[tuple[nn.Module, str, TrainableParam], ...]:
    """(owner, name, the parameter) for every trainable parameter the plan knows in the module and its
    descendants."""
    return tuple(
        (owner, name, plan.param_of[(id(owner), name)])
        for owner in _with_descendants(module)
        for name in plan.views.get(id(owner), ())
        if (id(owner), name) in plan.param_of
    )


def _tensor_state(modules: tuple[nn.Module, ...]) -> tuple[tuple[int, str, int, int], ...]:
    """(module id, name, tensor id, version) of the tensors the modules' forwards may read besides trainable
    parameters: a scale in a buffer or a frozen parameter changed in place, or a tensor attribute replaced."""
    state = []
    for m in modules:
        held = (
            *m._parameters.items(),
            *m._buffers.items(),
            *((k, v) for k, v in vars(m).items() if isinstance(v, Tensor)),
        )
        state += [(id(m), k, id(t), t._version) for k, t in held if t is not None and not t.requires_grad]
    return tuple(state)


def _same_dict(now: object, then: dict) -> bool:
    return type(now) is dict and now.keys() == then.keys() and all(_same(now[k], v) for k, v in then.items())


def _descendants_hooked(module: nn.Module) -> bool:
    """Whether hooks may change what the module's descendants compute inside its forward: any of theirs (a hook's
    own state is not seen), or a global forward hook or pre-hook (its own pre-hooks change only its inputs, which
    are recorded after them)."""
    if not module._modules:
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules() if m is not module)


def _positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A call's inputs as positional arguments of its forward (a reference forward takes them so): keyword
    arguments put in their places, defaults filled in between; as given where they do not bind."""
    if not kwargs:
        return args
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return args or tuple(kwargs.values())
    bound.apply_defaults()
    return bound.args if not bound.kwargs else args or tuple(kwargs.values())


class _Paused:
    """The scope of `Recorder.paused` (a class: entered once per layer call in the norm pass)."""

    __slots__ = ("_recorder",)

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def __enter__(self) -> None:
        self._recorder._paused = True

    def __exit__(self, *exc: object) -> None:
        self._recorder._paused = False


class _Hook:
    """The forward hook of one module. Copying or pickling a model while attached (copy.deepcopy, torch.save)
    copies its hooks: the copy gets an inert hook, so it is plain PyTorch and holds none of the engine's state."""

    def __init__(self, recorder: Recorder, before: bool = False) -> None:
        self.recorder, self.is_pre_hook = recorder, before

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, *output: object) -> None:
        if self.is_pre_hook:
            self.recorder.before(module, args, kwargs)
        else:
            self.recorder.record(module, args, kwargs, output[0])

    def __reduce__(self) -> tuple:
        return (_inert_hook, ())


def _inert_hook() -> Callable[..., None]:
    return _ignore


def _ignore(*_: object) -> None:
    return None


_PLAIN_LEAVES = (Tensor, int, float, bool, str, type(None))


def _tensor_leaves(tree: object) -> list[Tensor]:
    """The tensors among `tree`'s pytree leaves, in pytree order; a tensor, and a tuple or list of tensors and
    plain values, without pytree's walk (this runs at every layer call)."""
    if isinstance(tree, Tensor):
        return [tree]
    if type(tree) in (tuple, list, dict) and not tree:
        return []
    if type(tree) in (tuple, list) and all(isinstance(x, _PLAIN_LEAVES) for x in tree):
        return [x for x in tree if isinstance(x, Tensor)]
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def _edge(t: Tensor) -> GradientEdge:
    """`get_gradient_edge(t)`, without its Python steps for a tensor computed by a built-in node. torch's own
    function finds a leaf's gradient accumulator, and holds a custom Function's node alive with a token."""
    node = t.grad_fn
    if node is None or isinstance(node, torch._C._FunctionBase):
        return get_gradient_edge(t)
    return GradientEdge(node, t.output_nr)


def _distinct_slots(leaves: list[Tensor]) -> list[int]:
    """The positions of the output tensors that require grad, each tensor once (an output may hold the same
    tensor twice, e.g. a last hidden state also returned among all hidden states): a gradient is taken once."""
    seen: set[int] = set()
    slots = []
    for i, t in enumerate(leaves):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            slots.append(i)
    return slots


def _tensors_of(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def as_called(attributes: tuple[tuple[nn.Module, dict[str, object]], ...]) -> contextlib.AbstractContextManager:
    """Inside, each module holds the attributes it held at a call (`Call.attributes`); those changed since are put
    back afterwards. A module that sets its convolution's dilation per input size and restores it after the call,
    or a scale changed between the forward and the backward, is counted as it computed."""
    changed = [change for module, then in attributes for change in _changed(module, then)]
    return _Restoring(changed) if changed else _UNCHANGED


class _Restoring:
    def __init__(self, changed: list[tuple[nn.Module, str, object, object]]) -> None:
        self.changed = changed

    def __enter__(self) -> None:
        for module, name, then, _ in self.changed:
            setattr(module, name, then)

    def __exit__(self, *exc: object) -> None:
        for module, name, _, now in self.changed:
            if now is _ABSENT:  # (deleted since the call: deleted again)
                delattr(module, name)
            else:
                setattr(module, name, now)


_UNCHANGED = contextlib.nullcontext()
#: an attribute a module no longer holds
_ABSENT = object()


def _configurations(module: nn.Module) -> tuple[tuple[nn.Module, dict[str, object]], ...]:
    """`_attributes` of the module and its descendants."""
    return tuple((m, _attributes(m)) for m in _with_descendants(module))


def _with_descendants(module: nn.Module) -> tuple[nn.Module, ...]:
    """The module and its descendants (without `modules()`'s walk for a module without children)."""
    return tuple(module.modules()) if module._modules else (module,)


#: attribute types that are not a module's configuration: its parameters', buffers', children's and hooks' dicts
_CONTAINERS = (dict, set, collections.OrderedDict)


def _attributes(module: nn.Module) -> dict[str, object]:
    """A module's own attributes but its parameters, buffers, children and hooks (dicts and sets) and tensors held
    as plain attributes (wrappers such as FSDP swap a module's parameters in and out as those): its configuration (a
    convolution's dilation, padding and padding mode, a norm's eps, an embedding's padding index, `training`),
    lists copied."""
    return {
        k: list(v) if type(v) is list else v
        for k, v in vars(module).items()
        if type(v) not in _CONTAINERS and not isinstance(v, Tensor)
    }


def _changed(module: nn.Module, then: dict[str, object]) -> list[tuple[nn.Module, str, object, object]]:
    """(module, name, value then, value now) for each attribute of `then` the module holds no more."""
    now = vars(module)
    values = ((k, v, now.get(k, _ABSENT)) for k, v in then.items())
    return [(module, k, v, value) for k, v, value in values if not _same(value, v)]


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor):
        return False  # (a tensor where a plain value was)
    try:
        return bool(a == b)
    except Exception:  # a value without a plain equality
        return False


def _default_device() -> torch.device | None:
    device = torch.get_default_device()
    return None if device.type == "cpu" else device


def _autocast_state(device_type: str) -> tuple[str, torch.dtype] | None:
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _check_call(site: Site, args: tuple, kwargs: dict, output: object) -> None:
    """What the site's rule needs of one call: its own check, and one output tensor for a simple rule."""
    rule = site.match.rule
    reason = rule.check_call(site.module, args, kwargs) if rule.check_call else None
    if reason:
        raise FlashDPError(f"Layer {site.label}: {reason}")
    if rule.per_call:
        return
    if not isinstance(output, Tensor):
        raise FlashDPError(f"Layer {site.label} returned {type(output).__name__}; its rule expects one output tensor.")
    if output.requires_grad and output.dim() == 0:
        raise FlashDPError(f"Layer {site.label} returned a scalar; expected a batched output [B, ...].")


def _hideable(output: Tensor) -> bool:
    """Whether a later in-place op on `output` could re-route the graph around its recorded edge: only on a view
    whose edge is its own (on any other tensor, the in-place op's node leads to the recorded one)."""
    return output._base is not None and _reshape_base(output) is output


def _reshape_base(output: Tensor) -> Tensor:
    """The tensor `output` is a contiguous reshape of, if any; else `output`. Never a leaf (a parameter): its edge,
    the parameter's gradient accumulator, sums every use of the parameter, not those of this output alone (and no
    in-place op can re-route the graph around a view of a leaf that requires grad: torch refuses it)."""
    base = output._base
    if (
        base is not None
        and base.requires_grad
        and base.grad_fn is not None
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
    ):
        return base
    return output


#: rows of each input (dim 0) the probe of a module's forward keeps
_PROBE_ROWS = 2


@torch.no_grad()  # entirely: inside a checkpointed region, a saved tensor would break the recomputation
def _scale_of_its_rule(site: Site, reference: Callable, inputs: tuple, output: object, probes: dict) -> float | None:
    """For a module matched by duck typing, or overriding its class's forward: the constant c with output =
    c * (its rule's forward) (1 when it computes exactly that; e.g. sqrt(d) for Gemma's scaled embedding), or
    None when it computes something else. Checked on its first call, while its parameters are as the call saw
    them, and again on parameters and inputs of its own drawing: a match that holds only for the current values
    (`(1 + w) * x_hat` is twice `w * x_hat` while w = 1) is no match."""
    try:
        expected = reference(site.module, inputs)
    except Exception:  # a forward with another signature or input type: not the rule's function
        return None
    scale = _scale_between(output, expected)
    if scale is None:
        return None
    key = _probe_key(site, reference, inputs)  # (None: this module's probe is its own, never kept)
    probe_scale = probes[key] if key in probes else _probe_scale(site, reference, inputs)
    if key is not None:
        probes[key] = probe_scale
    if probe_scale is None or abs(probe_scale - scale) > _FORWARD_CHECK_TOLERANCE[torch.float64] * abs(scale):
        return None
    return scale


def _probe_scale(site: Site, reference: Callable, inputs: tuple) -> float | None:
    """The scale between the module's forward and its rule's on values of the probe's drawing, or None."""
    try:
        probed, probe_expected = _on_probe_values(site, reference, inputs)
    except Exception:  # its forward fails on other values: not the rule's function
        return None
    return _scale_between(probed, probe_expected)


#: attribute values a module's probe verdict may be keyed on (anything else: the module is probed alone)
_PLAIN_ATTRIBUTES = (bool, int, float, str, type(None))


def _probe_key(site: Site, reference: Callable, inputs: tuple) -> Hashable | None:
    """What the probe's verdict depends on, for a module whose forward is a function of its class's code, plain
    attributes, trainable parameters (drawn at random by shape) and inputs (by shape): modules alike in all of them
    (a model's 33 RMSNorms) share one probe. None (probe this module alone) for a module with children, frozen
    floating tensors or integer inputs (their values enter the probe), or attributes other than plain values."""
    module = site.module
    frozen = any(t.is_floating_point() and name not in site.trainable for name, t in _tensors_of(module))
    kept = any(isinstance(x, Tensor) and not x.is_floating_point() for x in inputs)  # the probe keeps their values
    if frozen or kept or next(module.children(), None) is not None:
        return None
    attributes = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    if not all(isinstance(v, _PLAIN_ATTRIBUTES) for v in attributes.values()):
        return None
    params = tuple((name, tuple(attribute(module, name).shape)) for name in sorted(site.trainable))
    shapes = tuple(
        (tuple(x.shape[1:]), x.dtype) if isinstance(x, Tensor) else type(x) for x in inputs
    )  # rows beyond the probe's are cut: dim 0 does not enter
    return (type(module), reference, tuple(sorted(attributes.items())), params, shapes)


def _on_probe_values(site: Site, reference: Callable, inputs: tuple) -> tuple[object, object]:
    """The module's forward and its rule's reference forward in float64, on random trainable parameters and random
    floating inputs (integer inputs such as token ids kept), without hooks and without touching the module. Inputs
    keep at most `_PROBE_ROWS` rows of their dim 0: the probe costs a sliver of the call's memory."""
    generators: dict[torch.device, torch.Generator] = {}

    def draw(t: Tensor) -> Tensor:
        """Drawn where `t` lives (a CUDA input of `[2, T, d]` drawn on the host took seconds per module at long
        T), from a generator seeded alike on every device kind."""
        device = t.device if t.device.type == "cuda" else torch.device("cpu")
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(0)
        return torch.randn(t.shape, generator=generators[device], dtype=torch.float64, device=device).to(t.device)

    rows = tuple(x[:_PROBE_ROWS] if isinstance(x, Tensor) and x.dim() > 1 else x for x in inputs)
    probe_inputs = tuple(draw(x) if isinstance(x, Tensor) and x.is_floating_point() else x for x in rows)
    holder = _Probe(site.module, reference)
    values = {f"module.{name}": draw(attribute(site.module, name)) for name in site.trainable}
    values |= {
        f"module.{n}": t.double()
        for n, t in _tensors_of(site.module)
        if n not in site.trainable and t.is_floating_point()
    }
    return torch.func.functional_call(holder, values, probe_inputs)


class _Probe(nn.Module):
    """Runs a module's own forward (no hooks) and its rule's reference forward on the same parameters."""

    def __init__(self, module: nn.Module, reference: Callable) -> None:
        super().__init__()
        self.module, self.reference = module, reference

    def forward(self, *inputs: object) -> tuple[object, object]:
        return self.module.forward(*inputs), self.reference(self.module, inputs)


def _output_scale(output: object, expected: object) -> float | None:
    """`_scale_between` of an output and its expected value, or of every tensor in them (a tuple of outputs):
    the one scale all of them share, or None."""
    if isinstance(output, Tensor):
        return _scale_between(output, expected)
    leaves, expected_leaves = tree_leaves(output), tree_leaves(expected)
    if len(leaves) != len(expected_leaves):
        return None
    pairs = list(zip(leaves, expected_leaves, strict=True))
    scales = {_scale_between(a, b) for a, b in pairs if isinstance(a, Tensor) or isinstance(b, Tensor)}
    return scales.pop() if len(scales) == 1 else None


def _scale_between(output: object, expected: object) -> float | None:
    """The constant c with output = c * expected, within the forward check's tolerance, or None."""
    if not isinstance(output, Tensor) or not isinstance(expected, Tensor) or expected.shape != output.shape:
        return None
    # in the outputs' dtype, at least float32 (float64 copies of a batch's outputs cost more than the layer's forward)
    dtype = torch.promote_types(torch.promote_types(output.dtype, expected.dtype), torch.float32)
    out, ref = output.reshape(-1).to(dtype), expected.reshape(-1).to(dtype)
    scale = float(torch.dot(out, ref) / torch.dot(ref, ref).clamp_min(torch.finfo(dtype).tiny))
    if not math.isfinite(scale):
        return None
    residual = torch.linalg.vector_norm(torch.add(out, ref, alpha=-scale))
    error = float(residual / torch.linalg.vector_norm(out).clamp_min(torch.finfo(dtype).tiny))
    tolerance = _FORWARD_CHECK_TOLERANCE.get(rounding_dtype(output), 3e-2)
    if not (error <= tolerance and scale != 0):
        return None
    return 1.0 if abs(scale - 1) <= tolerance else scale
