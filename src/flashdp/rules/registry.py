"""Which rule computes a layer's per-sample gradients: by type (walking the MRO) or by a predicate."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor, nn

from flashdp.per_sample import LayerCall, PerSampleGrad

#: `(module, inputs, grad_output, trainable) -> {param name: per-sample grad}`.
#: inputs: the positional inputs of one forward call (batch first); grad_output: `[B, ...]` gradient of the sum
#: of per-sample losses w.r.t. that call's output; trainable: the module's own parameter names to compute.
PerSampleGradsFn = Callable[[nn.Module, tuple, Tensor, frozenset[str]], Mapping[str, PerSampleGrad]]

#: `call -> {param name: per-sample grad}`: the form for rules that need keyword inputs, several outputs, the
#: parameters as the call held them, or a batch dim other than 0 (`per_call=True`).
PerCallGradsFn = Callable[[LayerCall], Mapping[str, PerSampleGrad]]

#: `(module, inputs) -> output`: the forward a rule assumes, to check a module really computes it.
ReferenceForward = Callable[[nn.Module, tuple], Tensor]

#: `module -> reason it is not supported, or None`.
SupportCheck = Callable[[nn.Module], str | None]


@dataclass(frozen=True)
class Rule:
    """What flashdp needs of one layer type."""

    per_sample_grads: PerSampleGradsFn | PerCallGradsFn
    #: the parameters the rule counts, by name relative to the module (descendants' too, e.g. "out_proj.weight");
    #: None: all of the module's own parameters
    params: tuple[str, ...] | None = None
    reference_forward: ReferenceForward | None = None
    check: SupportCheck | None = None
    #: per_sample_grads takes the whole `LayerCall`
    per_call: bool = False
    #: `module -> dim` of the batch in the call's inputs and output (e.g. 1 for time-major recurrent layers)
    batch_dim: Callable[[nn.Module], int] | None = None

    @property
    def name(self) -> str:
        return getattr(self.per_sample_grads, "__qualname__", repr(self.per_sample_grads))


@dataclass(frozen=True)
class RuleMatch:
    """A rule found for one module, and the forward to verify it against (None: nothing to verify).

    A module matched by a predicate, or whose class overrides `forward` of the registered type, is checked once
    against the rule's reference forward before its gradients are trusted.
    """

    rule: Rule
    verify_with: ReferenceForward | None
    #: the module computes `output_scale` times its rule's forward (e.g. a scaled embedding): its output gradient
    #: is scaled so before the rule sees it
    output_scale: float = 1.0


_TYPE_RULES: dict[type, Rule] = {}
_PREDICATE_RULES: list[tuple[Callable[[nn.Module], bool], Rule]] = []


def register_rule(
    layer: type[nn.Module] | Callable[[nn.Module], bool],
    per_sample_grads: PerSampleGradsFn,
    *,
    params: tuple[str, ...] | None = None,
    reference_forward: ReferenceForward | None = None,
    check: SupportCheck | None = None,
    per_call: bool = False,
    batch_dim: Callable[[nn.Module], int] | None = None,
) -> None:
    """Teach flashdp the per-sample gradients of a layer type. (Without a rule, a module gets the generic one:
    per-sample gradients by `torch.func`; a rule is a faster path.)

    Args:
        layer: a module class (subclasses match too; the most specific registration wins) or a predicate
            `module -> bool` for duck-typed layers (the latest registered predicate is tried first).
        per_sample_grads: `(module, inputs, grad_output, trainable) -> {name: grad}`. `inputs` are the call's
            positional inputs, `grad_output` the `[B, ...]` gradient w.r.t. its output; return, for each name in
            `trainable`, either the per-sample gradients `[B, *param.shape]` or a `flashdp.rules.OuterGrad`.
        params: names of the parameters the rule covers, relative to the module (default: all of its own);
            a descendant's parameter the module's forward uses directly may be listed too ("out_proj.weight").
        reference_forward: `(module, inputs) -> output`, the forward the rule assumes. Predicate-matched modules
            are checked against it on their first call (default for classes: the class's own `forward`, checked
            when a subclass overrides it).
        check: `module -> reason or None`, for configurations the rule cannot handle.
        per_call: per_sample_grads takes one `flashdp.per_sample.LayerCall` (keyword inputs, several outputs,
            the parameters as the call held them) instead of `(module, inputs, grad_output, trainable)`.
        batch_dim: `module -> dim` of the batch in the call's inputs and output, when not 0 (time-major layers).

    Example:
        >>> def scale_grads(module, inputs, grad_output, trainable):
        ...     (x,) = inputs
        ...     return {"scale": (x * grad_output).flatten(1).sum(1, keepdim=True)}
        >>> flashdp.register_rule(MyScale, scale_grads)
    """
    rule = Rule(per_sample_grads, params, reference_forward, check, per_call, batch_dim)
    if isinstance(layer, type):
        if not issubclass(layer, nn.Module):
            raise TypeError(f"register_rule: expected an nn.Module subclass or a predicate, got class {layer!r}.")
        _TYPE_RULES[layer] = rule
    elif callable(layer):
        _PREDICATE_RULES.insert(0, (layer, rule))
    else:
        raise TypeError(f"register_rule: expected an nn.Module subclass or a predicate, got {type(layer)!r}.")


def _class_forward(cls: type[nn.Module]) -> ReferenceForward:
    def forward(module: nn.Module, inputs: tuple) -> Tensor:
        return cls.forward(module, *inputs)

    return forward


def find_rule(module: nn.Module) -> RuleMatch | None:
    """The rule for `module`, or None when no registration matches."""
    cls = type(module)
    for base in cls.__mro__:
        rule = _TYPE_RULES.get(base)
        if rule is not None:
            if cls.forward is base.forward:
                return RuleMatch(rule, None)
            return RuleMatch(rule, rule.reference_forward or _class_forward(base))
    for predicate, rule in _PREDICATE_RULES:
        if predicate(module):
            return RuleMatch(rule, rule.reference_forward)
    return None
