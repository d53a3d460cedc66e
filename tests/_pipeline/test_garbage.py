"""The cyclic garbage collector is paused while engine.backward runs (its objects die by reference counting before
a collection promotes them toward a full one) and left as the user had it after, also where the backward raises."""

import gc

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError


class Watching(nn.Module):
    """A Linear that records, on every backward through it, whether the collector was enabled."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(3, 1), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        out.register_hook(lambda g: self.seen.append(gc.isenabled()))
        return out[:, 0]


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_during_a_backward_and_the_users_setting_after(mode, enabled):
    model = Watching()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    (gc.enable if enabled else gc.disable)()
    try:
        for batch in (4, 3):
            engine.backward(model(torch.randn(batch, 3)))
            assert gc.isenabled() == enabled
        engine.backward_padding(model(torch.randn(2, 3)))
        assert gc.isenabled() == enabled
        with pytest.raises(FlashDPError):
            engine.backward(model(torch.randn(4, 3)).sum().expand(4))  # (a loss mixing samples)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
    assert model.seen and not any(model.seen), model.seen
