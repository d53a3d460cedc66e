"""Smoke tests of the examples with tiny settings: they run end to end and report a finite epsilon."""

import importlib.util
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_train_lm_demo_runs(tmp_path, mode):
    demo = _load("train_lm")
    plot = tmp_path / "loss.png"
    summary = demo.main(
        ["--steps", "3", "--pretrain-steps", "2", "--seq-len", "16", "--batch-size", "8", "--micro-batch", "4",
         "--d-model", "16", "--layers", "1", "--target-epsilon", "20", "--mode", mode, "--plot", str(plot),
         "--sweep-epsilons", "5", "--pretrain-batch-size", "8"]
    )  # fmt: skip
    assert plot.stat().st_size > 1000
    assert 0 < summary["epsilon"] <= 20 and summary["steps"] == 3
    assert summary["val_loss"].keys() == {
        "private fine-tune", "private from scratch", "non-private fine-tune", "private fine-tune, epsilon 5",
        "public pre-training only",
    }  # fmt: skip
    assert all(math.isfinite(loss) for loss in summary["val_loss"].values())
    assert 4 < summary["epsilons"]["private fine-tune, epsilon 5"] <= 5 < summary["epsilons"]["private fine-tune"]


def test_quickstart_runs(monkeypatch, capsys):
    quickstart = _load("quickstart")
    monkeypatch.setattr("sys.argv", ["quickstart.py", "--epochs", "0.5", "--epsilon", "5"])
    quickstart.main()
    assert "test accuracy" in capsys.readouterr().out


def test_fsdp_llama_suite_runs_under_torchrun_and_plots(tmp_path):
    """The documented command (`torchrun --nproc_per_node=2`), tiny: one JSON per run, then the figure and table."""
    import json
    import subprocess

    out = tmp_path / "results"
    tiny = ["--modes", "no_dp,bk,ghost", "--seq-lens", "8,16", "--batch", "2", "--steps", "1", "--warmup", "0",
            "--d-model", "16", "--layers", "1", "--heads", "2", "--vocab", "32", "--out", str(out)]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    subprocess.run([*torchrun, str(EXAMPLES / "fsdp_llama.py"), *tiny], check=True, timeout=300)
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert {(r["mode"], r["seq_len"]) for r in runs} == {(m, t) for m in ("no_dp", "bk", "ghost") for t in (8, 16)}
    for r in runs:
        assert r["world_size"] == 2 and r["global_batch"] == 4 and r["mean_step_s"] > 0
    _load("plot_fsdp_llama").main([str(out)])
    assert (out / "fsdp_llama.png").stat().st_size > 1000
    summary = (out / "summary.md").read_text()
    assert summary.count("| fsdp2 |") == 6 and "| bk | 16 |" in summary


def test_hf_trainer_example_trains_and_resumes(tmp_path):
    example = _load("hf_trainer")
    tiny = ["--max-steps", "2", "--batch-size", "4", "--micro-batch", "2", "--seq-len", "8", "--d-model", "16",
            "--layers", "1", "--target-epsilon", "20", "--output-dir", str(tmp_path)]  # fmt: skip
    trainer = example.main(tiny)
    assert trainer.engine.steps == 2 and 0 < trainer.engine.epsilon(1e-5) <= 20
    assert any("epsilon" in entry for entry in trainer.state.log_history)
    shutil.rmtree(tmp_path / "checkpoint-2")
    resumed = example.main([*tiny, "--resume"])  # from checkpoint-1
    assert resumed.engine.steps == 2, "the accounting continues from the checkpoint of step 1"
    assert resumed.engine.epsilon(1e-5) == trainer.engine.epsilon(1e-5)


def test_user_level_lm_runs():
    demo = _load("user_level_lm")
    summary = demo.main(
        ["--steps", "3", "--pretrain-steps", "2", "--seq-len", "16", "--d-model", "16", "--layers", "1",
         "--target-epsilon", "20"]
    )  # fmt: skip
    assert 0 < summary["epsilon"] <= 20
    assert summary["val_loss"].keys() == {
        "public pre-training only", "DP fine-tune, one user protected", "DP fine-tune, one verse protected",
    }  # fmt: skip
    assert all(math.isfinite(loss) for loss in summary["val_loss"].values())
    assert summary["sigma per user"] > 0 and summary["sigma per verse"] > 0


def _hf_trainer_on_a_process(rank: int, out: str) -> dict:
    """The HF Trainer example on process `rank` of 2, as `torchrun --nproc_per_node 2` starts it."""
    from tests.distributed import launch

    launch.as_torchrun_process(rank)  # (the example chooses its backend: gloo on CPU)
    tiny = ["--max-steps", "2", "--batch-size", "4", "--micro-batch", "2", "--seq-len", "8", "--d-model", "16",
            "--layers", "1", "--target-epsilon", "20", "--output-dir", out]  # fmt: skip
    trainer = _load("hf_trainer").main(tiny)
    return {"world": trainer.args.world_size, "steps": trainer.engine.steps, "params": list(trainer.model.parameters())}


def test_hf_trainer_example_runs_on_two_processes(tmp_path):
    from tests.distributed import launch

    ranks = launch.run(_hf_trainer_on_a_process, str(tmp_path))
    assert [r["world"] for r in ranks] == [2, 2] and [r["steps"] for r in ranks] == [2, 2]
    for p, q in zip(*(r["params"] for r in ranks), strict=True):
        assert torch.equal(p, q), "the processes hold the same model"
