"""Make a model trainable with per-sample clipping: the layers that mix samples or hide gradients, replaced."""

from __future__ import annotations

import math

from torch import nn

#: channels per GroupNorm group at most: the group count is the largest divisor of C up to this
MAX_GROUPS = 32


def fix_model(model: nn.Module) -> nn.Module:
    """Change `model` in place so that flashdp can clip it, and return it. Build the optimizer afterwards.

    - BatchNorm2d/3d and SyncBatchNorm -> GroupNorm with `gcd(C, 32)` groups; BatchNorm1d -> GroupNorm with one
      group (a LayerNorm over the C features of a `[B, C]` input, where C groups would each hold one value).
      Affine as the BatchNorm was. A batch norm in training mixes the samples of a batch, so no per-sample
      gradient exists. The running statistics are dropped: a pre-trained network's normalisation changes.
    - InstanceNorm with `track_running_stats=True` stops tracking (the running statistics mix samples in training).
    - Modules computing in place (`inplace=True`: ReLU, Dropout, ...) compute out of place: an in-place op on a
      layer's output overwrites it, and the gradient flashdp reads there with it.

    In-place ops written in a forward (`x += y`, `F.relu(x, inplace=True)`) cannot be changed from outside: flashdp
    names the layer whose output they overwrite.
    """
    for name, child in list(model.named_children()):
        replacement = _fixed(child)
        if replacement is not child:
            setattr(model, name, replacement)
        fix_model(replacement)
    return model


def _fixed(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        channels = module.num_features
        reference = module.weight if module.affine else next(iter(module.buffers()), None)
        return nn.GroupNorm(
            1 if isinstance(module, nn.BatchNorm1d) else math.gcd(channels, MAX_GROUPS),
            channels,
            eps=module.eps,
            affine=module.affine,
            device=reference.device if reference is not None else None,
            dtype=reference.dtype if reference is not None else None,
        )
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        module.track_running_stats = False
        module.running_mean = module.running_var = module.num_batches_tracked = None
    if getattr(module, "inplace", None) is True:
        module.inplace = False
    return module
