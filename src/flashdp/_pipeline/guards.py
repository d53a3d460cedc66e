"""Checks of what the engine is given, at the earliest point each can fail: the loss, the optimizer, a model
whose parameters changed since make_private, a model another engine is attached to, and a frozen embedding table
set to renormalise its rows."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection, Iterable

import torch
from torch import Tensor, nn

from flashdp.errors import FlashDPError
from flashdp.rules.embedding import RENORM_LEAK, labelled_tables

#: module -> the engine (weakly) whose hooks record it: one engine per module at a time
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def claim(modules: Iterable[nn.Module], engine: object, label: dict[int, str]) -> None:
    """Register `engine` as the one recording these modules; refuse modules a live engine records already."""
    modules = list(modules)
    taken = [label[id(m)] for m in modules if (owner := _ATTACHED.get(m)) is not None and owner() is not None]
    if taken:
        raise FlashDPError(
            f"Another engine is attached to this model (it records {', '.join(taken[:3])}): two engines would "
            "clip each forward twice. Call engine.detach() on the first one (or use it) before make_private again."
        )
    for m in modules:
        _ATTACHED[m] = weakref.ref(engine)


def release(modules: Iterable[nn.Module]) -> None:
    for m in modules:
        _ATTACHED.pop(m, None)


class TrainableParams:
    """The model's trainable parameters at make_private, by name and identity: changing them later (toggling
    requires_grad, load_state_dict(assign=True), assigning a new Parameter) would leave the engine clipping and
    noising tensors the model no longer uses. Identity is not checked under a wrapper that swaps parameter objects
    in its forward (FSDP2)."""

    def __init__(self, model: nn.Module, check_identity: bool = True) -> None:
        self.model = model
        self.check_identity = check_identity
        self._params = self._current()

    def _current(self) -> dict[str, Tensor]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def check_unchanged(self) -> None:
        current = self._current()
        if current.keys() != self._params.keys():
            raise FlashDPError(
                "The model's trainable parameters changed since make_private (requires_grad toggled or parameters "
                "added). Call engine.detach() and flashdp.make_private(model, ...) again, then "
                "new_engine.load_state_dict(engine.state_dict()): the privacy spent so far carries over (a new engine "
                "alone counts epsilon from zero)."
            )
        replaced = [name for name, p in current.items() if self.check_identity and p is not self._params[name]]
        if replaced:
            raise FlashDPError(
                f"Parameters {replaced[:5]} were replaced by new tensors since make_private (load_state_dict(..., "
                "assign=True), or a new nn.Parameter assigned): the engine would write gradients to the old ones. "
                "Load weights in place (load_state_dict without assign), or call engine.detach() and make_private "
                "again with an optimizer built over the new parameters, then new_engine.load_state_dict("
                "engine.state_dict()) to carry the privacy spent so far."
            )


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise FlashDPError(
            f"The optimizer holds {foreign} parameter(s) that are not the model's: flashdp clips and noises only "
            "the model's trainable parameters. Build the optimizer from model.parameters()."
        )


def check_loss(loss: object, last_sums: Callable[[], list[tuple[str, Tensor]]] = list) -> Tensor:
    """`loss`, checked: a 1-D tensor of finite per-sample losses that requires grad. `last_sums()`: the last summing
    pass's parameters with whether their gradients were its norm pass's (device bools), read with the same sync:
    raises for any that were not."""
    if not isinstance(loss, Tensor):
        raise FlashDPError(f"engine.backward expects a tensor of per-sample losses. Received {type(loss).__name__}.")
    if loss.dim() != 1:
        raise FlashDPError(
            f"Wrong shape: expected a 1-D loss of shape (B,), one loss per sample. Received a {loss.dim()}-dim "
            f"tensor of shape {tuple(loss.shape)}. Use reduction='none' and reduce all but the batch dim "
            "(e.g. loss.mean(dim=1))."
        )
    if not loss.requires_grad:
        raise FlashDPError("The loss does not require grad: compute it from the model's output with grad enabled.")
    # (a sync, before the forward's calls are taken: a refused loss leaves the forward to a backward on a fixed one)
    finite, summed = torch.isfinite(loss.detach()), last_sums()
    all_finite, *matched = torch.stack([finite.all(), *(m.to(loss.device) for _, m in summed)]).tolist()
    _raise_unmatched(summed, matched)
    if not all_finite:
        bad = torch.nonzero(~finite).flatten().tolist()
        raise FlashDPError(f"Non-finite per-sample losses at batch indices {bad[:20]}: fix them before clipping.")
    return loss


def check_last_sums(last_sums: Callable[[], list[tuple[str, Tensor]]]) -> None:
    """`check_loss`'s check of the last summing pass where no backward follows (the run's end): raises for the
    parameters whose gradients were not its norm pass's (one sync)."""
    summed = last_sums()
    if not summed:
        return
    device = summed[0][1].device
    _raise_unmatched(summed, torch.stack([m.to(device) for _, m in summed]).tolist())


def _raise_unmatched(summed: list[tuple[str, Tensor]], matched: list[bool]) -> None:
    """Raise naming the parameters of `summed` whose flag, read as `matched`, says their gradients were not the
    norm pass's."""
    unmatched = [name for (name, _), ok in zip(summed, matched, strict=True) if not ok]
    if unmatched:
        raise _unmatched_error(unmatched)


def _unmatched_error(names: list[str]) -> FlashDPError:
    return FlashDPError(
        f"The last engine.backward's second pass (ghost and flash run the norm pass again for the clipped sums) "
        f"received other output gradients than its norm pass for {', '.join(repr(n) for n in names[:10])}: their "
        "clipped sums were not added to .grad (a sample could have added more than max_grad_norm), so the last "
        "step went without them. Causes: a backward hook (Tensor.register_hook, a module's backward hook) that "
        "returns another gradient when run again, or a non-deterministic kernel between a layer and the loss "
        "(on CUDA: cuDNN's convolution and attention backwards, flash attention's, atomic index_add_, scatter_add_ "
        "or index_select backwards where rows collide). Use mode='bk' (one backward), make the hook return the same "
        "gradient every time, or call torch.use_deterministic_algorithms(True) before the forward (PyTorch picks "
        "the attention kernel there), with CUBLAS_WORKSPACE_CONFIG=:4096:8."
    )


class FrozenTables:
    """Forward pre-hooks on the model's embedding tables that no rule site watches (frozen ones; a trainable table's
    rule checks its settings at every call): `max_norm` set on one after make_private is refused before its forward
    renormalises, in place, the rows a private batch looks up."""

    def __init__(self, model: nn.Module, watched: Collection[int]) -> None:
        self._handles = [
            table.register_forward_pre_hook(functools.partial(_refuse_max_norm, label))
            for label, table in labelled_tables(model)
            if id(table) not in watched
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _refuse_max_norm(label: str, table: nn.Module, args: tuple) -> None:
    if table.max_norm is not None:
        raise FlashDPError(f"{label}: max_norm {RENORM_LEAK}.")
