from unittest import mock

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from flashdp.kernels.outer_norm import reference as outer_norm_reference
from tests.oracle import check_against_oracle
from tests.strategies import batches, clippings, modes, norm_strategies, odd, per_sample_loss, tiles


@given(
    batch=batches,
    lead=st.lists(st.integers(1, 4), max_size=2),
    vocab=st.integers(2, 6),
    d=odd,
    padding=st.sampled_from([None, 0, -1]),
    mode=modes,
    clipping=clippings,
)
def test_embedding_repeated_tokens_and_padding_match_oracle(batch, lead, vocab, d, padding, mode, clipping):
    """A small vocabulary makes tokens repeat within a sample; padding_idx rows get no gradient."""
    model = nn.Sequential(nn.Embedding(vocab, d, padding_idx=padding), nn.Linear(d, 3)).double()
    ids = torch.randint(0, vocab, (batch, *lead))
    check_against_oracle(model, lambda s: per_sample_loss(model(ids[s])), batch, mode=mode, clipping=clipping)


@given(batch=batches, t=odd, vocab=st.integers(2, 7), d=odd, mode=modes, strategy=norm_strategies, tile=tiles)
def test_tied_embedding_and_output_projection_match_oracle(batch, t, vocab, d, mode, strategy, tile):
    """The tied input embedding / output head of GPT-2: the exact norm includes the cross term."""

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.mix = nn.Linear(d, d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.mix(self.embed(ids))))

    model = TiedLM().double()
    ids = torch.randint(0, vocab, (batch, t))
    with mock.patch.object(outer_norm_reference, "GHOST_TILE", tile):
        check_against_oracle(model, lambda s: per_sample_loss(model(ids[s])), batch, mode=mode, norm_strategy=strategy)
