"""Figures and a summary table from the JSON results of `examples/fsdp_llama.py`.

    python examples/plot_fsdp_llama.py out/fsdp_llama       # writes fsdp_llama.png and summary.md there

Four panels: peak memory and step time by mode and sequence length, the memory-time trade-off, and the overhead of
each DP mode over no_dp (same wrapper, same length) in percent. The table (markdown, also printed) has one row per
run with those overheads.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(results: Path) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    if not runs:
        raise SystemExit(f"no JSON results in {results}: run examples/fsdp_llama.py with --out {results} first")
    return sorted(runs, key=lambda r: (r["wrapper"], r["mode"] != "no_dp", r["mode"], r["seq_len"]))


def with_overheads(runs: list[dict]) -> list[dict]:
    """Each run with `time_overhead_pct` and `memory_overhead_pct` over no_dp at the same wrapper and length."""
    baseline = {(r["wrapper"], r["seq_len"]): r for r in runs if r["mode"] == "no_dp"}
    for run in runs:
        base = baseline.get((run["wrapper"], run["seq_len"]))
        run["time_overhead_pct"] = _pct(run["mean_step_s"], base["mean_step_s"]) if base else None
        run["memory_overhead_pct"] = _pct(run["peak_memory_mb"], base["peak_memory_mb"]) if base else None
    return runs


def _pct(value: float, base: float) -> float | None:
    return 100.0 * (value / base - 1.0) if base > 0 else None


def table(runs: list[dict]) -> str:
    def fmt(x: float | None, digits: int = 0) -> str:
        return "—" if x is None else f"{x:+.{digits}f}%"

    first = runs[0]
    lines = [
        f"{first['world_size']} ranks, {first['backend']}, {first['device']}, torch {first['torch']}, "
        f"{first['date']}; model {first['config']}; {first['batch_per_rank']} samples per rank",
        "",
        "| wrapper | mode | seq len | step time (ms) | time vs no_dp | peak memory (MiB) | memory vs no_dp |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['wrapper']} | {r['mode']} | {r['seq_len']} | {r['mean_step_s'] * 1000:.1f} | "
            f"{fmt(r['time_overhead_pct'])} | {r['peak_memory_mb']:.1f} | {fmt(r['memory_overhead_pct'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    series: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in runs:
        series[(r["wrapper"], r["mode"])].append(r)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (memory, time), (trade_off, overhead) = axes
    for (wrapper, mode), points in series.items():
        label = f"{mode} ({wrapper})"
        lengths = [p["seq_len"] for p in points]
        memory.plot(lengths, [p["peak_memory_mb"] for p in points], marker="o", label=label)
        time.plot(lengths, [p["mean_step_s"] * 1000 for p in points], marker="o", label=label)
        trade_off.scatter([p["mean_step_s"] * 1000 for p in points], [p["peak_memory_mb"] for p in points], label=label)
        if mode != "no_dp":
            overhead.plot(lengths, [p["time_overhead_pct"] for p in points], marker="o", label=f"time, {label}")
            overhead.plot(lengths, [p["memory_overhead_pct"] for p in points], ls="--", marker="x",
                          label=f"memory, {label}")  # fmt: skip
    for ax, title, ylabel in (
        (memory, "Peak memory", "MiB"),
        (time, "Step time", "ms"),
        (overhead, "Overhead over no_dp", "%"),
    ):
        ax.set(
            title=title,
            xlabel="sequence length",
            ylabel=ylabel,
            xscale="log",
            xticks=sorted({r["seq_len"] for r in runs}),
        )
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    trade_off.set(title="Memory-time trade-off", xlabel="step time (ms)", ylabel="peak memory (MiB)")
    overhead.axhline(0, color="grey", lw=0.8)
    for ax in axes.flat:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    first = runs[0]
    fig.suptitle(f"flashdp under FSDP: {first['world_size']} ranks, {first['backend']}, {first['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", default=Path("out/fsdp_llama"))
    args = parser.parse_args(argv)
    runs = with_overheads(load(args.results))
    summary = table(runs)
    (args.results / "summary.md").write_text(summary)
    plot(runs, args.results / "fsdp_llama.png")
    print(summary)
    print(f"figure: {args.results / 'fsdp_llama.png'}; table: {args.results / 'summary.md'}")


if __name__ == "__main__":
    main()
