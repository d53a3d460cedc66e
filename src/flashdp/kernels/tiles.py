"""Tile helpers shared by the Triton kernels (imported only by the `kernel.py` modules, so only where Triton is)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from flashdp.kernels.configs import LaunchConfig, launch_config
from flashdp.kernels.runtime import interpreter


def tile_size(size: int, limit: int) -> int:
    """A power-of-two tile covering `size`, between 16 (the smallest `tl.dot` operand) and `limit`."""
    return max(16, min(limit, triton.next_power_of_2(max(size, 1))))


def upcast_tiles() -> bool:
    """Whether kernels cast half-precision tiles to float32 before `tl.dot`: the interpreter multiplies them
    wrongly (bf16 held as uint16)."""
    return interpreter()


@triton.jit
def load_tile(X, row, s_row, s_pos, s_col, positions, columns, T, K, UPCAST: tl.constexpr):
    """`[len(positions), len(columns)]` tile of row `row` of X `[N, T, K]` (zeros outside), float32 if UPCAST."""
    mask = (positions[:, None] < T) & (columns[None, :] < K)
    tile = tl.load(X + row * s_row + positions[:, None] * s_pos + columns[None, :] * s_col, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def output_tile(BP: tl.constexpr, BD: tl.constexpr):
    """Row and column indices (`[BP]`, `[BD]`) of this program's `[BP, BD]` tile of a `[p, d]` result: grid axes 1
    and 2 count the tiles along p and d."""
    rows = tl.program_id(1) * BP + tl.arange(0, BP)
    columns = tl.program_id(2) * BD + tl.arange(0, BD)
    return rows, columns


class Launcher:
    """Launches the Triton kernel `fn` with `configs.launch_config(name, dtype)`: on CUDA autotuned over the
    configuration's `(num_warps, num_stages)` candidates, once per value of the `key` arguments (a layer's sizes);
    under the interpreter with its one candidate."""

    def __init__(self, fn: triton.JITFunction, name: str, key: Sequence[str]) -> None:
        self.fn, self.name, self.key = fn, name, list(key)
        self._tuned: dict[LaunchConfig, Callable] = {}

    def config(self, dtype: torch.dtype) -> LaunchConfig:
        return launch_config(self.name, dtype)

    def __call__(self, grid: tuple[int, ...], dtype: torch.dtype, *args: object, **constexprs: object) -> None:
        config = self.config(dtype)
        if len(config.warps_and_stages) == 1:
            warps, stages = config.warps_and_stages[0]
            self.fn[grid](*args, **constexprs, num_warps=warps, num_stages=stages)
            return
        if config not in self._tuned:
            candidates = [triton.Config({}, num_warps=w, num_stages=s) for w, s in config.warps_and_stages]
            self._tuned[config] = triton.autotune(configs=candidates, key=self.key)(self.fn)
        self._tuned[config][grid](*args, **constexprs)
