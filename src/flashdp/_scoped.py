"""A context variable set for the body of a `with` block."""

from __future__ import annotations

import contextvars
from typing import Generic, TypeVar

T = TypeVar("T")


class Scoped(Generic[T]):
    """`with Scoped(var, value):` sets `var` to `value` inside, and back after. A class rather than a generator
    context manager: the norm pass enters these once per layer call, where a generator's few microseconds add up
    on models of many small layers."""

    __slots__ = ("_token", "_value", "_var")

    def __init__(self, var: contextvars.ContextVar[T], value: T) -> None:
        self._var, self._value = var, value

    def __enter__(self) -> None:
        self._token = self._var.set(self._value)

    def __exit__(self, *exc: object) -> None:
        self._var.reset(self._token)
