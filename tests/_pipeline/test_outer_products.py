"""The outer-product block math: segment-sum token norms and the cost model."""

import torch

from flashdp._pipeline import outer_products
from flashdp.per_sample import OuterGrad, TokenRows


def test_token_norm_never_builds_a_vocabulary_sized_tensor():
    """Segment sums: memory O(N T d), not O(N V d), even for a huge table."""
    ids = torch.tensor([[3, 999_999_999, 3]])
    right = torch.tensor([[[1.0, 2.0], [5.0, 0.0], [1.0, 0.0]]])
    block = OuterGrad(TokenRows(ids, 1_000_000_000), right)
    # row 3 gets [1, 2] + [1, 0] = [2, 2]; the other row [5, 0]
    assert outer_products.token_norm_sq(block).tolist() == [8.0 + 25.0]


def test_cost_model_picks_ghost_for_short_sequences_and_direct_for_long():
    assert outer_products.norm_strategy(t=16, p=4096, d=4096) == "ghost"
    assert outer_products.norm_strategy(t=8192, p=4096, d=4096) == "direct"
    # the boundary t (p + d) = p d goes to direct (its per-sample gradient is then no larger than A and G)
    assert outer_products.norm_strategy(t=2, p=4, d=4) == "direct"
