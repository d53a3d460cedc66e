"""Ghost's and flash's two backwards must compute bit-identical output gradients: the second pass takes each
layer's clipped sum from the gradients its norms were measured from. On CUDA, cuDNN's convolutions, flash
attention's dQ and the index_add_ behind index_select's backward sum in whatever order atomics land, so the two
passes differed and the sums of whole models were refused (measured on an H100: every CNN, wav2vec2, Longformer
and Llama-shaped models). Their two passes run under torch's deterministic kernels; whether the passes agreed is
still checked by the fingerprints of the second pass (`guards.check_loss`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flashdp.errors import FlashDPError

#: torch refuses deterministic mode's matmuls unless this names a fixed cuBLAS workspace; torch gives each
#: (handle, stream) a workspace of its own, and both passes run on one stream, so their matmuls already agree
_CUBLAS_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
_NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"


def needs_identical_passes(device: torch.device) -> bool:
    """Whether backwards on `device` can differ run to run (CUDA's atomics and cuDNN's algorithms)."""
    return device.type == "cuda"


@contextmanager
def identical_passes(device: torch.device, runs_twice: bool) -> Iterator[None]:
    """Run the body (a backward's passes) under `torch.use_deterministic_algorithms(True)` where the engine runs two
    backwards on a device whose kernels may differ between runs; the user's settings are restored after."""
    if not (runs_twice and needs_identical_passes(device)):
        yield
        return
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    fill = torch.utils.deterministic.fill_uninitialized_memory
    cublas = os.environ.get(_CUBLAS_CONFIG)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # (NaN-filling every empty tensor: time, no use here)
    if cublas is None:
        os.environ[_CUBLAS_CONFIG] = ":4096:8"
    try:
        yield
    except RuntimeError as error:
        if _NO_DETERMINISTIC_KERNEL not in str(error):
            raise
        raise FlashDPError(
            f"mode='ghost' and 'flash' run two backwards that must compute the same gradients, so on CUDA flashdp "
            f"runs them with torch.use_deterministic_algorithms(True); this model's backward has a kernel without "
            f"a deterministic implementation ({error}). Use mode='bk' (one backward)."
        ) from error
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        if cublas is None:
            os.environ.pop(_CUBLAS_CONFIG, None)
