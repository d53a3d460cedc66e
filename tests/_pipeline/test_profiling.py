import re
import time

import pytest
import torch
from torch import nn

import flashdp
from flashdp._pipeline.profiling import PHASES, PhaseTimer


def _two_profiled_steps(model: nn.Module, x: torch.Tensor, capsys, **kwargs) -> tuple[flashdp.DPEngine, str]:
    """The engine, and what profile=True made it print to stderr over two DP-SGD steps on the batch `x`."""
    engine = flashdp.make_private(
        model, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=torch.optim.SGD(model.parameters(), 0.1),
        expected_batch_size=4, profile=True, **kwargs,
    )  # fmt: skip
    for _ in range(2):
        engine.backward(model(x).sum(1))
        engine.step()
    return engine, capsys.readouterr().err


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_profile_prints_every_phase_of_each_step(mode, capsys):
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 2))  # noise and optimizer take > 0.01 ms
    _, report = _two_profiled_steps(model, torch.randn(4, 512), capsys, mode=mode)
    assert report.count("flashdp step") == 2
    for phase in PHASES:
        assert re.search(rf"{phase}\s+[\d.]+ ms", report), phase
    # every phase a single process runs is timed (communication only happens with several ranks)
    times = {p: float(re.search(rf"{p}\s+([\d.]+) ms", report).group(1)) for p in PHASES}
    assert all(times[p] > 0 for p in PHASES if p != "communication"), times
    total = float(re.search(r"flashdp step 2: ([\d.]+) ms", report).group(1))
    parts = sum(float(v) for v in re.findall(r"\s([\d.]+) ms\s+[\d.]+%", report.split("flashdp step 2")[1]))
    assert parts == pytest.approx(total, abs=0.005 * (len(PHASES) + 1))  # each figure is rounded to 0.01 ms


def test_profile_is_off_by_default_and_on_with_the_environment(monkeypatch, capsys):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    for env, expected in (("", 0), ("1", 1)):
        monkeypatch.setenv("FLASHDP_PROFILE", env)
        engine = flashdp.make_private(
            model, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=opt, expected_batch_size=2
        )
        engine.backward(model(torch.randn(2, 3)).sum(1))
        engine.step()
        engine.detach()
        assert capsys.readouterr().err.count("flashdp step") == expected


def test_nested_phases_are_counted_once():
    """A collective inside the bk sums counts as communication only, not twice."""
    timer = PhaseTimer(True)
    with timer.phase("second pass / bk sums"):
        with timer.phase("communication"):
            time.sleep(0.3)
        time.sleep(0.01)
    # counted twice, the outer phase would hold 0.31 s; a loaded machine may delay a wake-up, not by 0.2 s
    assert timer.seconds["communication"] >= 0.3
    assert 0.01 <= timer.seconds["second pass / bk sums"] < 0.2


def test_profile_names_the_strategy_of_each_norm_once(capsys):
    """The generic rule is the fallback a slow model should be checked for: its parameters are named."""

    class WithRawParameter(nn.Module):
        """`mix` multiplies the batch (the generic rule counts it); `offset` is added to it (counted there)."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.mix, self.offset = nn.Parameter(torch.eye(3)), nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return self.lin(x) @ self.mix + self.offset

    engine, report = _two_profiled_steps(WithRawParameter(), torch.randn(4, 3), capsys)
    assert report.count("  norms: ") == 1  # unchanged on the second step
    counts = dict(re.findall(r"(\S+) (\d+)", report.split("norms: ")[1].splitlines()[0]))
    assert counts == {
        strategy: str(list(engine.strategies.values()).count(strategy)) for strategy in engine.strategies.values()
    }
    assert "generic 2 ('mix', 'offset')" in report
