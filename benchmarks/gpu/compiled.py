"""flashdp's Triton kernels compiled ahead of time for NVIDIA GPUs on any machine, no GPU needed: for every launch
configuration the launchers choose on CUDA for a table of representative layer shapes, the registers, spills,
shared memory and instruction mix that Triton's PTX and the `ptxas` shipped in the triton wheel report.

    python benchmarks/gpu/compiled.py               # the table, markdown (docs/benchmarks.md)
    python benchmarks/gpu/compiled.py --arch 90 --json   # one arch, one JSON object per launch

The test suite runs the second form (`tests/kernels/test_compiled_for_gpus.py`) and asserts: no spills,
tensor-core instructions for 16-bit inputs of the kernels that multiply matrices, shared memory within the limit.
It runs without TRITON_INTERPRET: under the interpreter `triton.jit` gives functions that cannot be compiled.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from flashdp.kernels.clipped_sum import kernel as clipped_sum
from flashdp.kernels.configs import LaunchConfig, launch_config
from flashdp.kernels.norm_affine import kernel as norm_affine
from flashdp.kernels.outer_norm import kernel as outer_norm

#: arch -> (the wheel's ptxas that reads its PTX, its --gpu-name, the most shared memory one block may use):
#: CUDA C Programming Guide, "Technical Specifications per Compute Capability": 163 KB on 8.0, 227 KB on 9.0
ARCHS = {80: ("ptxas", "sm_80", 163 * 1024), 90: ("ptxas-blackwell", "sm_90a", 227 * 1024)}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: representative linear layers (d_in -> d_out) of GPT-2 (d=768) and Llama-3-8B (d=4096, 8 KV heads, MLP 14336)
LINEARS = {
    "gpt2 attn qkv": (768, 2304),
    "gpt2 mlp up": (768, 3072),
    "gpt2 mlp down": (3072, 768),
    "llama3-8b attn q/o": (4096, 4096),
    "llama3-8b attn k/v": (4096, 1024),
    "llama3-8b mlp up/gate": (4096, 14336),
    "llama3-8b mlp down": (14336, 4096),
}
#: normalisation widths (GPT-2's LayerNorm, Llama's RMSNorm)
NORMS = {"gpt2 layernorm": (768, False), "llama3-8b rmsnorm": (4096, True)}
#: sequence lengths; the batch (1 to 64) only sets the grid, never the compiled code
SEQUENCES = (128, 1024, 8192, 32768)


@dataclass(frozen=True)
class Launch:
    """One kernel launch configuration: what decides the compiled code (the batch only sets the grid)."""

    kernel: str
    dtype: torch.dtype
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Compiled:
    launch: Launch
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    mma: int
    fma: int

    @property
    def shared_limit(self) -> int:
        return ARCHS[self.arch][2]


#: kernel -> (its jit function, its pointer arguments' types given the inputs' type, whether it multiplies matrices)
KERNELS: dict[str, tuple[object, Callable[[str], dict[str, str]], bool]] = {
    "direct_norm": (outer_norm._direct_norm_kernel, lambda t: {"L": t, "R": t, "partial": "*fp32"}, True),
    "ghost_norm": (
        outer_norm._ghost_norm_kernel,
        lambda t: {"L": t, "R": t, "pairs": "*i32", "partial": "*fp32"},
        True,
    ),
    "clipped_sum": (clipped_sum._clipped_sum_kernel, lambda t: {"L": t, "R": t, "C": "*fp32", "out": "*fp32"}, True),
    "norm_affine": (
        norm_affine._norm_affine_kernel,
        lambda t: {"X": t, "G": t, "W": "*fp32", "Bias": "*fp32", "eps": "fp32"},
        False,
    ),
}


def launches() -> list[Launch]:
    """Every distinct launch the launchers choose on CUDA for the table's shapes and each input dtype."""
    found: dict[Launch, None] = {}
    for dtype in DTYPES:
        for name in KERNELS:
            config = launch_config(name, dtype, on_gpu=True)
            for tiles in _constexprs(name, config):
                for warps, stages in config.warps_and_stages:
                    found[Launch(name, dtype, tuple(sorted(tiles.items())), warps, stages)] = None
    return list(found)


def _constexprs(name: str, config: LaunchConfig) -> list[dict[str, object]]:
    """The constexprs the launcher of `name` passes for each shape of the table (UPCAST: never on a GPU). For the
    linear layers the factors are the output gradient `[B, T, d_out]` and the input `[B, T, d_in]`."""
    tile = config.tile
    if name == "norm_affine":
        return [
            {**norm_affine.norm_affine_tiles(t, d, tile), "RMS": rms, "HAS_BIAS": not rms}
            for d, rms in NORMS.values()
            for t in SEQUENCES
        ]
    shapes = [(t, p, d) for d, p in LINEARS.values() for t in SEQUENCES]
    if name == "ghost_norm":
        return [{**outer_norm.ghost_tiles(t, p, d, tile, tile), "UPCAST": False} for t, p, d in shapes]
    return [{**outer_norm.direct_tiles(t, p, d, tile, config.t_tile), "UPCAST": False} for t, p, d in shapes]


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile `launch` for `arch` (80 or 90) and read what ptxas reports of it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, pointers, _ = KERNELS[launch.kernel]
    constexprs = dict(launch.constexprs)
    types = pointers("*" + DTYPES[launch.dtype])
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
    )
    ptx = compiled.asm["ptx"]
    report = _ptxas(ptx, arch)
    return Compiled(
        launch,
        arch,
        registers=int(re.search(r"Used (\d+) registers", report).group(1)),
        spill_stores=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
        spill_loads=int(re.search(r"(\d+) bytes spill loads", report).group(1)),
        shared=compiled.metadata.shared,
        mma=len(re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)", ptx)),
        fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
    )


@functools.cache
def _ptxas_path(executable: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", executable)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: the triton wheel ships ptxas there; reinstall triton")
    return path


def _ptxas(ptx: str, arch: int) -> str:
    executable, gpu, _ = ARCHS[arch]
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run(
            [_ptxas_path(executable), "-v", f"--gpu-name={gpu}", source, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stderr


def table(archs: list[int]) -> str:
    rows = [
        "| kernel | dtype | tiles | warps / stages | arch | registers | spill stores (bytes) | shared memory | "
        "mma instructions | fp32 FMAs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for launch in launches():
        for arch in archs:
            c = compile_launch(launch, arch)
            tiles = ", ".join(f"{k}={v}" for k, v in launch.constexprs if k not in ("UPCAST",))
            rows.append(
                f"| {launch.kernel} | {DTYPES[launch.dtype]} | {tiles} | {launch.num_warps} / {launch.num_stages} "
                f"| sm_{arch} | {c.registers} | {c.spill_stores} | {c.shared / 1024:.0f} KiB | {c.mma} | {c.fma} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=sorted(ARCHS), action="append", help="default: all")
    parser.add_argument("--json", action="store_true", help="one JSON object per launch and arch")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("Unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled for a GPU.")
    archs = args.arch or sorted(ARCHS)
    if args.json:
        for launch in launches():
            for arch in archs:
                print(json.dumps(_as_json(compile_launch(launch, arch))), flush=True)
    else:
        print(table(archs))


def _as_json(compiled: Compiled) -> dict:
    launch = compiled.launch
    return {
        **{k: v for k, v in asdict(compiled).items() if k != "launch"},
        "kernel": launch.kernel,
        "dtype": DTYPES[launch.dtype],
        "constexprs": dict(launch.constexprs),
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
        "shared_limit": compiled.shared_limit,
        "multiplies_matrices": KERNELS[launch.kernel][2],
    }


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (triton 3.9's default, stated to silence its warning)
    main()
