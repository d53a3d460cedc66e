"""docs/benchmarks.md is written by several scripts, each owning a section between its markers."""

from __future__ import annotations

from pathlib import Path

MARKDOWN = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, text: str, path: Path = MARKDOWN) -> None:
    """Replace the section `name` of the page (between its begin / end markers) with `text`, or append it."""
    begin, end = f"<!-- begin: {name} (generated) -->", f"<!-- end: {name} -->"
    page = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    path.write_text(page)
