"""Which rule computes a layer's per-sample gradients: by type (walking the MRO) or by a predicate."""

from __future__ import annotations

import functools
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

#: `module -> dim of the batch in every output tensor`, or `-> (dim per output tensor, in output order)`.
BatchDim = Callable[[nn.Module], int | tuple[int, ...]]

#: `module -> reason it is not supported, or None`.
SupportCheck = Callable[[nn.Module], str | None]

#: `(module, args, kwargs) -> reason this forward call is not supported, or None`: checked as the call is made.
CallCheck = Callable[[nn.Module, tuple, dict], str | None]


@dataclass(frozen=True)
class Rule:
    """What flashdp needs of one layer type."""

    per_sample_grads: PerSampleGradsFn | PerCallGradsFn
    #: the parameters the rule counts, by name relative to the module (descendants' too, e.g. "out_proj.weight");
    #: None: all of the module's own parameters
    params: tuple[str, ...] | None = None
    reference_forward: ReferenceForward | None = None
    check: SupportCheck | None = None
    check_call: CallCheck | None = None
    #: `module -> whether its next forward draws random numbers` (dropout in training): the random state is then
    #: saved before each call, for the rule to replay the same draws (`LayerCall.rng_state`)
    random: Callable[[nn.Module], bool] | None = None
    #: per_sample_grads takes the whole `LayerCall`
    per_call: bool = False
    #: every dim of the layer's input and output but the last is a position (Linear, LayerNorm, Embedding): a
    #: call with the batch in another dim (time-major) is handed to the rule with the batch moved to dim 0
    position_wise: bool = False
    #: `module -> dim` of the batch in the call's outputs (e.g. 1 for time-major recurrent layers), or a dim per
    #: tensor in the output (`nn.LSTM`'s output, h_n, c_n)
    batch_dim: BatchDim | None = None
    #: the rule recomputes the layer's outputs from the call's inputs and refuses a difference from the recorded
    #: ones (attention, recurrent, generic): what the output is needs no other check
    recomputes: bool = False

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
    #: the forward the rule assumes (verify_with, or for a class's own forward the class's), for checks on a later
    #: call whose output may not be that forward's (a hook, an instance `forward`, changed attributes)
    reference: ReferenceForward | None = None
    #: the class the module had when matched
    layer_type: type[nn.Module] | None = None
    #: the module computes `output_scale` times its rule's forward (e.g. a scaled embedding): its output gradient
    #: is scaled so before the rule sees it
    output_scale: float = 1.0
    #: the batch dim of the module's calls, where it was found to be another than the rule's (a position-wise
    #: rule's layer called time-major)
    batch_dim: int | None = None


_TYPE_RULES: dict[type, Rule] = {}
_PREDICATE_RULES: list[tuple[Callable[[nn.Module], bool], Rule]] = []


def register_rule(
    layer: type[nn.Module] | Callable[[nn.Module], bool],
    per_sample_grads: PerSampleGradsFn,
    *,
    params: tuple[str, ...] | None = None,
    reference_forward: ReferenceForward | None = None,
    check: SupportCheck | None = None,
    check_call: CallCheck | None = None,
    random: Callable[[nn.Module], bool] | None = None,
    per_call: bool = False,
    batch_dim: BatchDim | None = None,
    position_wise: bool = False,
    recomputes: bool = False,
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
        check_call: `(module, args, kwargs) -> reason or None`, for forward calls the rule cannot handle (an
            unbatched input, dropout in training mode): checked in the forward, as the call is made.
        random: `module -> whether its next forward draws random numbers` (dropout in training mode): the random
            number generators' state is then saved before each such call, as `LayerCall.rng_state`, for a
            `per_call` rule that recomputes the forward to replay the same draws (`flashdp.rules.recompute`).
        per_call: per_sample_grads takes one `flashdp.per_sample.LayerCall` (keyword inputs, several outputs,
            the parameters as the call held them) instead of `(module, inputs, grad_output, trainable)`.
        batch_dim: `module -> dim` of the batch in the call's outputs, when not 0 (time-major layers), or a tuple
            of dims, one per tensor of the output in `torch.utils._pytree.tree_leaves` order (`nn.LSTM`: output,
            h_n, c_n). A rule with a batch dim other than 0 should be `per_call`: a simple rule's inputs are batch
            first.
        position_wise: every dim of the input and output but the last is a position (the rule sums over them): a
            call found to have the batch in another dim (a time-major `[T, B, d]` input) is then handed to the rule
            with the batch moved to dim 0, instead of going to the generic rule of an enclosing module.
        recomputes: the rule recomputes the call's outputs from its inputs and raises where they differ from the
            recorded ones (`flashdp.rules.recompute.check_recomputed`); otherwise flashdp compares a call's output
            with `reference_forward` wherever it may not be the layer's (a forward hook run before flashdp's, an
            instance `forward`, an attribute changed since the last check).

    Example:
        >>> def scale_grads(module, inputs, grad_output, trainable):
        ...     (x,) = inputs
        ...     return {"scale": (x * grad_output).flatten(1).sum(1, keepdim=True)}
        >>> flashdp.register_rule(MyScale, scale_grads)
    """
    rule = Rule(
        per_sample_grads,
        params,
        reference_forward,
        check,
        check_call,
        random,
        per_call=per_call,
        position_wise=position_wise,
        batch_dim=batch_dim,
        recomputes=recomputes,
    )
    if isinstance(layer, type):
        if not issubclass(layer, nn.Module):
            raise TypeError(f"register_rule: expected an nn.Module subclass or a predicate, got class {layer!r}.")
        _TYPE_RULES[layer] = rule
    elif callable(layer):
        _PREDICATE_RULES.insert(0, (layer, rule))
    else:
        raise TypeError(f"register_rule: expected an nn.Module subclass or a predicate, got {type(layer)!r}.")


def registered_rules() -> list[tuple[type[nn.Module] | Callable[[nn.Module], bool], Rule]]:
    """Every registration, classes first (in registration order), then predicates (most recent first)."""
    return [*_TYPE_RULES.items(), *_PREDICATE_RULES]


@functools.cache  # one function per class: matches of one class compare equal, and share a probe's verdict
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
            reference = rule.reference_forward or _class_forward(base)
            verify_with = None if cls.forward is base.forward else reference
            return RuleMatch(rule, verify_with, reference, cls)
    for predicate, rule in _PREDICATE_RULES:
        if predicate(module):
            return RuleMatch(rule, rule.reference_forward, rule.reference_forward, cls)
    return None
