"""The sensitivity audit DP rests on: removing any one sample changes the summed clipped gradient by at most C."""

import pytest
import torch
from torch import nn

import flashdp

C = 0.3


def _mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mix(self.norm(self.embed(ids)))))


MODELS = {
    "mlp": (_mlp, lambda: torch.randn(6, 5) * torch.logspace(-2, 2, 6)[:, None]),
    "cnn": (_cnn, lambda: torch.randn(6, 2, 6, 6) * torch.logspace(-2, 2, 6)[:, None, None, None]),
    "tied_lm": (TinyLM, lambda: torch.randint(0, 11, (6, 7))),
}


def _clipped_sum(model, engine, x) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    engine.backward(model(x).square().flatten(1).sum(1))
    return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("clipping", ["flat", "per_layer", "automatic"])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_removing_one_sample_moves_the_sum_by_at_most_c(model_name, clipping, mode):
    build, data = MODELS[model_name]
    model, x = build(), data()
    with flashdp.make_private(model, mode=mode, max_grad_norm=C, noise_multiplier=1.0, clipping=clipping) as engine:
        full = _clipped_sum(model, engine, x)
        norms = engine.backward(model(x).square().flatten(1).sum(1))
        assert (norms > C).any(), "the audit must exercise clipping"
        for i in range(len(x)):
            without_i = _clipped_sum(model, engine, torch.cat([x[:i], x[i + 1 :]]))
            assert (full - without_i).norm() <= C * (1 + 1e-5)
