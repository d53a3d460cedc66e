"""How a trainable parameter is identified, whatever wraps the model (a leaf of the pipeline)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ParamView:
    """A module's trainable parameter as its wrapper presents it (whole, a shard, or a view into a flat buffer)."""

    #: what the module holds now
    tensor: Tensor
    #: equal for one parameter shared by several modules (tied weights): their contributions are summed
    key: Hashable
    #: the full, unsharded shape, which per-sample gradients have
    shape: torch.Size


#: a module's own trainable parameters by name, as the wrapper around the model presents them
ParamViews = Callable[[nn.Module], dict[str, ParamView]]


def local_param_views(module: nn.Module) -> dict[str, ParamView]:
    """Parameters registered on the module itself (also FSDP2's DTensors, whose shape is the full one)."""
    return {
        name: ParamView(p, id(p), p.shape)
        for name, p in module._parameters.items()
        if p is not None and p.requires_grad
    }


@dataclass(frozen=True)
class TrainableParam:
    """A trainable parameter, once, with its name and its clipping group (layers sharing it form one group)."""

    name: str
    param: Tensor
    clip_group: int
    key: Hashable
    shape: torch.Size


def attribute(module: nn.Module, dotted_name: str) -> Tensor:
    """A parameter by dotted name relative to `module`, also where a wrapper holds it as a plain tensor attribute
    (FSDP1)."""
    if "." not in dotted_name:
        return getattr(module, dotted_name)
    for part in dotted_name.split("."):
        module = getattr(module, part)
    return module
