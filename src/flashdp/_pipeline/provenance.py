"""Gradients reach the optimizer only through engine.backward.

A gradient that did not come from `engine.backward` (a plain `loss.backward()` after make_private, a stale `.grad`
left from before it, a gradient clipped or rescaled by the caller) must not be noised and stepped as if it were
private. Two guards, at no cost to a step:

- fingerprints: after every `engine.backward`, each accumulated gradient's identity and version counter (bumped
  by every in-place change); `engine.backward` and `engine.step` refuse to go on if one changed since, unless it
  was cleared (None or zeros: that removes signal, never adds any). The first backward of a step likewise refuses
  a non-zero gradient it did not produce.
- a global pre-hook on every optimizer's `step()` (`register_optimizer_step_pre_hook`), which refuses a step over
  the model's trainable parameters not taken by `engine.step()` (it adds no noise), whether or not that optimizer
  was given to make_private.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from flashdp.errors import FlashDPError

#: (name, the tensor holding this rank's accumulated gradient, or None)
Gradients = Sequence[tuple[str, Tensor | None]]


class GradientProvenance:
    def __init__(self, guarded: nn.Module | None) -> None:
        """guarded: the model whose trainable parameters no optimizer may step outside `engine.step()` (None: no
        such guard, for per-sample norms without training)."""
        #: name -> (gradient, its version) as engine.backward left it; None: no backward since the last step.
        #: The tensors themselves, not their ids: a freed gradient's id may be reused by a foreign one.
        self._fingerprints: dict[str, tuple[Tensor, int] | None] | None = None
        self._stepping = False
        self._guarded = weakref.ref(guarded) if guarded is not None else None
        self._key = next(_KEYS)  # (not id(self): a collected guard's id may be reused by another's)
        if guarded is not None:
            _GUARDS[self._key] = self
            _hook_every_optimizer_step()
            weakref.finalize(guarded, _GUARDS.pop, self._key, None)  # (a model collected without detach: unwatched)

    def refusal_before_backward(self, gradients: Gradients, collective: bool) -> FlashDPError | None:
        """Why engine.backward must not add to these gradients (raised here), or None. `collective` (DDP, FSDP):
        returned instead, for every rank to raise together at the ranks' agreement of the backward (one rank
        raising alone would leave the others waiting in their next collective)."""
        return _raised_unless(collective, self._refusal(gradients))

    def _refusal(self, gradients: Gradients) -> FlashDPError | None:
        foreign = self._foreign(gradients)
        if foreign and self._fingerprints is None:
            return FlashDPError(
                f"Parameters {quoted_names(foreign)} already have a gradient that engine.backward did not produce "
                "(left from a plain loss.backward(), or from before make_private). It would be noised and stepped as "
                "if it were private. Clear it first: optimizer.zero_grad() or model.zero_grad()."
            )
        return _changed_error(foreign, "engine.backward") if foreign else None

    def refusal_before_step(self, gradients: Gradients, collective: bool) -> FlashDPError | None:
        """Why engine.step must not noise these gradients (raised here), or None; `collective`: returned instead,
        as `refusal_before_backward`."""
        foreign = self._foreign(gradients)
        return _raised_unless(collective, _changed_error(foreign, "engine.step") if foreign else None)

    def record(self, gradients: Gradients) -> None:
        """After engine.backward: the gradients as it left them."""
        self._fingerprints = {name: _fingerprint(g) for name, g in gradients}

    def stepped(self) -> None:
        self._fingerprints = None

    @contextlib.contextmanager
    def engine_step(self) -> Iterator[None]:
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def remove(self) -> None:
        _GUARDS.pop(self._key, None)

    def _foreign(self, gradients: Gradients) -> list[str]:
        """Non-zero gradients not as engine.backward left them."""
        known = self._fingerprints or {}
        return [
            name
            for name, g in gradients
            if g is not None and not _same(known.get(name), g) and bool(_local(g).detach().any())
        ]

    def _refuse_foreign_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        model = self._guarded() if self._guarded is not None else None
        if self._stepping or model is None:
            return
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        stepped = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) in trainable)
        if stepped:
            raise FlashDPError(
                f"optimizer.step() was called directly after make_private, on an optimizer holding {stepped} of the "
                "model's trainable parameters: that step adds no noise and is not accounted, so it is not private. "
                "Give the optimizer to make_private(..., optimizer=opt), call engine.backward(per_sample_losses), "
                "then engine.step() (which calls optimizer.step() and optimizer.zero_grad() itself)."
            )


#: every engine's guard, all seen by ONE global optimizer pre-hook. (A hook per engine, removed when its model was
#: collected, could be removed by the garbage collector while torch iterated over the hooks of another optimizer's
#: step: "OrderedDict mutated during iteration", seen once in CI.)
_GUARDS: dict[int, GradientProvenance] = {}
_KEYS = itertools.count()


@functools.cache  # registered once per process
def _hook_every_optimizer_step() -> RemovableHandle:
    return register_optimizer_step_pre_hook(_refuse_foreign_steps)


def _refuse_foreign_steps(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for guard in list(_GUARDS.values()):  # (a snapshot: a guard may go while this runs)
        guard._refuse_foreign_step(optimizer, args, kwargs)


def _raised_unless(collective: bool, refusal: FlashDPError | None) -> FlashDPError | None:
    """`refusal`, raised here unless every rank raises it together (`collective`); None passes."""
    if refusal is not None and not collective:
        raise refusal
    return refusal


def _changed_error(names: list[str], where: str) -> FlashDPError:
    return FlashDPError(
        f"The gradients of {quoted_names(names)} changed between engine.backward and {where}: a plain "
        "loss.backward() or an in-place change (gradient clipping, rescaling). Only engine.backward may produce "
        "the gradients engine.step noises; post-processing them before the noise breaks the privacy guarantee. "
        "Remove that call."
    )


def _local(g: Tensor) -> Tensor:
    """This rank's part of a gradient (a DTensor's local shard: `any()` on the DTensor would be a collective)."""
    to_local = getattr(g, "to_local", None)
    return g if to_local is None else to_local()


def _fingerprint(g: Tensor | None) -> tuple[Tensor, int] | None:
    return None if g is None else (g, g._version)


def _same(fingerprint: tuple[Tensor, int] | None, g: Tensor) -> bool:
    return fingerprint is not None and fingerprint[0] is g and fingerprint[1] == g._version


def quoted_names(names: list[str]) -> str:
    """Up to five names, quoted, and how many more: for messages naming parameters."""
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
