"""The clipped sum's plain-PyTorch reference (what runs without Triton, and the kernel's oracle) against a sum of
per-sample products taken one sample and one group at a time, in float64."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashdp.kernels.clipped_sum import reference
from tests.oracle import seeded


@settings(deadline=None, max_examples=40)
@given(
    batch=st.integers(0, 3),
    conv_groups=st.integers(1, 3),
    t=st.integers(1, 5),
    p=st.integers(1, 6),  # (p < d scales the left factor, p > d the right one)
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    layouts=st.tuples(*[st.sampled_from(["rows", "transposed"])] * 2),
)
def test_reference_clipped_sum_is_the_weighted_sum_of_per_sample_products(batch, conv_groups, t, p, d, seed, layouts):
    """Also with factors of transposed layout (each row's `[t, k]` stored as `[k, t]`, as a loss reading logits
    through `.transpose(1, 2)` leaves their gradient), which are not one matrix without a copy."""
    g = seeded(seed)
    left, right = (
        torch.randn(batch * conv_groups, t, k, generator=g, dtype=torch.float64)
        if layout == "rows"
        else torch.randn(batch * conv_groups, k, t, generator=g, dtype=torch.float64).transpose(1, 2)
        for k, layout in zip((p, d), layouts, strict=True)
    )
    coef = torch.rand(batch, generator=g, dtype=torch.float64)
    expected = torch.zeros(conv_groups, p, d, dtype=torch.float64)
    for b in range(batch):
        for j in range(conv_groups):
            row = b * conv_groups + j
            expected[j] += coef[b] * left[row].T @ right[row]
    torch.testing.assert_close(reference.clipped_sum(left, right, coef, conv_groups), expected, rtol=1e-12, atol=1e-12)
