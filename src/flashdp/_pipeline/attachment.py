"""What an engine hooks into a model, and its removal: the recorder's forward hooks, the gradient guards
(provenance, `.grad` writes), the claim on the hooked modules and the wrapper's changes."""

from __future__ import annotations

import weakref

from torch import nn

from flashdp._pipeline import guards
from flashdp._pipeline.grad_writes import GradWrites
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.profiling import PhaseTimer
from flashdp._pipeline.provenance import GradientProvenance
from flashdp._pipeline.recorder import Recorder
from flashdp.distributed import Adapter
from flashdp.errors import FlashDPError


class Attachment:
    """The hooks of `engine` on `model`. A training engine lives until `detach()`: the model's hooks hold it, so
    dropping the engine (`flashdp.make_private(model, ...)` as a statement) never re-opens non-private training;
    model and engine are collected together. An engine that only measures (trains=False) is released with its
    hooks when dropped."""

    def __init__(
        self, engine: object, model: nn.Module, plan: GradientPlan, adapter: Adapter, timer: PhaseTimer, trains: bool
    ) -> None:
        self._modules = [site.module for site in plan.sites.values()]
        guards.claim(self._modules, engine, {id(site.module): site.label for site in plan.sites.values()})
        adapter.attach()
        swapping = adapter.reshards_after_forward  # (a wrapper swapping parameters in for the forward, and out)
        holds_own = adapter.holds_own if swapping else None
        self.recorder = Recorder(plan, timer.forward_started, holds_own, adapter.rerun_error)
        self.provenance = GradientProvenance(model if trains else None)
        # (under FSDP the registered parameters are not the ones autograd accumulates into)
        watched = {} if swapping else {p.name: p.param for p in plan.params}
        self.grad_writes = GradWrites(watched)
        tables = guards.FrozenTables(model, {id(m) for m in self._modules})
        self._detach = _Detacher((self.recorder, self.provenance, self.grad_writes, tables), adapter, self._modules)
        if trains:
            self.recorder.owner = engine
        else:
            weakref.finalize(engine, self._detach)

    def recorder_if_attached(self) -> Recorder:
        if not self._detach.alive:
            raise FlashDPError("This engine was detached; call flashdp.make_private(model, ...) again.")
        return self.recorder

    def detach(self) -> None:
        self._detach()


class _Detacher:
    """Removes every hook and restores what was changed on a wrapper, once (no reference to the engine: it also
    runs when an engine that only measures is garbage-collected)."""

    def __init__(self, hooks: tuple, adapter: Adapter, modules: list) -> None:
        """hooks: the objects whose `remove()` takes their hooks off the model (recorder, provenance, ...)."""
        self._parts: tuple | None = (hooks, adapter, modules)

    @property
    def alive(self) -> bool:
        return self._parts is not None

    def __call__(self) -> None:
        if self._parts is None:
            return
        hooks, adapter, modules = self._parts
        self._parts = None
        for part in hooks:
            part.remove()
        adapter.detach()
        guards.release(modules)
