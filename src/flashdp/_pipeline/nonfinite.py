"""Per-sample norms that are not finite.

Two causes. A float32 squared norm overflows above a per-sample norm of about 1.8e19, although the gradient is
finite: those parameters' norms are recomputed in float64, so that the sample is clipped to C like any other. A
gradient that is itself NaN or inf (a finite loss whose backward divides by zero, e.g. sqrt at 0) has no norm to
clip: it would turn every parameter into NaN after `step()` and reveal that the sample was in the batch. The policy
then either refuses the backward before any `.grad` changes, naming the samples ("error"), or gives those samples a
zero contribution ("skip"), which keeps each sample's contribution at norm at most C.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from flashdp._pipeline.param_grad import ParamGradient, ParamNorm
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.settings import NonFinite
from flashdp._pipeline.users import UserGroups
from flashdp.errors import FlashDPError

Norms = list[tuple[TrainableParam, ParamNorm]]


def all_finite(norms_sq: Tensor) -> bool:
    """Whether every squared norm is finite (one device sync)."""
    return bool(torch.isfinite(norms_sq).all())


def recompute_overflowed(norms: Norms, gradients: Mapping[Hashable, ParamGradient], batch: int) -> Norms:
    """`norms` with every parameter whose squared norms are not all finite recomputed in float64, from its
    contributions (`gradients`, by parameter key) where given, else from its clipped-sum plan."""
    return [
        (param, norm if all_finite(norm.norm_sq) else _widened(norm, param, gradients, batch)) for param, norm in norms
    ]


def _widened(
    norm: ParamNorm, param: TrainableParam, gradients: Mapping[Hashable, ParamGradient], batch: int
) -> ParamNorm:
    gradient = gradients.get(param.key) or ParamGradient.from_plan(param.name, norm.plan, batch)
    wide = gradient.norm_float64()
    return ParamNorm(wide.norm_sq, norm.strategy, norm.plan, wide.bound_sq)


def nonfinite_samples(
    policy: NonFinite,
    group_norms_sq: Tensor,
    norms: Norms,
    dp_group: dist.ProcessGroup | None,
    finite: bool,
    users: UserGroups | None = None,
) -> Tensor | None:
    """`[B]` True for the samples skipped (policy "skip"), None when there are none; raises FlashDPError under
    "error" when a sample of this rank or (so that every rank stops together) of another is not finite. `finite`:
    this rank's squared norms are known all finite (then nothing is read from the device unless ranks must agree).
    With `users`, a sample is a user (`[U]`)."""
    if finite and (policy == "skip" or dp_group is None):
        return None
    bad = ~torch.isfinite(group_norms_sq).all(0)
    found = bad.any()
    if policy == "error" and dp_group is not None:
        flag = found.to(torch.float32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dp_group)
        found = flag[0] > 0
    if not bool(found):
        return None
    if policy == "skip":
        return bad
    raise _error(bad, norms, users)


def _error(bad: Tensor, norms: Norms, users: UserGroups | None) -> FlashDPError:
    samples = bad.nonzero().flatten().tolist()
    if not samples:
        return FlashDPError(
            "A sample on another rank has a per-sample gradient that is not finite (NaN or inf); every rank stops "
            "this backward together. Nothing was added to .grad."
        )
    params = [param.name for param, norm in norms if not all_finite(norm.norm_sq[bad])]
    if users is None:
        named = [str(i) for i in samples]
        where = f"indices in this batch of {bad.numel()}"
    else:
        named = [users.named(u) for u in samples]
        where = f"user ids, rows of this batch of {users.batch}"
    shown = ", ".join(named[:10]) + (f" and {len(named) - 10} more" if len(named) > 10 else "")
    unit = "sample" if users is None else "user"
    which = f"{unit}s {shown} are" if len(samples) > 1 else f"{unit} {shown} is"
    return FlashDPError(
        f"The per-{unit} gradient of {which} not finite (NaN or inf; {where}), in "
        f"{', '.join(params[:5])}{' ...' if len(params) > 5 else ''}. Nothing was added to .grad. A finite loss "
        "with a non-finite gradient usually comes from sqrt, log, pow or a division at 0 in the model or the loss "
        "(e.g. the sqrt of a sum of squares that is 0). Fix it there, or make_private(..., nonfinite='skip') "
        "(mode='bk') to give such samples a zero contribution."
    )
