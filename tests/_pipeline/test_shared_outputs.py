"""Outputs shared across the batch (a layer called on a batch of 1, or without a batch dim, then broadcast):
exact per-sample gradients however the broadcast happens and however often the shared output is reused."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.oracle import check_against_oracle
from tests.strategies import batches, modes, per_sample_loss


class SharedBias(nn.Module):
    """T5's pattern: a bias table looked up once, without the batch, added in every layer to activations that
    depend on the earlier layers (so a later frontier's other input reaches the bias through earlier ones)."""

    def __init__(self, layers: int, op: str):
        super().__init__()
        self.table = nn.Embedding(7, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))
        self.op = op

    def forward(self, x):  # x [B, T, 4]
        bias = self.table(torch.arange(x.shape[1]) % 7).unsqueeze(0)  # [1, T, 4], shared
        for layer in self.layers:
            h = layer(x)
            x = torch.tanh(h + bias if self.op == "add" else h * bias.sigmoid())
        return x


@given(batch=batches, steps=st.integers(1, 4), layers=st.integers(1, 3), op=st.sampled_from(["add", "mul"]), mode=modes)
def test_a_shared_output_reused_in_every_layer_is_exact(batch, steps, layers, op, mode):
    model = SharedBias(layers, op).double()
    x = torch.randn(batch, steps, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)


class ExpandedPrompt(nn.Module):
    """PEFT prompt tuning's pattern: a learned prompt expanded to the batch and concatenated to the inputs."""

    def __init__(self):
        super().__init__()
        self.prompt = nn.Embedding(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        prompt = self.prompt(torch.arange(3)).unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.out(torch.cat([prompt, x], 1))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_an_expanded_shared_output_is_exact(mode):
    model = ExpandedPrompt().double()
    x = torch.randn(4, 2, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4, mode=mode)
