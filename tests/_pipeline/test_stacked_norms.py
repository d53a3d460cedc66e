"""Norms of many small parameters taken together (`norms_together`), whenever the collector's budget makes it take
them: at the end of the pass, or at every parameter (budget 0), against the one-sample-at-a-time oracle."""

import pytest
import torch
from torch import nn

from flashdp._pipeline import collector
from tests.oracle import check_against_oracle
from tests.strategies import per_sample_loss


def small_layers() -> nn.Module:
    """Blocks of one shape (their norms stack), a layer of another, a weight used by two layers (its norm is the
    sum's: never stacked with the others), bias-free and frozen layers."""
    torch.manual_seed(0)
    blocks = [m for _ in range(3) for m in (nn.LayerNorm(4), nn.Linear(4, 4))]
    shared = nn.Linear(4, 4)
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model = nn.Sequential(*blocks, shared, nn.Tanh(), shared, frozen, nn.Linear(4, 3, bias=False), nn.LayerNorm(3))
    return model.double()


@pytest.mark.parametrize("budget", [0, collector.STACKING_BUDGET])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_norms_taken_together_equal_the_oracle(monkeypatch, budget, mode, clipping):
    monkeypatch.setattr(collector, "STACKING_BUDGET", budget)
    model = small_layers()
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    check_against_oracle(model, lambda rows: per_sample_loss(model(x[rows])), 5, mode=mode, clipping=clipping)
