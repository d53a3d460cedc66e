"""docs/benchmarks.md and its plots, regenerated from the rows of benchmarks/run.py."""

from __future__ import annotations

import datetime
from collections import defaultdict
from pathlib import Path

from benchmarks.sections import write_section

MODE_ORDER = ("non-private", "flashdp-bk", "flashdp-ghost", "flashdp-flash", "opacus-ghost", "opacus-hooks")
#: the CPU targets, at the two shapes of ENVIRONMENT.md's peer measurements.
TARGET_SHAPES = (("llama_step[B=8]", 256), ("llama_step[B=4]", 1024))

GPU_SECTION = """## GPU kernels

`python benchmarks/gpu/kernels.py` (a CUDA device needed) checks every Triton kernel against float64 in float32
and bfloat16 and times the norm kernels at Llama-8B shapes; `benchmarks/gpu/step.py` times full training steps.
First measured on an NVIDIA H200 on 2026-11-26: see "Measured on an NVIDIA H200" below.
"""


def _index(rows: list[dict]) -> dict:
    """(benchmark, metric) -> x -> mode -> row."""
    table: dict = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        table[(row["benchmark"], row["metric"])][row["x_value"]][row["mode"]] = row
    return table


def _ratio(table, bench, metric, x, mode, base="non-private") -> float | None:
    cell = table.get((bench, metric), {}).get(x, {})
    if mode not in cell or base not in cell:
        return None
    return cell[mode]["median"] / cell[base]["median"]


def _targets(table) -> list[str]:
    lines = ["| target | " + " | ".join(f"T={x}" for _, x in TARGET_SHAPES) + " |",
             "|---|" + "---|" * len(TARGET_SHAPES)]  # fmt: skip
    checks = [
        ("bk step time <= 1.15x non-private", "step_time", "flashdp-bk", "non-private", lambda r: r <= 1.15),
        ("bk peak memory <= 1.2x non-private", "peak_memory", "flashdp-bk", "non-private", lambda r: r <= 1.2),
        ("ghost step time <= 1.6x non-private", "step_time", "flashdp-ghost", "non-private", lambda r: r <= 1.6),
        ("bk >= 2x faster than Opacus ghost", "step_time", "flashdp-bk", "opacus-ghost", lambda r: r <= 0.5),
        ("bk faster than Opacus hooks", "step_time", "flashdp-bk", "opacus-hooks", lambda r: r < 1.0),
    ]
    for name, metric, mode, base, ok in checks:
        cells = []
        for bench, x in TARGET_SHAPES:
            r = _ratio(table, bench, metric, x, mode, base)
            cells.append("not measured" if r is None else f"{r:.2f}x {'met' if ok(r) else 'MISSED'}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _table(table, bench: str) -> list[str]:
    times, peaks = table[(bench, "step_time")], table.get((bench, "peak_memory"), {})
    steps = table.get((bench, "step_memory"), {})
    xs = sorted(times)
    modes = [m for m in MODE_ORDER if any(m in times[x] for x in xs)]
    x_name = times[xs[0]][modes[0]]["x_name"]
    lines = [f"| {x_name} | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for x in xs:
        cells = []
        for m in modes:
            row = times[x].get(m)
            if row is None:
                cells.append("-")
                continue
            ratio = _ratio(table, bench, "step_time", x, m)
            peak = peaks.get(x, {}).get(m)
            step = steps.get(x, {}).get(m)
            memory = ""
            if peak and step:
                peak_ratio = _ratio(table, bench, "peak_memory", x, m)
                step_ratio = _ratio(table, bench, "step_memory", x, m)
                memory = (f"<br>peak {peak['median']:.0f} MiB ({peak_ratio:.2f}x), "
                          f"training {step['median']:.0f} MiB ({step_ratio:.2f}x)")  # fmt: skip
            cells.append(f"{row['median']:.0f} ms ({ratio:.2f}x){memory}")
        lines.append(f"| {x} | " + " | ".join(cells) + " |")
    return lines


def _plot(table, bench: str, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for metric, label in (("step_time", "step time (ms)"), ("peak_memory", "peak memory (MiB)")):
        data = table.get((bench, metric))
        if not data:
            continue
        xs = sorted(data)
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for mode in MODE_ORDER:
            points = [(x, data[x][mode]["median"]) for x in xs if mode in data[x]]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        x_name = next(iter(data[xs[0]].values()))["x_name"]
        ax.set_xlabel(x_name)
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{bench}: {label}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{bench.replace('[', '_').replace(']', '').replace('=', '')}_{metric}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def write_report(rows: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table = _index(rows)
    first = rows[0]
    lines = [
        f"Regenerated by `{command}` on {datetime.date.today().isoformat()} (data: `docs/benchmarks/results.csv`).",
        f"Machine: {first['device']}; flashdp {first['version']}.",
        "",
        "Step time: for each shape every mode runs in ONE process, timed in interleaved rounds (median of the "
        "rounds; ratios are to non-private training of the same model and batch in the same run). Peak memory: each "
        "(shape, mode) in its own subprocess; `peak` is the process's peak RSS on CPU (PyTorch itself accounts for "
        "a few hundred MiB of it), `training` the part added by two training steps. A DP step includes the noise.",
        "",
        "## Targets",
        "",
        *_targets(table),
        "",
    ]
    benches = sorted({b for b, metric in table if metric == "step_time"})
    for bench in benches:
        lines += [f"## {bench}", "", *_table(table, bench), ""]
        lines += [f"![{name}](benchmarks/{name})" for name in _plot(table, bench, out)] + [""]
    micro = sorted({b for b, metric in table if metric == "time"})
    if micro:
        lines += ["## Per-layer norms (pytest-benchmark)", ""]
        for bench in micro:
            data = table[(bench, "time")]
            modes = sorted({m for x in data for m in data[x]})
            lines += [f"### {bench.removeprefix('micro:')}", "", "| T | " + " | ".join(modes) + " |",
                      "|---|" + "---|" * len(modes)]  # fmt: skip
            for x in sorted(data):
                lines.append(f"| {x} | " + " | ".join(f"{data[x][m]['median']:.2f} ms" if m in data[x] else "-"
                                                      for m in modes) + " |")  # fmt: skip
            lines.append("")
    lines += [GPU_SECTION]
    write_section("suite", "\n".join(lines))
