"""Long context: time and memory of a training step of the Llama-like decoder (d=256, 4 layers, vocab 4096) as T
grows, flashdp vs non-private training and Opacus ghost clipping, with and without activation checkpointing.

    python benchmarks/long_context.py                          # T = 1024 .. 16384 at B=1, B=4 up to T=4096
    python benchmarks/long_context.py --seqs 4096 --batches 1  # one shape

Memory: each (shape, mode, checkpointing) in its own process; the peak the second step adds above what is allocated
when it starts (benchmarks/memory.py: the allocator's record on CPU, `max_memory_allocated` on GPU), and the same for
the first step, which also runs flashdp's checks (batch independence on a new forward structure, the self-check).
Time: the modes of one shape in one process, interleaved, median of `--rounds` steps after a warm-up step.
Writes docs/benchmarks/long_context.csv (`--append`: adds to the rows already there, replacing those of the same
shape and mode, whose time a `--no-time` run keeps) and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import interleaved_times, make_step, unavailable  # noqa: E402
from benchmarks.memory import step_peak_mib  # noqa: E402
from benchmarks.sections import write_section  # noqa: E402

MODES = ("non-private", "flashdp-bk", "flashdp-ghost", "flashdp-flash", "opacus-ghost")
OUT = ROOT / "docs" / "benchmarks" / "long_context.csv"


def _modes(checkpointing: bool, only: list[str] | None = None) -> list[str]:
    return [
        m
        for m in MODES
        if unavailable(m) is None and not (checkpointing and m.startswith("opacus")) and (not only or m in only)
    ]


def worker_time(seq: int, batch: int, checkpointing: bool, rounds: int, device: str) -> dict[str, float]:
    steps = {m: make_step("llama", m, seq, batch, device, checkpointing) for m in _modes(checkpointing)}
    for step in steps.values():
        step()
    return {m: statistics.median(v) for m, v in interleaved_times(steps, rounds, device).items()}


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
    parser.add_argument("--modes", nargs="+", choices=MODES, help="only these modes (default: all that run here)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--append", action="store_true", help="keep the rows of other shapes already in --out")
    parser.add_argument("--no-docs", action="store_true", help="do not write the section of docs/benchmarks.md")
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
    rows = _read(args.out) if args.append else []
    for batch in args.batches:
        for seq in args.seqs:
            if batch > 1 and seq > args.max_seq_b4:
                continue
            for ckpt in (0, 1):
                times = {} if args.no_time else _subprocess(["time", str(seq), str(batch), str(ckpt), str(args.rounds)])
                for mode in _modes(bool(ckpt), args.modes):
                    memory = _subprocess(["memory", mode, str(seq), str(batch), str(ckpt)])
                    row = {"T": seq, "B": batch, "checkpointing": ckpt, "mode": mode, "time_ms": times.get(mode, ""),
                           **memory, "device": device, "timestamp": stamp}  # fmt: skip
                    earlier = [r for r in rows if _key(r) == _key(row)]
                    if earlier and row["time_ms"] == "":  # a memory-only run keeps the time measured before
                        row["time_ms"] = earlier[0]["time_ms"]
                    rows = [r for r in rows if _key(r) != _key(row)] + [row]
                    print(json.dumps(row), flush=True)
    rows.sort(key=_key)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_docs:
        write_section("long context", section(rows, " ".join(["python benchmarks/long_context.py", *sys.argv[1:]])))


def _key(row: dict) -> tuple:
    return row["B"], row["T"], row["checkpointing"], MODES.index(row["mode"])


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("T", "B", "checkpointing"):
            row[key] = int(row[key])
        for key in ("time_ms", "first_mib", "peak_mib"):
            row[key] = float(row[key]) if row[key] != "" else ""
    return rows


def section(rows: list[dict], command: str) -> str:
    machine = f"{platform.machine()} x{os.cpu_count()} (torch threads {torch.get_num_threads()})"
    return "\n".join(
        [
            "## Long context",
            "",
            f"Measured by `{command}` on {datetime.date.today().isoformat()}; {machine}, {rows[0]['device']}; torch "
            f"{torch.__version__}. The Llama-like decoder (d=256, 4 layers, 4 heads, vocab 4096, untied head), SGD, "
            "one private step includes the noise. Memory: the peak a step adds above what is allocated when it starts "
            "(the CPU allocator's own record of every allocation and free, replayed; `max_memory_allocated` on GPU), "
            "each (shape, mode) in its own process: `peak` is the second step, `first step` the first, which also "
            "verifies batch independence (and runs the self-check). Time: the modes of one shape interleaved in one "
            "process, median of the rounds after a warm-up step (on a shared 2-core machine: noisy). Ratios are to "
            "non-private training with the same checkpointing. Opacus does not run with checkpointing.",
            "",
            table(rows),
        ]
    )


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
