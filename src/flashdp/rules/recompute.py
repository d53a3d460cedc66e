"""What the rules that re-run a layer's forward share: the autocast region it ran in, the check that the re-run
gives the recorded output, and the refusal of calls they cannot take apart by sample."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from flashdp._scoped import Scoped
from flashdp.errors import FlashDPError
from flashdp.per_sample import LayerCall, rounding_dtype

#: Relative error allowed between a recorded output and its recomputation (which may round differently), by the
#: dtype whose rounding it carries (`rounding_dtype`; 16-bit: 3e-2)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}

#: a check left on the device: `[]` bool (passed), and the error to raise if it did not
DeferredCheck = tuple[Tensor, Callable[[], Exception]]
_deferred: contextvars.ContextVar[list[DeferredCheck] | None] = contextvars.ContextVar("flashdp_deferred", default=None)


def deferring_checks(into: list[DeferredCheck]) -> Scoped[list[DeferredCheck] | None]:
    """Inside, `check_recomputed` leaves its verdict in `into` instead of waiting for the device: the caller reads
    them all with one sync (`raise_failed`) before anything depends on the recomputations. Entered on the thread
    that runs the rules (autograd's own, on CUDA)."""
    return Scoped(_deferred, into)


def raise_failed(checks: list[DeferredCheck], passed: list[bool] | None = None) -> None:
    """Raise the first failed check's error; `passed`: the checks' verdicts if already read (else one sync)."""
    if passed is None:
        passed = torch.stack([ok for ok, _ in checks]).tolist() if checks else []
    for (_, error), ok in zip(checks, passed, strict=True):
        if not ok:
            raise error()


def as_in_the_forward(call: LayerCall) -> contextlib.AbstractContextManager:
    """The autocast region the call ran in, and the default device it ran under: a re-run inside the backward
    (where `torch.set_default_device`'s mode is off) makes its tensors where the forward made them."""
    context = contextlib.ExitStack()
    if call.autocast is not None:
        device_type, dtype = call.autocast
        context.enter_context(torch.autocast(device_type, dtype=dtype))
    if call.default_device is not None:
        context.enter_context(call.default_device)
    return context


@contextlib.contextmanager
def replayed_random_state(call: LayerCall) -> Iterator[None]:
    """Inside: the random number generators as the call found them (its recomputation draws the same dropout
    masks); after: as they were."""
    state = call.rng_state
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[state.device] if state.cuda is not None else []):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, state.device)
        yield


def check_recomputed(label: str, recorded: Tensor | None, again: Tensor, how: str) -> None:
    """Raise unless `again` (the output recomputed `how`) equals the recorded output, up to rounding.
    recorded None: not kept (nothing to compare)."""
    if recorded is None:
        return
    if recorded.shape != again.shape:
        raise FlashDPError(
            f"flashdp recomputed {label}'s output {how} and got shape {tuple(again.shape)}, not the recorded "
            f"{tuple(recorded.shape)}: its batch is not where its rule expects it. Register a rule for its type "
            "with flashdp.register_rule(...)."
        )
    tolerance = _TOLERANCE.get(rounding_dtype(recorded), 3e-2)
    scale = recorded.detach().double().norm().clamp_min(1e-30)
    error = (again.detach().double() - recorded.detach().double()).norm() / scale
    failure = functools.partial(_recomputed_differently, label, how, error)
    deferred = _deferred.get()
    if deferred is not None:
        deferred.append((error <= tolerance, failure))
    elif not bool(error <= tolerance):
        raise failure()


def _recomputed_differently(label: str, how: str, error: Tensor) -> FlashDPError:
    return FlashDPError(
        f"flashdp recomputed {label}'s output {how} and got another result (relative difference "
        f"{float(error):.2g}). The evidence cannot tell these causes apart: (0) its output was modified in place "
        "after it returned (ReLU(inplace=True), `out += x`): make that operation out of place (flashdp.fix_model("
        "model) turns off inplace=True on every module); (1) its forward is random (dropout in "
        "training mode): make it deterministic (eval(), or dropout 0); (2) it keeps state between calls: reset "
        "it, or freeze its parameters; (3) it mixes samples: compute each sample's output from that sample "
        "alone; (4) an input that is not per-sample has the batch size B in its first dim by coincidence (a "
        "pooled or relative-position length, a table of B rows) and was split as one row per sample: use a batch "
        "size that differs from those lengths, or register a rule for its type with flashdp.register_rule(...)."
    )


def require_own_batch(call: LayerCall, what: str) -> None:
    """A rule that takes a call apart by sample needs the call's own batch: refuse outputs shared across the
    batch and batches folded into rows."""
    if any(call.shared) or call.rows_per_sample != 1:
        how = "a batch folded into rows" if call.rows_per_sample != 1 else "a batch of 1 broadcast over the batch"
        raise FlashDPError(
            f"{what} {call.label} was called on {how}, which its rule cannot take apart by sample. Call it on the "
            "batch itself (one row per sample), or freeze its parameters."
        )
