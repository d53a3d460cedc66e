"""Tile and warp sweep of the bk clipped-sum kernel on a GPU: time, TFLOP/s, registers, spills and error per launch
configuration, next to the dW GEMM of the same shape (needs a GPU).

    python benchmarks/gpu/sweep_clipped_sum.py

The configurations in src/flashdp/kernels/configs.py are chosen from this table (and must compile without spills
for sm_80 and sm_90, which the test suite checks with no GPU).
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
from triton.testing import do_bench

from flashdp.kernels.clipped_sum import reference
from flashdp.kernels.clipped_sum.kernel import _clipped_sum_kernel

SHAPES = ((16, 1024, 2048, 2048), (4, 2048, 4096, 4096), (4, 1024, 14336, 4096))  # B, T, p, d
TILES = ((64, 64, 64), (128, 64, 64), (64, 128, 64), (128, 128, 32), (128, 128, 64), (128, 64, 32), (256, 64, 32))
WARPS_STAGES = ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4))


def run(left, right, coef, tiles, warps, stages):
    b, t, p = left.shape
    d = right.shape[2]
    bp, bd, bt = tiles
    out = torch.empty((1, p, d), device="cuda", dtype=torch.float32)
    grid = (1, triton.cdiv(p, bp), triton.cdiv(d, bd))
    handle = _clipped_sum_kernel[grid](
        left, right, coef, out, b, 1, t, p, d, *left.stride(), *right.stride(),
        BT=bt, BP=bp, BD=bd, UPCAST=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, handle


def sweep(b: int, t: int, p: int, d: int) -> None:
    """One row per launch configuration at this shape."""
    left = torch.randn(b, t, p, device="cuda", dtype=torch.bfloat16)
    right = torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16)
    coef = torch.rand(b, device="cuda")
    exact = reference.clipped_sum(left.double(), right.double(), coef.double())
    flops = 2 * b * t * p * d
    dw = flops / do_bench(functools.partial(torch.mm, left.view(-1, p).T, right.view(-1, d))) / 1e9
    for tiles, (warps, stages) in itertools.product(TILES, WARPS_STAGES):
        launch = functools.partial(run, left, right, coef, tiles, warps, stages)
        try:
            out, handle = launch()
            error = ((out.double() - exact).norm() / exact.norm()).item()
            ms = do_bench(launch)
            cells = f"{ms:.3f} | {flops / ms / 1e9:.0f} | {dw:.0f} | {handle.n_regs} | {handle.n_spills} | {error:.1e}"
        except Exception as failure:  # out of resources: a finding, the sweep goes on
            cells = f"{type(failure).__name__} | | | | | "
        print(f"| {b} | {t} | {p} | {d} | {'x'.join(map(str, tiles))} | {warps} | {stages} | {cells} |", flush=True)


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| B | T | p | d | BP x BD x BT | warps | stages | ms | TFLOP/s | dW GEMM TFLOP/s | regs | spills | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for shape in SHAPES:
        sweep(*shape)


if __name__ == "__main__":
    main()
