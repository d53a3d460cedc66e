"""Every `.grad` write during engine.backward is flashdp's own.

The norm pass computes no parameter gradient, and bk writes its clipped sums itself, after it; ghost and flash let
autograd fill `.grad` only in their second pass, and only for the parameters whose norms were counted. Anything
else that writes a trainable parameter's `.grad` meanwhile (a custom `autograd.Function` whose backward calls
`.backward()` itself, as reversible layers do; a hook that assigns or adds to a `.grad`; a `.backward()` inside the
forward) adds a gradient that no norm saw.

Each watched region records every parameter's gradient as it finds it: the tensor and its version counter, which
every in-place change bumps. Autograd's own accumulation is seen by a hook just before it (`register_hook`, where
the gradient must still be as last seen, and is kept to be restored) and one just after
(`register_post_accumulate_grad_hook`: refused outside the allowed parameters, else the new state is the one
expected). At the end of the region every gradient must be as last seen. A refused region puts back what it can:
the gradient as it was before autograd's first write, or the tensor that was replaced; a gradient changed in place
by a foreign write is cleared (that removes signal, never adds any). Outside a region the hooks return at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

from torch import Tensor

from flashdp._pipeline.provenance import quoted_names
from flashdp.errors import FlashDPError

#: a gradient as found: the tensor and its version, or None
_State = tuple[Tensor, int] | None


class GradWrites:
    """Watches the trainable parameters `{name: parameter}` (leaves) for `.grad` writes in `refusing` regions."""

    def __init__(self, params: dict[str, Tensor]) -> None:
        self._params = {id(p): (name, p) for name, p in params.items() if p.is_leaf}
        #: ids of the parameters autograd may write now; None outside a watched region
        self._allowed: Collection[int] | None = None
        #: each parameter's gradient as last seen (at the region's start, or after autograd's write)
        self._seen: dict[int, _State] = {}
        #: the gradient to put back, and its version then: as found at the start, or a copy kept just before
        #: autograd's first foreign write
        self._restore: dict[int, _State] = {}
        self._foreign: list[int] = []
        #: within `capturing`: autograd's passes return gradients and write no `.grad`
        self._capturing = False
        self._handles: list[Any] = []
        for key, (_, p) in self._params.items():
            self._handles.append(p.register_hook(lambda grad, key=key: self._before_autograd(key)))
            self._handles.append(p.register_post_accumulate_grad_hook(lambda _, key=key: self._after_autograd(key)))
        self._own_hooks = {handle.id for handle in self._handles}

    def check_no_gradient_hooks(self) -> None:
        """Refuse gradient hooks on the watched parameters other than these: a hook on a parameter's gradient
        (`register_hook`, `register_post_accumulate_grad_hook`) runs around autograd's accumulation, where no watch
        can order itself before or after every other hook; it would change ghost's clipped sum after clipping, or be
        skipped by bk, which writes `.grad` itself."""
        hooked = [
            name
            for name, p in self._params.values()
            if set(p._backward_hooks or ()) - self._own_hooks
            or set(p._post_accumulate_grad_hooks or ()) - self._own_hooks
        ]
        if hooked:
            raise FlashDPError(
                f"Parameters {quoted_names(hooked)} have a gradient hook (Tensor.register_hook or "
                "register_post_accumulate_grad_hook) that flashdp did not add. It would change their gradient "
                "outside per-sample clipping (ghost and flash fill .grad through autograd after clipping), or be "
                "skipped (bk writes .grad itself). Remove the hook; transform activations' gradients instead, or the "
                "per-sample losses."
            )

    @contextlib.contextmanager
    def refusing(self, allowed: Collection[Tensor] = ()) -> Iterator[None]:
        """Refuse every write into the watched parameters' `.grad` meanwhile, except autograd's accumulation into
        the `allowed` ones (ghost's second backward fills the counted ones). On a foreign write: `.grad` put back
        (see the module docstring) and FlashDPError raised, naming the parameters."""
        self._allowed = {id(p) for p in allowed}
        self._seen = {key: _state(p.grad) for key, (_, p) in self._params.items()}
        self._restore = dict(self._seen)
        self._foreign = []
        try:
            yield
        finally:
            self._allowed = None
            for key, (_, p) in self._params.items():
                if not _same(_state(p.grad), self._seen[key]):
                    self._mark(key)
            foreign, restore = self._foreign, self._restore
            self._seen, self._restore, self._foreign = {}, {}, []
            for key in foreign:
                self._put_back(key, restore[key])
        if foreign:
            raise _foreign_write_error([self._params[key][0] for key in foreign])

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Within a refusing region: flashdp's own `autograd.grad` passes over the parameters (the self-check), in
        which autograd writes no `.grad`, so none is copied to be put back. A foreign write meanwhile is still
        refused, its gradient cleared where it was changed in place (a copy of every `.grad` would double their
        memory on a self-checked step)."""
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_autograd(self, key: int) -> None:
        if self._allowed is None:
            return
        grad = self._params[key][1].grad
        if not _same(_state(grad), self._seen[key]):  # written by something else since
            self._mark(key)
        elif key not in self._allowed and key not in self._foreign and not self._capturing:  # about to be: keep it
            self._restore[key] = _state(None if grad is None else grad.detach().clone())

    def _after_autograd(self, key: int) -> None:
        if self._allowed is None:
            return
        if key not in self._allowed:
            self._mark(key)
        self._seen[key] = _state(self._params[key][1].grad)

    def own_write(self, param: Tensor, write: Callable[[], None]) -> None:
        """flashdp's own change of `param.grad` by `write()` within a refusing region (a clipped sum added): not
        foreign; a change since the last one seen still is."""
        key = id(param)
        watched = self._allowed is not None and key in self._seen
        if watched and not _same(_state(param.grad), self._seen[key]):
            self._mark(key)
        write()
        if watched:
            self._seen[key] = _state(param.grad)

    def _mark(self, key: int) -> None:
        if key not in self._foreign:
            self._foreign.append(key)

    def _put_back(self, key: int, before: _State) -> None:
        """The gradient as it was, where that is known: a tensor changed in place since is cleared instead."""
        self._params[key][1].grad = before[0] if before is not None and before[0]._version == before[1] else None


def _state(grad: Tensor | None) -> _State:
    return None if grad is None else (grad, grad._version)


def _same(a: _State, b: _State) -> bool:
    """The same tensor at the same version (identity, not values: no tensor is read)."""
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] == b[1]


def _foreign_write_error(names: list[str]) -> FlashDPError:
    return FlashDPError(
        f"During engine.backward, something other than flashdp wrote to the .grad of {quoted_names(names)}: a "
        "gradient that no per-sample norm counted. Likely cause: a custom torch.autograd.Function whose backward "
        "calls .backward() or torch.autograd.backward itself (reversible layers, e.g. HF Reformer), a hook that "
        "assigns or adds to a .grad, or a .backward() inside the model's forward. Compute those layers' gradients "
        "through autograd's graph (a plain forward, or torch.utils.checkpoint with use_reentrant=False) and leave "
        ".grad to flashdp. Their .grad was put back as it was before this backward (or cleared where it was changed "
        "in place)."
    )
