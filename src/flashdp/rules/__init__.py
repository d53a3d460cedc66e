"""Per-layer rules: pure functions from a layer's inputs and output gradient to per-sample gradients.

Importing this package registers the built-in rules.
"""

from flashdp.per_sample import DeferredOuterGrad, OuterGrad, PerSampleGrad, TokenRows
from flashdp.rules import activations, attention, conv, embedding, experts, linear, normalization, recurrent
from flashdp.rules.registry import Rule, RuleMatch, find_rule, register_rule

__all__ = [
    "DeferredOuterGrad",
    "OuterGrad",
    "PerSampleGrad",
    "Rule",
    "RuleMatch",
    "TokenRows",
    "activations",
    "attention",
    "conv",
    "embedding",
    "experts",
    "find_rule",
    "linear",
    "normalization",
    "recurrent",
    "register_rule",
]
