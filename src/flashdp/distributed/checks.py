"""Checks that catch a distributed set-up which would clip or average wrongly, with what to do instead."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from flashdp.errors import FlashDPError, another_rank_refused

#: a global batch less likely than this under Poisson sampling with the declared mean is called a mistake
IMPLAUSIBLE = 1e-9


def check_norm_group(norm_group: dist.ProcessGroup, data_parallel: dist.ProcessGroup | None) -> None:
    """The norm group must split samples, not hold different ones: it may share at most one rank with the
    data-parallel group (each rank of which holds other samples)."""
    if data_parallel is None:
        return
    shared = set(dist.get_process_group_ranks(norm_group)) & set(dist.get_process_group_ranks(data_parallel))
    if len(shared) > 1:
        raise FlashDPError(
            f"norm_group shares ranks {sorted(shared)} with the model's data-parallel group (DDP / FSDP), whose ranks "
            "hold different samples: summing their squared norms would clip each sample by the norm of several. "
            "Pass as norm_group only the tensor-parallel group that splits each sample's computation, or none."
        )


def check_same_samples(loss: Tensor, norm_group: dist.ProcessGroup) -> None:
    """Ranks of a tensor-parallel group compute the same samples, so the same per-sample losses `[B]`."""
    sizes = torch.tensor([loss.shape[0], -loss.shape[0]], dtype=torch.int64, device=loss.device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=norm_group)
    same_size = int(sizes[0]) == -int(sizes[1]) == loss.shape[0]
    if same_size:
        gathered = [torch.empty_like(loss) for _ in range(dist.get_world_size(norm_group))]
        dist.all_gather(gathered, loss.detach().contiguous(), group=norm_group)
        if all(torch.allclose(other, gathered[0], rtol=1e-3, atol=1e-5) for other in gathered):
            return
    raise FlashDPError(
        "The ranks of norm_group computed different per-sample losses (or batch sizes), so they hold different "
        "samples: norm_group must be the tensor-parallel group whose ranks split the same samples' computation. "
        "For data parallelism pass no norm_group: norms are local to the rank holding the sample."
    )


def check_same_settings(settings: dict[str, object], group: dist.ProcessGroup | None) -> None:
    """Every data-parallel rank clips, noises and accounts alike: make_private's settings (all but the seed, which
    a rank may derive its own from) compared across the ranks, once, when the engine is built."""
    if group is None:
        return
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, settings, group=group)
    differing = [name for name in settings if any(other[name] != ranks[0][name] for other in ranks)]
    if differing:
        values = "; ".join(f"{name}: {[other[name] for other in ranks]}" for name in differing)
        raise FlashDPError(
            f"make_private was given different settings on different ranks ({values}, by rank): every rank must "
            "clip by the same bound, add the same noise and account the same sampling, or the epsilon describes "
            "none of them. Pass the same arguments on every rank."
        )


def check_global_batch(
    expected_batch_size: int, local_samples: int, group: dist.ProcessGroup, refusal: FlashDPError | None = None
) -> None:
    """The samples of one step, summed over the data-parallel ranks, against `expected_batch_size`; and this rank's
    `refusal` of the step, raised on every rank (in the same all-reduce: one rank raising alone would leave the
    others waiting in it)."""
    total = for_backend(torch.tensor([local_samples, refusal is not None], dtype=torch.float64, device="cpu"), group)
    dist.all_reduce(total, group=group)
    summed, refused = total.tolist()
    if refused:
        raise refusal or another_rank_refused("step")
    samples, mean = int(summed), float(expected_batch_size)
    # Chernoff bound on a Poisson(mean) batch: P(X >= n) <= exp(-mean) (e mean / n)^n for n > mean
    if samples > mean and -mean + samples * (1 + math.log(mean / samples)) < math.log(IMPLAUSIBLE):
        world = dist.get_world_size(group)
        raise FlashDPError(
            f"This step's batch has {samples} samples over {world} ranks, implausibly many for "
            f"expected_batch_size={expected_batch_size}: it looks per-rank. expected_batch_size is the GLOBAL "
            f"logical batch (all ranks, all micro-batches of a step), e.g. {world} x your per-rank batch."
        )


def raise_on_every_rank(
    error: FlashDPError | None, group: dist.ProcessGroup | None, device: torch.device | None, flags: list[int] = ()
) -> list[int]:
    """Raise this rank's `error` (None: none) on every rank of `group` together: a check that fails on one rank's
    data alone (a non-finite loss) would leave the others waiting in the next collective. The same all-reduce
    agrees on `flags` (the highest any rank holds), returned."""
    if group is None:
        if error is not None:
            raise error
        return list(flags)
    refused, *agreed = highest_on_any_rank([error is not None, *flags], group, device or torch.device("cpu"))
    if refused:
        raise error or another_rank_refused()
    return agreed


def highest_on_any_rank(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Each of `values`, the highest any rank of `group` holds (one small all-reduce; as given with no group).
    Ranks must take the same decisions (verify or not, redo a pass or not, refuse or not): a pass one rank runs
    alone hangs the others in its collectives, and a layout one rank learns alone is wrong on the others."""
    if group is None:
        return values
    flags = for_backend(torch.tensor(values, dtype=torch.int64, device="cpu"), group, device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.tolist()


def for_backend(tensor: Tensor, group: dist.ProcessGroup, device: torch.device | None = None) -> Tensor:
    """`tensor` where the group's collectives take it: on a CUDA device under NCCL (`device` if it is one)."""
    if dist.get_backend(group) != "nccl":
        return tensor
    return tensor.to(device if device is not None and device.type == "cuda" else torch.device("cuda"))
