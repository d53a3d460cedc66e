"""The documentation site builds with `mkdocs build --strict`: every page, link and API reference resolves."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocstrings", reason="the docs tools are installed in the main environment only")
ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").stat().st_size > 10_000
