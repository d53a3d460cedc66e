"""Every `.grad` write during engine.backward is flashdp's own.

The norm pass computes no parameter gradient, and bk writes its clipped sums itself; ghost and flash let autograd
fill `.grad` only in their second pass, and only for the parameters whose norms were counted. Anything else that
accumulates into a trainable parameter's `.grad` meanwhile (a custom `autograd.Function` whose backward calls
`.backward()` itself, as reversible layers do; a hook; a `.backward()` inside the forward) adds an unclipped
gradient that no norm saw. A post-accumulate-grad hook on each trainable parameter catches such a write where it
happens; a tensor hook, which runs just before it, keeps the gradient as it was, so that a refused backward leaves
nothing in `.grad`. Both return at once outside a watched region: ordinary training pays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

from torch import Tensor

from flashdp.errors import FlashDPError


class GradWrites:
    """Watches the trainable parameters `{name: parameter}` (leaves) for `.grad` writes in `refusing` regions."""

    def __init__(self, params: dict[str, Tensor]) -> None:
        self._params = {id(p): (name, p) for name, p in params.items() if p.is_leaf}
        #: ids of the parameters whose writes are refused now; None outside a watched region
        self._refused: Collection[int] | None = None
        #: each parameter's gradient as it was before the first write in this region (None: it had none)
        self._before: dict[int, Tensor | None] = {}
        self._written: list[int] = []
        self._handles: list[Any] = []
        for key, (_, p) in self._params.items():
            self._handles.append(p.register_hook(lambda grad, key=key: self._keep(key)))
            self._handles.append(p.register_post_accumulate_grad_hook(lambda _, key=key: self._seen(key)))

    @contextlib.contextmanager
    def refusing(self, allowed: Collection[Tensor] = ()) -> Iterator[None]:
        """Refuse every write into the watched parameters' `.grad` meanwhile, except into the `allowed` ones (the
        second backward of ghost and flash fills the counted ones). On a write: `.grad` is restored and
        FlashDPError raised, naming the parameters."""
        allowed_keys = {id(p) for p in allowed}
        self._refused = {key for key in self._params if key not in allowed_keys}
        self._before, self._written = {}, []
        try:
            yield
        finally:
            self._refused = None
            written, before = self._written, self._before
            self._before, self._written = {}, []
            for key in written:
                self._params[key][1].grad = before.get(key)
        if written:
            raise _foreign_write_error([self._params[key][0] for key in written])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _keep(self, key: int) -> None:
        if self._refused is not None and key in self._refused and key not in self._before:
            grad = self._params[key][1].grad
            self._before[key] = None if grad is None else grad.detach().clone()

    def _seen(self, key: int) -> None:
        if self._refused is not None and key in self._refused and key not in self._written:
            self._written.append(key)


def _foreign_write_error(names: list[str]) -> FlashDPError:
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return FlashDPError(
        f"During engine.backward, something other than flashdp wrote to the .grad of {shown}: an unclipped "
        "gradient that no per-sample norm counted. Likely cause: a custom torch.autograd.Function whose backward "
        "calls .backward() or torch.autograd.backward itself (reversible layers, e.g. HF Reformer), a gradient hook "
        "that writes .grad, or a .backward() inside the model's forward. Compute those layers' gradients through "
        "autograd's graph (a plain forward, or torch.utils.checkpoint with use_reentrant=False). Their .grad was "
        "restored to what it was before this backward."
    )
