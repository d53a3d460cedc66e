"""nn.PReLU, nn.Bilinear and nn.EmbeddingBag against the oracle, in every mode."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.conftest import MODES
from tests.oracle import check_against_oracle
from tests.strategies import batches, modes, norm_strategies, odd, per_sample_loss


@given(batch=batches, channels=st.integers(1, 3), shared_slope=st.booleans(), rank=st.integers(2, 4), mode=modes)
def test_prelu_matches_oracle(batch, channels, shared_slope, rank, mode):
    prelu = nn.PReLU(1 if shared_slope else channels, init=0.3)
    model = nn.Sequential(nn.Flatten(0, 0), prelu).double()
    x = torch.randn(batch, channels, *(3,) * (rank - 2), dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)


@given(
    batch=batches,
    lead=st.lists(st.integers(1, 3), max_size=2),
    d1=odd,
    d2=st.integers(1, 4),
    bias=st.booleans(),
    mode=modes,
    strategy=norm_strategies,
)
def test_bilinear_matches_oracle(batch, lead, d1, d2, bias, mode, strategy):
    model = nn.Bilinear(d1, d2, 3, bias=bias).double()
    x1 = torch.randn(batch, *lead, d1, dtype=torch.float64)
    x2 = torch.randn(batch, *lead, d2, dtype=torch.float64)
    check_against_oracle(
        model, lambda s: per_sample_loss(model(x1[s], x2[s])), batch, mode=mode, norm_strategy=strategy
    )


class Bags(nn.Module):
    def __init__(self, bag: nn.EmbeddingBag, ragged: bool):
        super().__init__()
        self.bag, self.out, self.ragged = bag, nn.Linear(bag.embedding_dim, 2), ragged

    def forward(self, ids, weights, lengths):
        if not self.ragged:  # [B, N]: one bag per row
            return self.out(self.bag(ids, per_sample_weights=weights))
        keep = torch.arange(ids.shape[1]) < lengths[:, None]  # bag b: its first lengths[b] ids
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        if not self.bag.include_last_offset:
            offsets = offsets[:-1]
        flat_weights = None if weights is None else weights[keep]
        return self.out(self.bag(ids[keep], offsets, per_sample_weights=flat_weights))


@given(
    batch=batches,
    width=st.integers(1, 4),
    mode=st.sampled_from(["sum", "mean"]),
    ragged=st.booleans(),
    include_last_offset=st.booleans(),
    weighted=st.booleans(),
    padding=st.sampled_from([None, 0]),
    engine_mode=modes,
)
def test_embedding_bag_matches_oracle(batch, width, mode, ragged, include_last_offset, weighted, padding, engine_mode):
    """2-D bags and ragged bags given by offsets (empty ones too), per-sample weights, padding_idx."""
    weighted = weighted and mode == "sum"  # (torch allows per-sample weights with "sum" only)
    bag = nn.EmbeddingBag(5, 3, mode=mode, include_last_offset=ragged and include_last_offset, padding_idx=padding)
    model = Bags(bag, ragged).double()
    ids = torch.randint(0, 5, (batch, width))
    weights = torch.rand(batch, width, dtype=torch.float64) if weighted else None
    lengths = torch.randint(0, width + 1, (batch,))

    def loss(s):
        return per_sample_loss(model(ids[s], None if weights is None else weights[s], lengths[s]))

    check_against_oracle(model, loss, batch, mode=engine_mode)


@pytest.mark.parametrize("mode", MODES)
def test_new_layers_in_every_mode(mode):
    model = nn.Sequential(
        nn.Conv3d(2, 3, 2), nn.PReLU(3), nn.ConvTranspose3d(3, 2, 2, stride=2), nn.InstanceNorm3d(2, affine=True)
    ).double()
    x = torch.randn(3, 2, 3, 3, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3, mode=mode)
    model.zero_grad()
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(per_sample_loss(model(x)))
        assert "generic" not in engine.strategies.values()


def test_embedding_bag_max_mode_is_refused():
    with pytest.raises(FlashDPError, match=r"mode='max' is not supported.*use 'sum' or 'mean'"):
        flashdp.make_private(nn.EmbeddingBag(5, 3, mode="max"), max_grad_norm=1.0, noise_multiplier=1.0)
