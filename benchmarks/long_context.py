"""Long context: time and memory of a training step of the Llama-like decoder (d=256, 4 layers, vocab 4096) as T
grows, flashdp vs non-private training and Opacus ghost clipping, with and without activation checkpointing.

    python benchmarks/long_context.py                          # T = 1024 .. 16384 at B=1, B=4 up to T=4096
    python benchmarks/long_context.py --seqs 4096 --batches 1  # one shape

Memory: each (shape, mode, checkpointing) in its own process; the peak the second step adds above what is allocated
when it starts (benchmarks/memory.py: the allocator's record on CPU, `max_memory_allocated` on GPU), and the same for
the first step, which also runs flashdp's checks (batch independence on a new forward structure, the self-check).
Time: the modes of one shape in one process, interleaved, median of `--rounds` steps after a warm-up step.
Writes docs/benchmarks/long_context.csv and prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import make_step, unavailable  # noqa: E402
from benchmarks.memory import step_peak_mib  # noqa: E402

MODES = ("non-private", "flashdp-bk", "flashdp-ghost", "flashdp-flash", "opacus-ghost")
OUT = ROOT / "docs" / "benchmarks" / "long_context.csv"


def _modes(checkpointing: bool) -> list[str]:
    return [m for m in MODES if unavailable(m) is None and not (checkpointing and m.startswith("opacus"))]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def worker_time(seq: int, batch: int, checkpointing: bool, rounds: int, device: str) -> dict[str, float]:
    steps = {m: make_step("llama", m, seq, batch, device, checkpointing) for m in _modes(checkpointing)}
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(rounds):
        for mode, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[mode].append((time.perf_counter() - start) * 1000)
    return {m: statistics.median(v) for m, v in times.items()}


def worker_memory(mode: str, seq: int, batch: int, checkpointing: bool, device: str) -> dict[str, float]:
    step = make_step("llama", mode, seq, batch, device, checkpointing)
    first = step_peak_mib(step, device)
    return {"first_mib": first, "peak_mib": step_peak_mib(step, device)}


def _subprocess(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--worker", *args, "--json", out.name], check=True, cwd=ROOT)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-seq-b4", type=int, default=4096, help="the longest T run at B > 1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-time", action="store_true", help="memory only")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        kind, *rest = args.worker
        if kind == "time":
            seq, batch, ckpt, rounds = map(int, rest)
            result = worker_time(seq, batch, bool(ckpt), rounds, device)
        else:
            mode, seq, batch, ckpt = rest[0], *map(int, rest[1:])
            result = worker_memory(mode, seq, batch, bool(ckpt), device)
        Path(args.json).write_text(json.dumps(result))
        return
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for batch in args.batches:
        for seq in args.seqs:
            if batch > 1 and seq > args.max_seq_b4:
                continue
            for ckpt in (0, 1):
                times = {} if args.no_time else _subprocess(["time", str(seq), str(batch), str(ckpt), str(args.rounds)])
                for mode in _modes(bool(ckpt)):
                    memory = _subprocess(["memory", mode, str(seq), str(batch), str(ckpt)])
                    row = {"T": seq, "B": batch, "checkpointing": ckpt, "mode": mode, "time_ms": times.get(mode, ""),
                           **memory, "device": device, "timestamp": stamp}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(table(rows))


def table(rows: list[dict]) -> str:
    """Markdown: per shape and checkpointing, each mode's peak (and first-step peak) memory and time, with its
    ratio to non-private."""
    lines = [
        "| T | B | ckpt | mode | peak MiB (x) | first step MiB (x) | time ms (x) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {(r["T"], r["B"], r["checkpointing"]): r for r in rows if r["mode"] == "non-private"}
    for r in rows:
        b = base[(r["T"], r["B"], r["checkpointing"])]
        cells = [_with_ratio(r[key], b[key]) for key in ("peak_mib", "first_mib", "time_ms")]
        lines.append(
            f"| {r['T']} | {r['B']} | {'yes' if r['checkpointing'] else 'no'} | {r['mode']} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _with_ratio(value: float | str, base: float | str) -> str:
    return "-" if value == "" or base == "" else f"{value:.0f} ({value / base:.2f}x)"


if __name__ == "__main__":
    main()
