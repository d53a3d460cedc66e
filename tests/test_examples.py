"""Smoke tests of the examples with tiny settings: they run end to end and report a finite epsilon."""

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_train_lm_demo_runs(tmp_path, mode):
    demo = _load("train_lm")
    plot = tmp_path / "loss.png"
    summary = demo.main(
        ["--steps", "3", "--seq-len", "16", "--batch-size", "8", "--micro-batch", "4", "--d-model", "16",
         "--layers", "1", "--target-epsilon", "20", "--mode", mode, "--plot", str(plot)]
    )  # fmt: skip
    assert plot.stat().st_size > 1000
    assert 0 < summary["epsilon"] <= 20 and summary["steps"] == 3
    assert math.isfinite(summary["val_loss_private"]) and math.isfinite(summary["val_loss_non_private"])


def test_quickstart_runs(monkeypatch, capsys):
    quickstart = _load("quickstart")
    monkeypatch.setattr("sys.argv", ["quickstart.py", "--epochs", "0.5", "--epsilon", "5"])
    quickstart.main()
    assert "test accuracy" in capsys.readouterr().out
