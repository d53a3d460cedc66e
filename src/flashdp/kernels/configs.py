"""Launch configurations of the Triton kernels, per kernel and input precision: the tile limit, and the
`(num_warps, num_stages)` candidates among which `triton.autotune` picks on CUDA, per layer shape.

Every candidate is compiled ahead of time for sm_80 (A100) and sm_90 (H100) by the test suite
(`tests/kernels/test_compiled_for_gpus.py`, no GPU needed): it must compile without register spills, with
tensor-core instructions for 16-bit inputs, within the architecture's shared memory. float32 inputs take smaller
tiles: their `tl.dot` runs in IEEE float32 (a norm is a privacy quantity, never tf32) on scalar FMAs, and 64 x 64
tiles of them spill (the direct norm 632 bytes, the ghost norm 2,452, the clipped sum 12,664 on sm_80 at 4 warps).
Candidates share a kernel's tile, which sets its grid and its output buffers; warps and stages do not. Spills
depend on Triton's version as much as on the configuration: the candidates below compile without spills with triton
3.6 (the H200 machine's, where 4 warps spilled up to 336 bytes of the clipped sum) and 3.9 (where 8 warps spilled 44
bytes of it on sm_80), with one known exception: the 16-bit clipped sum's 128 x 128 x 32 tiles spill 8 bytes on sm_80
under triton 3.6 only (none on sm_90, none under 3.9; on the H200 they run 1.7x faster than the spill-free 64-wide
tiles, and the A100 was not measured).

Under Triton's CPU interpreter (tests) one configuration: 64-wide tiles (the interpreter's cost is per program and
loop iteration), one warp setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdp.kernels.runtime import interpreter


@dataclass(frozen=True)
class LaunchConfig:
    #: the largest tile along each tiled dim (a smaller dim takes the power of two covering it)
    tile: int
    #: `(num_warps, num_stages)` candidates, autotuned on CUDA; the first under the interpreter
    warps_and_stages: tuple[tuple[int, int], ...]
    #: the largest tile along positions T, where it differs from `tile` (the GEMM's inner dim)
    positions_tile: int | None = None

    @property
    def t_tile(self) -> int:
        return self.positions_tile or self.tile


#: (kernel, precision) -> configuration on CUDA; precision is "16-bit" (bf16, fp16) or "float32"
ON_GPU: dict[tuple[str, str], LaunchConfig] = {
    ("direct_norm", "16-bit"): LaunchConfig(64, ((8, 3), (8, 2))),
    ("direct_norm", "float32"): LaunchConfig(32, ((4, 3), (8, 2))),
    ("ghost_norm", "16-bit"): LaunchConfig(64, ((8, 2), (8, 3))),
    ("ghost_norm", "float32"): LaunchConfig(32, ((4, 3), (8, 3))),
    # 128 x 128 output tiles over 32 positions: 360-440 TFLOP/s on an H200 at Llama shapes, 1.8-2x the 64-wide
    # tiles' (benchmarks/gpu/sweep_clipped_sum.py, docs/benchmarks.md). Over 64 positions reached 380-550 but
    # spills 40 bytes on sm_80 (triton 3.9); 4 warps spill on both
    ("clipped_sum", "16-bit"): LaunchConfig(128, ((8, 4), (8, 3)), positions_tile=32),
    ("clipped_sum", "float32"): LaunchConfig(32, ((4, 3), (8, 3))),
    ("norm_affine", "16-bit"): LaunchConfig(4096, ((8, 1),)),
    ("norm_affine", "float32"): LaunchConfig(4096, ((8, 1),)),
}
INTERPRETED = {"direct_norm": 64, "ghost_norm": 64, "clipped_sum": 64, "norm_affine": 4096}


def precision(dtype: torch.dtype) -> str:
    return "float32" if dtype == torch.float32 else "16-bit"


def launch_config(kernel: str, dtype: torch.dtype, on_gpu: bool | None = None) -> LaunchConfig:
    """The configuration of `kernel` for inputs of `dtype`: on CUDA (`on_gpu`, default: not the interpreter) the
    table's; under the interpreter one candidate."""
    if on_gpu if on_gpu is not None else not interpreter():
        return ON_GPU[(kernel, precision(dtype))]
    return LaunchConfig(INTERPRETED[kernel], ((4, 1),))
