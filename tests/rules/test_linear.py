from unittest import mock

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers.pytorch_utils import Conv1D

from flashdp.kernels.outer_norm import reference as outer_norm_reference
from tests.oracle import check_against_oracle
from tests.strategies import batches, clippings, modes, norm_strategies, odd, per_sample_loss, tiles


@given(
    batch=batches,
    lead=st.lists(st.integers(1, 3), max_size=2),
    d=odd,
    p=odd,
    bias=st.booleans(),
    mode=modes,
    clipping=clippings,
    strategy=norm_strategies,
    tile=tiles,
)
def test_linear_any_rank_matches_oracle(batch, lead, d, p, bias, mode, clipping, strategy, tile):
    """2-D, 3-D and 4-D inputs; the hidden layer also sees activations that require grad."""
    model = nn.Sequential(nn.Linear(d, p, bias=bias), nn.Tanh(), nn.Linear(p, 2, bias=bias)).double()
    x = torch.randn(batch, *lead, d, dtype=torch.float64)
    with mock.patch.object(outer_norm_reference, "GHOST_TILE", tile):
        check_against_oracle(
            model,
            lambda s: per_sample_loss(model(x[s])),
            batch,
            mode=mode,
            clipping=clipping,
            norm_strategy=strategy,
        )


@given(batch=batches, t=odd, d=odd, p=odd, mode=modes, strategy=norm_strategies, tile=tiles)
def test_hf_conv1d_matches_oracle(batch, t, d, p, mode, strategy, tile):
    """GPT-2's Conv1D: a Linear with a transposed [d, p] weight."""
    model = nn.Sequential(Conv1D(p, d), nn.GELU(), Conv1D(3, p)).double()
    x = torch.randn(batch, t, d, dtype=torch.float64)
    with mock.patch.object(outer_norm_reference, "GHOST_TILE", tile):
        check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode, norm_strategy=strategy)


def test_linear_followed_by_inplace_relu_matches_oracle():
    """nn.Linear on a 3-D input returns a view; ReLU(inplace=True) re-routes the graph around it."""
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3)).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    for mode in ("bk", "ghost"):
        check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4, mode=mode)


class _WithAnEmptyLinear(nn.Module):
    """A Linear with no outputs beside real ones (its output is [B, ..., 0])."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.empty, self.b = nn.Linear(4, 3), nn.Linear(4, 0), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(self.a(x)) + self.empty(x).sum(-1, keepdim=True)


@given(batch=batches, lead=st.lists(st.integers(1, 3), max_size=2), mode=modes)
def test_a_linear_of_no_outputs_matches_oracle(batch, lead, mode):
    """2-D and 4-D inputs too: its positions are counted, not inferred from its (no) elements."""
    model = _WithAnEmptyLinear().double()
    x = torch.randn(batch, *lead, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)
