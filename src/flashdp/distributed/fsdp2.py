"""FSDP2 (`fully_shard`): parameters are DTensors sharded on dim 0 over a 1-D mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.profiling import PhaseTimer
from flashdp.distributed.sharded import ShardedAdapter, refuse_hybrid_sharding
from flashdp.errors import FlashDPError
from flashdp.per_sample import accumulation_dtype


def _param_group(module: FSDPModule) -> object | None:
    """The unit's FSDPParamGroup (None: it holds no parameters): FSDP2's own record of its parameters."""
    return module._get_fsdp_state()._fsdp_param_group


def _divide_factor(module: FSDPModule, world_size: int) -> float | None:
    """The factor a unit's reduce-scatter divides by (None: the unit holds no parameters)."""
    group = _param_group(module)
    if group is None:
        return None
    return float(world_size if group.gradient_divide_factor is None else group.gradient_divide_factor)


def _refuse_unsharded(model: nn.Module) -> None:
    """Every trainable parameter must be sharded by some unit: flashdp reduce-scatters and noises shards."""
    unsharded = [name for name, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    if unsharded:
        raise FlashDPError(
            f"Under FSDP2 flashdp needs every trainable parameter sharded by fully_shard; these are not: "
            f"{', '.join(unsharded[:8])}{' ...' if len(unsharded) > 8 else ''}. Apply fully_shard to the root "
            "module too (after its submodules, as FSDP2's examples do): the parameters outside every sharded "
            "submodule then belong to the root's unit. Or freeze them."
        )


def is_fsdp2(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


class FSDP2Adapter(ShardedAdapter):
    """The norm pass runs with `set_requires_gradient_sync(False)`; the ghost second pass lets FSDP2
    reduce-scatter (its mean, or what its divide factor says: the loss is scaled by that factor); bk sums are
    reduce-scattered into the shards unit by unit; each rank noises its own shard with its own generator.
    """

    swaps_parameters = True

    def __init__(self, model: nn.Module, timer: PhaseTimer) -> None:
        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        _refuse_unsharded(model)
        mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh  # (frozen ones may not be)
        refuse_hybrid_sharding("FSDP2", mesh.ndim)
        # each parameter's unit: the innermost FSDPModule holding it
        self._unit_index: dict[int, int] = {}
        for unit, module in enumerate(self.fsdp_modules):
            for p in module.parameters():
                self._unit_index[id(p)] = unit  # inner units come later in modules() order and overwrite
        self._params = {id(p): p for p in model.parameters()}
        trainable: list[list[Hashable]] = [[] for _ in self.fsdp_modules]
        for pid, p in self._params.items():  # (the model's parameter order: the same on every rank)
            if p.requires_grad and pid in self._unit_index:
                trainable[self._unit_index[pid]].append(pid)
        super().__init__(timer, mesh.get_group(), trainable)
        self._fsdp_params: dict[int, object] | None = None  # (`_fsdp_param_of`, when first asked)

    def named_parameters(self, model: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """Also each unit's unsharded parameters, swapped in for the forward and out after it: the leaves of its
        graph. A weight used outside every recorded call holding it (`F.linear(x, layer.weight)` on a step where
        the layer itself is not called) is found by them, not missed."""
        registered = list(model.named_parameters())
        yield from registered
        names = {id(p): name for name, p in registered}
        for module in self.fsdp_modules:
            group = _param_group(module)
            for param in group.fsdp_params if group is not None else ():
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    yield names.get(id(param.sharded_param), param._module_info.param_name), unsharded

    def holds_own(self, param: TrainableParam, tensor: object) -> bool:
        """The unit's unsharded parameter, swapped in for the forward (one tensor, kept from forward to forward);
        before the unit's first all-gather, the sharded parameter itself (a module of a unit never gathered holds
        no other of its own: a breaker's call with another layer's weight there was taken for the module's)."""
        own = getattr(self._fsdp_param_of().get(id(param.param)), "_unsharded_param", None)
        return tensor is (param.param if own is None else own)

    def _fsdp_param_of(self) -> dict[int, object]:
        """id(sharded parameter) -> its FSDPParam (FSDP2's record of it, with its unsharded tensor), once."""
        if self._fsdp_params is None:
            self._fsdp_params = {
                id(fsdp_param.sharded_param): fsdp_param
                for group in map(_param_group, self.fsdp_modules)
                if group is not None
                for fsdp_param in group.fsdp_params
            }
        return self._fsdp_params

    def rerun_error(self, module: nn.Module, label: str) -> FlashDPError | None:
        """A unit of its own: FSDP2's hooks on it would gather its parameters again for a re-run, in place of the
        copies the rule runs with (its per-sample gradients would read 0, a breaker's case)."""
        if not isinstance(module, FSDPModule):
            return None
        return FlashDPError(
            f"Under FSDP2, layer {label} is a unit of its own (fully_shard was applied to it) and its parameters are "
            "counted by a rule that runs its forward again in the backward (the generic rule of a module without a "
            "rule of its own: a parameter used in a matrix product, or one whose per-sample gradient cannot be taken "
            "where it meets the batch). FSDP2's hooks on the unit would run that forward with the parameters they "
            "gather, not the copies the rule differentiates. Apply fully_shard to the module holding this one "
            "instead (its parameters then belong to that unit), or register a rule for its type with "
            "flashdp.register_rule(...)."
        )

    def graph_leaves(self, params: list[TrainableParam]) -> list[Tensor]:
        """The units' unsharded parameters, which the forward used in place of the sharded ones."""
        fsdp_param_of = self._fsdp_param_of()
        return [fsdp_param_of[id(p.param)].unsharded_param for p in params]

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        for module in self.fsdp_modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in self.fsdp_modules:
                module.set_requires_gradient_sync(True, recurse=False)

    @property
    def second_pass_scale(self) -> float:
        """What FSDP2 divides the reduce-scattered gradients by: the world size (their mean), or a unit's
        `set_gradient_divide_factor`, read at every pass (it may be set between steps)."""
        factors = {_divide_factor(m, self.world_size) for m in self.fsdp_modules} - {None}
        if len(factors) > 1:
            raise FlashDPError(
                f"The FSDP2 units divide their reduced gradients by different factors ({sorted(factors)}: "
                "set_gradient_divide_factor on some of them): ghost's second pass scales the loss by one factor "
                "so that the reduction yields each parameter's sum. Set the same factor on every unit, or none."
            )
        return factors.pop() if factors else float(self.world_size)

    def unit_of(self, param: TrainableParam) -> tuple[int, Hashable]:
        return self._unit_index[id(param.param)], id(param.param)

    def zero_sum(self, unit: int, key: Hashable) -> Tensor:
        param = self._params[key]
        return torch.zeros(param.shape, dtype=accumulation_dtype(param), device=param.device)

    def reduce_scatter_unit(self, unit: int, sums: dict[Hashable, Tensor]) -> None:
        """One reduce-scatter for a unit: row r of `send` is rank r's dim-0 chunk of every parameter."""
        dtype = accumulation_dtype(*(self._params[key] for key in sums))  # (the same on every rank)
        chunks = [-(-full.shape[0] // self.world_size) for full in sums.values()]
        blocks = []
        for full, chunk in zip(sums.values(), chunks, strict=True):
            padded = full.new_zeros(chunk * self.world_size, *full.shape[1:], dtype=dtype)
            padded[: full.shape[0]] = full
            blocks.append(padded.reshape(self.world_size, -1))
        send = torch.cat(blocks, dim=1)  # [world, sum of chunk numels]
        received = send.new_empty(send.shape[1])
        self.reduce_scatter(received, send.reshape(-1))
        shards = received.split([b.shape[1] for b in blocks])
        for (pid, full), chunk, shard in zip(sums.items(), chunks, shards, strict=True):
            dtensor = self._params[pid]
            local_rows = max(0, min(chunk, full.shape[0] - self.rank * chunk))
            local = shard.view(chunk, *full.shape[1:])[:local_rows].to(dtensor.dtype)
            if dtensor.grad is None:
                dtensor.grad = DTensor.from_local(
                    local.contiguous(), dtensor.device_mesh, dtensor.placements, shape=dtensor.shape,
                    stride=dtensor.stride(),
                )  # fmt: skip
            else:
                dtensor.grad.to_local().add_(local)

    def local_grad(self, param: Tensor) -> Tensor:
        return param.grad.to_local()

    def accumulated_gradients(self, params: list[TrainableParam]) -> list[tuple[str, Tensor | None]]:
        """The DTensor gradients themselves: an in-place change to one (`p.grad.add_`, `clip_grad_norm_`) bumps
        its version, not its local tensor's (DTensor runs the local op below the version counting)."""
        return [(p.name, p.param.grad) for p in params]
