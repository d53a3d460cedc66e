import copy
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flashdp
from flashdp.kernels.outer_norm import reference as outer_norm_reference
from tests.oracle import assert_clipped_sums, check_against_oracle, clip, per_sample_grads
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


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("bag", [False, True])
def test_a_negative_padding_index_assigned_later_names_a_row_from_the_end(bag, mode):
    """`padding_idx = -1` set after construction (which makes it non-negative): the forward zeroes the last row's
    gradient; the rule counted it (norms 12% high for EmbeddingBag, .grad 70-97% off in bk)."""
    torch.manual_seed(0)
    layer = nn.EmbeddingBag(10, 4, mode="sum") if bag else nn.Embedding(10, 4)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(1)).double()
    ids = torch.tensor([[9, 1, 9, 2], [3, 9, 4, 5], [1, 2, 6, 9]])
    model(ids)
    reference = copy.deepcopy(model)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    engine.backward(per_sample_loss(model(ids)))
    model.zero_grad(set_to_none=True)
    layer.padding_idx = reference[0].padding_idx = -1
    expected = per_sample_grads(reference, lambda s: per_sample_loss(reference(ids[s])), 3)
    expected_norms, expected_sums = clip(expected, "flat", 1.0)
    torch.testing.assert_close(engine.backward(per_sample_loss(model(ids))).double(), expected_norms, rtol=1e-6, atol=0)
    assert_clipped_sums(model, expected_sums, 1e-7)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_layer_the_generic_rule_counts_that_writes_to_its_parameter_is_refused(mode):
    """The generic rule re-runs a forward: one that writes to its parameter in place (a weight clamped in the
    forward) would write again while autograd holds the parameter (autograd's bare version error before)."""

    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.weight.clamp_(-0.5, 0.5)
            return x @ self.weight

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Clamped())
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(flashdp.FlashDPError, match=r"modifies its parameters \['weight'\] in place"):
        engine.backward(per_sample_loss(model(torch.randn(2, 3))))
