"""The shape the code keeps (DESIGN: small modules with one job): functions under 60 lines, classes under 300, no
import cycle between flashdp's modules."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
MODULES = {
    ".".join(path.relative_to(SOURCE).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted((SOURCE / "flashdp").rglob("*.py"))
}
#: functions whose docstring is the public API's reference (one line per argument): their code is what counts
API_REFERENCE_DOCSTRINGS = {"make_private", "register_rule"}


def _definitions() -> list[tuple[str, ast.AST, int, int]]:
    """(module, node, lines, docstring lines) of every function and class."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = node.body[0]
                is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                doc = first.end_lineno - first.lineno + 1 if is_doc and isinstance(first.value.value, str) else 0
                found.append((name, node, node.end_lineno - node.lineno + 1, doc))
    return found


def test_functions_are_under_60_lines():
    long = [
        f"{module}.{node.name}: {lines} lines"
        for module, node, lines, doc in _definitions()
        if not isinstance(node, ast.ClassDef)
        and (lines if node.name not in API_REFERENCE_DOCSTRINGS else lines - doc) >= 60
    ]
    assert not long


def test_classes_are_under_300_lines():
    long = [
        f"{module}.{node.name}: {lines} lines"
        for module, node, lines, _ in _definitions()
        if isinstance(node, ast.ClassDef) and lines >= 300
    ]
    assert not long


def _imports(module: str) -> set[str]:
    """The flashdp modules `module` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashdp"):
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("flashdp"))
    return {name for name in found if name in MODULES and name != module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if cycle := visit(imported, [*path, module]):
                return cycle
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module, []))), None)


def test_no_import_cycle():
    cycle = _cycle({module: _imports(module) for module in MODULES})
    assert cycle is None, " -> ".join(cycle)
