"""The benchmark suite: one command measures, writes the CSV, draws the plots and regenerates docs/benchmarks.md.

    python benchmarks/run.py            # full sweep (about 15 minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # the two target shapes only

Step time: for each shape, every mode is built in ONE process and timed in interleaved rounds (non-private,
flashdp bk, ..., non-private, ...), so that drift on a shared machine hits all modes alike; median, p20, p80.
Peak memory: each (shape, mode) in its own subprocess: peak RSS on CPU (and the part of it added by training
steps), `max_memory_allocated` on GPU. Micro-benchmarks of the per-layer norms come from pytest-benchmark
(benchmarks/test_micro.py).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import flashdp  # noqa: E402
from benchmarks.harness import MODES, interleaved_times, make_step, unavailable  # noqa: E402

OUT = ROOT / "docs" / "benchmarks"
#: (model, x name, x value, seq, batch): the Llama-like decoder over T (and B at T=256), the CNN over B.
FULL = [
    *(("llama", "seq", t, t, b) for t, b in ((128, 16), (256, 8), (512, 8), (1024, 4), (2048, 2))),
    *(("llama_T256", "batch", b, 256, b) for b in (4, 16)),
    *(("cnn", "batch", b, 32, b) for b in (16, 64)),
]
QUICK = [("llama", "seq", 256, 256, 8), ("llama", "seq", 1024, 1024, 4)]
FIELDS = ["benchmark", "mode", "metric", "unit", "x_name", "x_value", "median", "p20", "p80", "device", "version",
          "timestamp"]  # fmt: skip


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return statistics.median(ordered), pick(0.2), pick(0.8)


def worker_time(model: str, seq: int, batch: int, rounds: int, device: str) -> dict:
    modes = [m for m in MODES if unavailable(m) is None]
    steps = {m: make_step(model.split("_")[0], m, seq, batch, device) for m in modes}
    for m in modes:  # warm-up
        steps[m]()
    return interleaved_times(steps, rounds, device)


def worker_memory(model: str, mode: str, seq: int, batch: int, device: str) -> dict:
    step = make_step(model.split("_")[0], mode, seq, batch, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_now_mb()
    for _ in range(2):
        step()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak, "step_mb": peak - base}


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _subprocess(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--worker", *args, "--json", out.name], check=True, cwd=ROOT)
        return json.loads(Path(out.name).read_text())


def measure(configs: list, rounds: int, device: str) -> list[dict]:
    rows = []
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    common = {"device": _device_name(device), "version": flashdp.__version__, "timestamp": stamp}
    for model, x_name, x_value, seq, batch in configs:
        bench = f"{model}_step" + (f"[B={batch}]" if x_name == "seq" else f"[T={seq}]")
        print(f"{bench} {x_name}={x_value}", flush=True)
        times = _subprocess(["time", model, str(seq), str(batch), str(rounds), device])
        for mode, values in times.items():
            median, p20, p80 = _quantiles(values)
            rows.append({"benchmark": bench, "mode": mode, "metric": "step_time", "unit": "ms", "x_name": x_name,
                         "x_value": x_value, "median": median, "p20": p20, "p80": p80, **common})  # fmt: skip
            memory = _subprocess(["memory", model, mode, str(seq), str(batch), device])
            for metric, value in (("peak_memory", memory["peak_mb"]), ("step_memory", memory["step_mb"])):
                rows.append({"benchmark": bench, "mode": mode, "metric": metric, "unit": "MiB", "x_name": x_name,
                             "x_value": x_value, "median": value, "p20": value, "p80": value, **common})  # fmt: skip
    return rows


def micro(common: dict) -> list[dict]:
    """pytest-benchmark's per-layer norm timings, as CSV rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "benchmarks" / "test_micro.py"),
             f"--benchmark-json={out.name}", "--benchmark-min-rounds=5"],
            check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        report = json.loads(Path(out.name).read_text())
    rows = []
    for bench in report["benchmarks"]:
        params, stats = bench["params"], bench["stats"]
        data = sorted(stats["data"])
        rows.append({
            "benchmark": f"micro:{bench['group'] or bench['name'].split('[')[0]}", "mode": params["impl"],
            "metric": "time", "unit": "ms", "x_name": "seq", "x_value": params["seq"],
            "median": stats["median"] * 1000, "p20": data[int(0.2 * (len(data) - 1))] * 1000,
            "p80": data[int(0.8 * (len(data) - 1))] * 1000, **common,
        })  # fmt: skip
    return rows


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()} (torch threads {torch.get_num_threads()})"


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the two target shapes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-micro", action="store_true", help="skip the pytest-benchmark micro-benchmarks")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        kind, *rest = args.worker
        if kind == "time":
            model, seq, batch, rounds, device = rest
            result = worker_time(model, int(seq), int(batch), int(rounds), device)
        else:
            model, mode, seq, batch, device = rest
            result = worker_memory(model, mode, int(seq), int(batch), device)
        Path(args.json).write_text(json.dumps(result))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = measure(QUICK if args.quick else FULL, args.rounds, device)
    if not args.no_micro:
        rows += micro({k: rows[0][k] for k in ("device", "version", "timestamp")})
    csv_path = OUT / "results.csv"
    write_csv(rows, csv_path)
    from benchmarks.report import write_report

    command = "python benchmarks/run.py" + (" --quick" if args.quick else "")
    write_report(rows, OUT, command)
    print(f"wrote {csv_path.relative_to(ROOT)}, plots in {OUT.relative_to(ROOT)}, docs/benchmarks.md")


if __name__ == "__main__":
    main()
