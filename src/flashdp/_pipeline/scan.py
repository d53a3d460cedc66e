"""What `make_private` learns of a model once: its trainable layers, their rules, and the clipping groups."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from torch import nn

from flashdp._pipeline.params import ParamView, ParamViews, TrainableParam, local_param_views
from flashdp.errors import FlashDPError
from flashdp.rules import RuleMatch, find_rule

#: Layer types whose output for one sample depends on the other samples of the batch.
SAMPLE_MIXING = (nn.modules.batchnorm._BatchNorm,)


@dataclass(frozen=True)
class Layer:
    """A module that owns trainable parameters, and the rule that gives their per-sample gradients."""

    path: str
    module: nn.Module
    match: RuleMatch
    #: names of its own trainable parameters, in registration order: the same on every rank, as the order of
    #: per-parameter collectives must be (a set's order varies with each process's string hashing)
    trainable: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"'{self.path or '<root>'}' ({type(self.module).__name__})"


@dataclass(frozen=True)
class ModelScan:
    layers: list[Layer]
    params: list[TrainableParam]
    #: a name per clipping group (the path of its first layer)
    clip_group_names: list[str]
    #: (id(module), parameter name) -> the parameter as registered at make_private. Wrappers such as FSDP2 swap
    #: the objects registered on a module (sharded / unsharded), so a module and a name identify a parameter.
    param_of: dict[tuple[int, str], TrainableParam]


def scan_model(model: nn.Module, param_views: ParamViews = local_param_views) -> ModelScan:
    """Find every trainable layer and its rule; fail loudly on anything that cannot be clipped exactly."""
    _refuse_sample_mixing(model)
    layers, problems = [], []
    owners: dict[Hashable, list[int]] = {}  # parameter key -> indices of the layers that own it
    names: dict[Hashable, tuple[str, ParamView]] = {}
    key_of: dict[tuple[int, str], Hashable] = {}
    for path, module in model.named_modules():
        own = param_views(module)
        if not own:
            continue
        match = find_rule(module)
        problem = _coverage_problem(path, module, match, own)
        if problem:
            problems.append(problem)
            continue
        for name, view in own.items():
            owners.setdefault(view.key, []).append(len(layers))
            names.setdefault(view.key, (f"{path}.{name}" if path else name, view))
            key_of[(id(module), name)] = view.key
        layers.append(Layer(path, module, match, tuple(own)))
    if problems:
        raise FlashDPError(
            "flashdp cannot compute exact per-sample gradients for these trainable parameters:\n  - "
            + "\n  - ".join(problems)
            + "\nFreeze them (p.requires_grad_(False)), or teach flashdp the layer with "
            "flashdp.register_rule(LayerType, per_sample_grads) before make_private."
        )
    if not layers:
        raise FlashDPError(
            "The model has no trainable parameters (none with requires_grad=True): nothing to train privately."
        )
    clip_group_of_layer = _union_groups(len(layers), owners.values())
    params = {
        key: TrainableParam(name, view.tensor, clip_group_of_layer[owners[key][0]], key, view.shape)
        for key, (name, view) in names.items()
    }
    clip_group_names = [""] * (max(clip_group_of_layer) + 1)
    for layer, clip_group in zip(layers, clip_group_of_layer, strict=True):
        clip_group_names[clip_group] = clip_group_names[clip_group] or layer.path
    param_of = {where: params[key] for where, key in key_of.items()}
    return ModelScan(layers, list(params.values()), clip_group_names, param_of)


def _refuse_sample_mixing(model: nn.Module) -> None:
    mixing = [f"'{p}' ({type(m).__name__})" for p, m in model.named_modules() if isinstance(m, SAMPLE_MIXING)]
    if mixing:
        raise FlashDPError(
            f"{', '.join(mixing)}: BatchNorm mixes samples (its batch statistics make each output depend on the "
            "whole batch), so per-sample gradients, and DP-SGD's guarantee, do not exist for it. Replace it with "
            "nn.GroupNorm or nn.LayerNorm (e.g. GroupNorm(min(32, C), C))."
        )


def _coverage_problem(path: str, module: nn.Module, match: RuleMatch | None, own: dict[str, ParamView]) -> str | None:
    where = f"'{path or '<root>'}' ({type(module).__module__}.{type(module).__qualname__})"
    if match is None:
        return f"{where}: parameters {sorted(own)} have no per-sample gradient rule"
    covered = set(own) if match.rule.params is None else set(match.rule.params)
    if set(own) - covered:
        return f"{where}: parameters {sorted(set(own) - covered)} are not covered by rule {match.rule.name}"
    reason = match.rule.check(module) if match.rule.check else None
    return f"{where}: {reason}" if reason else None


def _union_groups(count: int, shared: Iterable[list[int]]) -> list[int]:
    """Clipping group per layer: layers that share a parameter are one group (numbered by first layer)."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for indices in shared:
        for other in indices[1:]:
            parent[root(other)] = root(indices[0])
    numbering: dict[int, int] = {}
    return [numbering.setdefault(root(i), len(numbering)) for i in range(count)]
