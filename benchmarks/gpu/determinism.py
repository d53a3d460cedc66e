"""Which CUDA kernels differ between torch's default and deterministic modes, against float64 on the CPU.

Ghost and flash take each layer's clipped sum from a second backward that must reproduce the norm pass's output
gradients bit for bit. On an H100 (torch 2.11, cuDNN 9.19) the default kernels broke that for every CNN
(cuDNN's algorithms); running both passes under `torch.use_deterministic_algorithms(True)` made them agree, but a
float64 CNN with reflect padding then got gradients 0.5-1.3% away from the default kernels' (and the oracle's)
on 3x3 images. This names the kernel: each part's gradient in each mode, its relative distance from the same
computation in float64 on the CPU. And whether attention's backward repeats under each mode.

    python benchmarks/gpu/determinism.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

#: (CPU where no GPU is: the script's own smoke test)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def kernels(mode: str) -> Iterator[None]:
    """ "default", "deterministic" (torch's flag, uninitialised memory NaN-filled), "deterministic-nofill",
    "cudnn" (cuDNN's deterministic algorithms alone)."""
    cudnn, fill = torch.backends.cudnn, torch.utils.deterministic.fill_uninitialized_memory
    if mode.startswith("deterministic"):
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = mode == "deterministic"
    try:
        with cudnn.flags(cudnn.enabled, cudnn.benchmark, deterministic=mode == "cudnn", allow_tf32=False):
            yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _parts() -> dict[str, Callable[[Tensor, Tensor], Tensor]]:
    """name -> (x, w) -> output; its gradient wrt x (and w) is compared."""
    return {
        "reflect pad": lambda x, w: F.pad(x, (1, 1, 1, 1), mode="reflect"),
        "conv2d": lambda x, w: F.conv2d(x, w, padding=1),
        "reflect pad + conv2d": lambda x, w: F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w),
        "zeros pad + conv2d + tanh": lambda x, w: F.conv2d(x, w, padding=1).tanh(),
    }


def _grads(part: Callable[[Tensor, Tensor], Tensor], x: Tensor, w: Tensor, g_seed: int) -> Tensor:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = part(x, w)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed), dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad(out, (x, w), g, allow_unused=True)
    return torch.cat([t.flatten() for t in grads if t is not None])


def convolutions() -> None:
    for side in (2, 3, 4, 6):
        x = torch.randn(2, 8, side, side, dtype=torch.float64)
        w = torch.randn(8, 8, 3, 3, dtype=torch.float64)
        for name, part in _parts().items():
            oracle = _grads(part, x, w, side)
            row = []
            for mode in ("default", "deterministic", "deterministic-nofill", "cudnn"):
                with kernels(mode):
                    got = _grads(part, x.to(DEVICE), w.to(DEVICE), side).cpu()
                row.append(f"{mode} {float((got - oracle).norm() / oracle.norm()):.1e}")
            print(f"{side}x{side} {name}: " + ", ".join(row))


def attention() -> None:
    """Whether dQ repeats between two backwards over one forward, per mode of the forward and of the backwards."""
    q, k, v = (torch.randn(2, 8, 512, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True) for _ in range(3))
    mask = torch.ones(512, 512, dtype=torch.bool, device=DEVICE).tril()
    for masked in (False, True):
        for forward_mode in ("default", "deterministic"):
            with kernels(forward_mode):
                if masked:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            g = torch.randn_like(out)
            row = []
            for backward_mode in ("default", "deterministic"):
                with kernels(backward_mode):
                    a, b = (torch.autograd.grad(out, q, g, retain_graph=True)[0] for _ in range(2))
                row.append(f"{backward_mode} backwards equal {torch.equal(a, b)}")
            mask_name = "attn_mask" if masked else "is_causal"
            print(f"sdpa {mask_name}, forward {forward_mode} ({out.grad_fn.name()}): " + ", ".join(row))


if __name__ == "__main__":
    print(
        torch.__version__,
        "cuDNN",
        torch.backends.cudnn.version(),
        torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
    )
    convolutions()
    attention()
