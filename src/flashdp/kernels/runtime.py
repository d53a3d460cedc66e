"""Where Triton can run, and which backend the engine asked for (a context variable set around each backward)."""

from __future__ import annotations

import contextvars
import functools
import os
from typing import Literal

import torch
from torch import Tensor

from flashdp._scoped import Scoped

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
#: Input dtypes the kernels take (they accumulate in float32); float64 always uses the torch reference.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_backend: contextvars.ContextVar[str] = contextvars.ContextVar("flashdp_kernels", default="torch")


def interpreter() -> bool:
    """Triton runs kernels on the CPU through its interpreter (set before triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_unavailable_reason() -> str | None:
    """Why Triton kernels cannot run on this machine, or None when they can."""
    if not triton_importable():
        return "the triton package is not installed (pip install triton; Linux only)"
    if not (torch.cuda.is_available() or interpreter()):
        return "there is no CUDA device, and TRITON_INTERPRET=1 (Triton's CPU interpreter, for testing) is not set"
    return None


def backend(name: str) -> Scoped[str]:
    """Inside `with backend(name):`, the kernel table uses backend `name`."""
    return Scoped(_backend, name)


def use_triton(*tensors: Tensor, auto: bool = True) -> bool:
    """Whether the current backend sends these inputs to a Triton kernel: inputs of one kernel dtype (`tl.dot` takes
    operands of one dtype; mixed inputs go to the reference, which widens both exactly). `auto`: whether backend
    "auto" takes the kernel for CUDA tensors (False for a kernel measured slower than its reference on GPUs)."""
    name = _backend.get()
    dtypes = {t.dtype for t in tensors}
    if name == "torch" or len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES):
        return False
    if name == "triton":
        return True
    return auto and triton_importable() and all(t.is_cuda for t in tensors)
