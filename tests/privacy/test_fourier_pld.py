"""The Fourier-domain composition's parts, each against an independent computation: the epsilon scan against
dp-accounting's own on the same PMF, the Chernoff window against the exact convolution."""

import math

import numpy as np
import pytest
from dp_accounting.pld import pld_pmf
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashdp.privacy.fourier_pld import (
    TAIL_MASS,
    ComposedPmf,
    FourierComposition,
    StepPmf,
    _truncated,
    epsilon_for_delta,
)


@st.composite
def pmfs(draw):
    """A PMF on a loss grid: its length, where it starts (losses below zero and above), its shape and the mass
    of an infinite loss."""
    length = draw(st.integers(min_value=1, max_value=20_000))
    lower = draw(st.integers(min_value=-3 * length, max_value=length))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    rng = np.random.default_rng(seed)
    probs = rng.random(length) ** draw(st.sampled_from([1, 8, 40]))  # flat to very peaked
    infinity = draw(st.sampled_from([0.0, 1e-9, 1e-6, 0.3]))
    probs *= (1 - infinity) / probs.sum()
    return ComposedPmf(probs, lower, infinity)


@settings(max_examples=60, deadline=None)
@given(pmf=pmfs(), discretization=st.sampled_from([1e-4, 1e-3, 0.05]), delta=st.sampled_from([1e-7, 1e-5, 1e-2]))
def test_the_epsilon_scan_is_dp_accountings_on_the_same_pmf(pmf, discretization, delta):
    assume(pmf.lower * discretization > -700)  # the reference's own scan overflows exp(-loss) below -709
    dense = pld_pmf.DensePLDPmf(discretization, pmf.lower, pmf.probs, pmf.infinity, True)
    expected = dense.get_epsilon_for_delta(delta)
    found = epsilon_for_delta(pmf, discretization, delta)
    if math.isinf(expected):
        assert math.isinf(found)
    else:
        assert found == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_losses_so_large_their_weight_underflows_give_the_loss():
    """dp-accounting's rule: mass above delta whose `e^-loss` underflowed to zero makes epsilon that loss."""
    pmf = ComposedPmf(np.array([0.5, 0.5]), 10_000_000, 0.0)  # losses 1000 and 1000.0001 at 1e-4
    dense = pld_pmf.DensePLDPmf(1e-4, pmf.lower, pmf.probs, pmf.infinity, True)
    assert epsilon_for_delta(pmf, 1e-4, 1e-5) == dense.get_epsilon_for_delta(1e-5) > 999


@settings(max_examples=20, deadline=None)
@given(
    length=st.integers(min_value=2, max_value=40),
    steps=st.integers(min_value=1, max_value=60),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_the_window_holds_all_but_the_tail_mass(length, steps, seed):
    """The exact `steps`-fold convolution has at most TAIL_MASS outside the Chernoff window, and the composition
    equals it inside the window (to rounding)."""
    rng = np.random.default_rng(seed)
    probs = rng.random(length) ** 4
    probs /= probs.sum()
    step = StepPmf("s", probs, -length // 2, 0.0)
    exact = np.ones(1)
    for _ in range(steps):
        exact = np.convolve(exact, probs)
    first, last = step.window(steps)
    assert exact[:first].sum() + exact[last + 1 :].sum() <= TAIL_MASS
    composed = FourierComposition().compose([(step, steps)])
    assert composed.lower == steps * step.lower + first
    np.testing.assert_allclose(composed.probs, exact[first : last + 1], rtol=0, atol=1e-14)
    assert composed.infinity == TAIL_MASS


def test_runs_compose_in_order_as_one_convolution():
    """Two runs, then a third step of the last: the kept prefix and the advanced power give the exact convolution
    of all the steps."""
    a = StepPmf("a", np.array([0.2, 0.5, 0.3]), -1, 0.0)
    b = StepPmf("b", np.array([0.6, 0.4]), 0, 0.01)
    composer = FourierComposition()
    composer.compose([(a, 3), (b, 1)])
    composed = composer.compose([(a, 3), (b, 3)])
    exact = np.ones(1)
    for probs in [a.probs] * 3 + [b.probs] * 3:
        exact = np.convolve(exact, probs)
    start = composed.lower - (3 * a.lower + 3 * b.lower)
    np.testing.assert_allclose(composed.probs, exact[start : start + len(composed.probs)], atol=1e-15)
    assert composed.infinity == pytest.approx(1 - 0.99**3 + 2 * TAIL_MASS, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(pmf=pmfs())
def test_truncation_moves_at_most_the_tail_mass_and_only_pessimistically(pmf):
    """The lowest losses' mass moves up onto the lowest loss kept, the highest's to infinity, each at most half the
    tail mass; the rest is unchanged and no mass is lost."""
    cut = _truncated(pmf)
    assert math.isclose(cut.probs.sum() + cut.infinity, pmf.probs.sum() + pmf.infinity, rel_tol=1e-12)
    assert 0 <= cut.infinity - pmf.infinity <= TAIL_MASS / 2
    offset = cut.lower - pmf.lower
    assert offset >= 0 and pmf.probs[:offset].sum() <= TAIL_MASS / 2
    inner = pmf.probs[offset + 1 : offset + len(cut.probs)]
    assert np.array_equal(cut.probs[1:], inner)
    assert cut.probs[0] >= pmf.probs[offset]
