"""The table of supported layers in docs/layers.md, generated from the registry:
`python -m flashdp.rules.catalog docs/layers.md` rewrites it there."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from torch import nn

from flashdp.rules.generic import GENERIC
from flashdp.rules.registry import Rule, registered_rules

BEGIN, END = "<!-- begin: layers (generated) -->", "<!-- end: layers -->"


def layers_table() -> str:
    """One row per rule: the layers it is registered for, what it computes, and how it sees the batch. Layer
    classes in alphabetical order, then the duck-typed matches."""
    layers_of: dict[int, list[str]] = {}
    rules: dict[int, Rule] = {}
    for layer, rule in registered_rules():
        key = id(rule.per_sample_grads)
        layers_of.setdefault(key, []).append(_layer_name(layer))
        rules[key] = rule
    order = sorted(rules, key=lambda key: (not layers_of[key][0].startswith("`"), layers_of[key][0].lower()))
    rows = [
        "| layers | rule | per-sample gradient | batch |",
        "|---|---|---|---|",
        *(_row(", ".join(layers_of[key]), rules[key], _batch(rules[key])) for key in order),
        _row("any other module with trainable parameters", GENERIC, "dim 0"),
    ]
    return "\n".join(rows)


def _row(layers: str, rule: Rule, batch: str) -> str:
    return f"| {layers} | {_rule_cell(rule)} | {_summary(rule)} | {batch} |"


def _layer_name(layer: object) -> str:
    if isinstance(layer, type):
        prefix = "nn." if getattr(nn, layer.__name__, None) is layer else f"{layer.__module__}."
        return f"`{prefix}{layer.__name__.lstrip('_')}`"
    return _first_paragraph(layer)  # a predicate: its docstring says what it matches


def _rule_cell(rule: Rule) -> str:
    return f"`{rule.name}`" + (" (per call)" if rule.per_call else "")


def _summary(rule: Rule) -> str:
    return _first_paragraph(rule.per_sample_grads)


def _batch(rule: Rule) -> str:
    if rule.batch_dim is not None:
        return _first_paragraph(rule.batch_dim)
    return "any dim (time-major calls too)" if rule.position_wise else "dim 0"


def _first_paragraph(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def write(path: Path) -> None:
    """Replace the generated table in the page at `path`."""
    page = path.read_text()
    head, rest = page.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{layers_table()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
