"""The cost of a DP step on paper: FLOPs and HBM bytes per linear layer and strategy, as formulas of B, T, d, p.

    python benchmarks/cost_model.py      # predicted H100 step-time ratios for Llama-3-8B layers (docs/benchmarks.md)

A linear layer `[B, T, d] -> [B, T, p]` (weight `p x d`), W = p d:

| stage | FLOPs | HBM bytes (bf16 activations, fp32 per-sample) |
|---|---|---|
| forward, a backward to the inputs (dX), the weight gradient (dW) | 2 B T W each | a GEMM's operands, result |
| ghost norm (T tiles of `tile`, pairs j <= k) | 2 B (p + d) sum_{j<=k} t_j t_k ~ B T^2 (p + d) | each pair's tiles |
| direct norm (kernel: `L^T R` accumulated in registers) | 2 B T W | L and R once |
| bk, direct: per-sample gradients kept, the clipped sum a GEMV | 2 B T W + 2 B W | 4 B W written, read twice |
| bk, ghost: the clipped sum, one GEMM with c applied to L | 2 B T W | a GEMM's |

The strategy is the engine's: ghost where T (p + d) < p d (`outer_products.norm_strategy`). A step is then
- non-private: forward + dX + dW
- bk: forward + dX (the norm pass) + norms + the clipped sums
- ghost and flash: forward + dX (the norm pass) + norms + a second backward (dX + dW)
plus what every mode shares (attention, normalisation, the loss), and what the second backward repeats (attention's
backward). `tests/test_cost_model.py` checks the matrix-multiply FLOPs of these formulas against
`torch.utils.flop_counter.FlopCounterMode` on CPU steps of the Llama-like benchmark model (within 5%).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from flashdp._pipeline.outer_products import norm_strategy

#: H100 SXM: dense bf16 tensor-core FLOP/s and HBM3 bytes/s (NVIDIA H100 datasheet)
H100_FLOPS, H100_BYTES = 989e12, 3.35e12
BF16, FP32 = 2, 4
#: the Triton kernels' T tile on a GPU (16-bit inputs, `flashdp.kernels.configs`), the reference's on a CPU
GPU_TILE, CPU_TILE = 64, 512


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def seconds(self) -> float:
        """Roofline time on an H100: bound by its tensor cores or its memory, whichever is slower."""
        return max(self.flops / H100_FLOPS, self.bytes / H100_BYTES)


def gemm(m: int, k: int, n: int) -> Cost:
    """`[m, k] @ [k, n]` in bf16."""
    return Cost(2.0 * m * k * n, BF16 * (m * k + k * n + m * n))


def tile_area(t: int, tile: int) -> int:
    """`sum_{j <= k} t_j t_k` over the T tiles of a ghost norm (t_j the tile sizes)."""
    sizes = [min(tile, t - start) for start in range(0, t, tile)]
    return sum(a * b for j, a in enumerate(sizes) for b in sizes[j:])


def ghost_norm(b: int, t: int, d: int, p: int, tile: int) -> Cost:
    """Gram products of the input's and the output gradient's T tiles, pairs j <= k."""
    pairs = len(range(0, t, tile)) * (len(range(0, t, tile)) + 1) // 2
    return Cost(2.0 * b * (p + d) * tile_area(t, tile), BF16 * b * pairs * 2 * min(tile, t) * (p + d))


def direct_norm(b: int, t: int, d: int, p: int) -> Cost:
    """`||L^T R||^2` accumulated in registers: a GEMM's FLOPs, its operands read once, nothing written."""
    return Cost(2.0 * b * t * p * d, BF16 * b * t * (p + d))


def linear_step(mode: str, b: int, t: int, d: int, p: int, tile: int = GPU_TILE) -> Cost:
    """One linear layer's share of a step in `mode` ("non-private", "bk", "ghost"; flash costs what ghost does)."""
    forward, to_inputs, to_weight = gemm(b * t, d, p), gemm(b * t, p, d), gemm(p, b * t, d)
    if mode == "non-private":
        return forward + to_inputs + to_weight
    strategy = norm_strategy(t, p, d)
    norm = ghost_norm(b, t, d, p, tile) if strategy == "ghost" else direct_norm(b, t, d, p)
    if mode != "bk":
        return forward + to_inputs + norm + to_inputs + to_weight
    if strategy == "ghost":
        return forward + to_inputs + norm + to_weight  # (the clipped sum: dW's GEMM with c applied to L)
    kept = Cost(2.0 * b * t * p * d + 2.0 * b * p * d, FP32 * b * p * d * 3)  # per-sample dW, its norm, the GEMV
    return forward + to_inputs + kept


def attention(b: int, t: int, d: int, causal: bool = True) -> tuple[Cost, Cost]:
    """(forward, backward) of flash attention over `[B, T, d]` (QK^T and PV; the backward's four GEMMs)."""
    share = 0.5 if causal else 1.0
    forward = Cost(4.0 * b * t * t * d * share, BF16 * 4 * b * t * d)
    return forward, Cost(2.5 * forward.flops, BF16 * 8 * b * t * d)


#: Llama-3-8B decoder layer: its linear layers (d_in, d_out): q, k, v, o, gate, up, down
LLAMA3_8B = {"d": 4096, "linears": [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), *[(4096, 14336)] * 2,
                                    (14336, 4096)]}  # fmt: skip


def decoder_layer_seconds(mode: str, b: int, t: int, layer: dict = LLAMA3_8B) -> float:
    """Predicted H100 time of one decoder layer's share of a step: its linears and its attention (whose backward
    the second backward of ghost and flash runs again)."""
    forward, backward = attention(b, t, layer["d"])
    shared = forward + backward + (backward if mode != "non-private" and mode != "bk" else Cost())
    linears = [linear_step(mode, b, t, d, p) for d, p in layer["linears"]]
    return sum(c.seconds() for c in linears) + shared.seconds()


def predicted_table(sequences=(1024, 4096, 16384), batches=(1, 4, 16)) -> str:
    rows = [
        "| T | B | strategy of the 4096 x 4096 layers | bk / non-private | ghost, flash / non-private |",
        "|---|---|---|---|---|",
    ]
    for t in sequences:
        for b in batches:
            base = decoder_layer_seconds("non-private", b, t)
            ratios = [decoder_layer_seconds(mode, b, t) / base for mode in ("bk", "ghost")]
            rows.append(f"| {t} | {b} | {norm_strategy(t, 4096, 4096)} | {ratios[0]:.2f}x | {ratios[1]:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(predicted_table())


if __name__ == "__main__":
    main()
