"""Every Triton kernel, compiled ahead of time for A100 (sm_80) and H100 (sm_90) with each launch configuration its
launcher chooses on CUDA for representative layer shapes (`benchmarks/gpu/compiled.py`), no GPU needed: no register
spills, tensor cores for 16-bit inputs, shared memory within the architecture's limit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _compiled(arch: int) -> list[dict]:
    """One record per launch, from a process without TRITON_INTERPRET (the interpreter's kernels do not compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "compiled.py"), "--arch", str(arch), "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def _name(record: dict) -> str:
    tiles = ",".join(f"{k}={v}" for k, v in record["constexprs"].items())
    return f"{record['kernel']} {record['dtype']} [{tiles}] {record['num_warps']}w/{record['num_stages']}s"


@pytest.mark.parametrize("arch", [80, 90])
def test_every_launch_compiles_without_spills_with_tensor_cores_within_shared_memory(arch):
    records = _compiled(arch)
    kernels = {r["kernel"] for r in records}
    assert kernels == {"direct_norm", "ghost_norm", "clipped_sum", "norm_affine"}
    assert {r["dtype"] for r in records} == {"fp32", "bf16", "fp16"}
    spilling = [f"{_name(r)}: {r['spill_stores']} bytes" for r in records if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, f"sm_{arch} launches that spill registers: {spilling}"
    scalar = [_name(r) for r in records if r["multiplies_matrices"] and r["dtype"] != "fp32" and not r["mma"]]
    assert not scalar, f"sm_{arch} 16-bit launches without tensor-core instructions: {scalar}"
    too_big = [_name(r) for r in records if r["shared"] > r["shared_limit"]]
    assert not too_big, f"sm_{arch} launches over the shared-memory limit: {too_big}"
