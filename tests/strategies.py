"""hypothesis strategies shared by the tests."""

from hypothesis import strategies as st

batches = st.integers(min_value=0, max_value=5)
odd = st.integers(min_value=0, max_value=3).map(lambda k: 2 * k + 1)
modes = st.sampled_from(["bk", "ghost"])
clippings = st.sampled_from(["flat", "per_layer", "automatic"])
norm_strategies = st.sampled_from(["auto", "ghost", "direct"])
#: ghost-norm tile sizes: tiny ones make odd T span several ragged tiles.
tiles = st.sampled_from([1, 2, 3, 512])


def per_sample_loss(out):
    """A nonlinear per-sample loss [B] from any batched output."""
    return (out.tanh() * 1.5 + out).square().flatten(1).sum(1)
