"""The forward hook's tensor leaves: pytree's order, and its walk skipped for the common flat cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

from flashdp._pipeline import recorder

_values = st.one_of(
    st.builds(lambda n: torch.zeros(n), st.integers(0, 3)), st.integers(), st.floats(allow_nan=False), st.none(),
    st.booleans(), st.text(max_size=3),
)  # fmt: skip
_trees = st.recursive(
    _values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(st.text(max_size=2), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(_trees)
def test_the_tensor_leaves_are_pytrees_in_its_order(tree):
    expected = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    got = recorder._tensor_leaves(tree)
    assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize(
    "tree", [torch.zeros(2), (torch.zeros(2),), [torch.zeros(2), 3, None, "mean"], (), {}], ids=repr
)
def test_a_tensor_or_a_flat_tuple_of_tensors_and_plain_values_skips_the_pytree_walk(tree, monkeypatch):
    """(A later module-level name shadowed the plain types of the fast path: every layer call took pytree's walk,
    about 5 us of a recorded call's host time.)"""

    def walked(_):
        raise AssertionError("pytree walk")

    monkeypatch.setattr(recorder, "tree_leaves", walked)
    recorder._tensor_leaves(tree)
