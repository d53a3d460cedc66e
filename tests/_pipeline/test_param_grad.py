"""ParamGradient: the norm of a parameter's summed contributions and its clipped-sum plan, against per-sample
gradients materialised explicitly."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashdp._pipeline.param_grad import ParamGradient, norms_together
from flashdp.per_sample import OuterGrad, TokenRows
from flashdp.rules import conv
from tests.oracle import materialised
from tests.strategies import odd


@st.composite
def blocks(draw):
    """1-3 blocks of one [p, d] layout, dense or token-left, with their own T."""
    n, p, d = draw(st.integers(0, 4)), draw(odd), draw(odd)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        t = draw(st.integers(1, 7))
        if draw(st.booleans()):
            out.append(OuterGrad(torch.randn(n, t, p, dtype=torch.float64), torch.randn(n, t, d, dtype=torch.float64)))
        else:
            ids = torch.randint(0, p, (n, t))
            out.append(OuterGrad(TokenRows(ids, p), torch.randn(n, t, d, dtype=torch.float64)))
    return out


@given(bs=blocks(), strategy=st.sampled_from(["auto", "ghost", "direct"]), data=st.data())
def test_param_gradient_norm_and_clipped_sum_equal_materialised(bs, strategy, data):
    n = bs[0].right.shape[0]
    p, d = bs[0].block_shape
    coef = torch.rand(n, dtype=torch.float64)
    dense = sum(materialised(b) for b in bs)
    grad = ParamGradient("w", (p, d), n, strategy)
    for b in data.draw(st.permutations(bs)):
        grad.add(b, "test")
    norm = grad.norm_sq(keep_for_sum=True)
    torch.testing.assert_close(norm.norm_sq, dense.flatten(1).square().sum(1))
    torch.testing.assert_close(norm.plan.clipped_sum(coef), torch.einsum("n,npd->pd", coef, dense))


@given(batch=st.integers(0, 3), conv_groups=st.integers(1, 3), t=st.integers(1, 5), p=odd, d=odd)
def test_grouped_blocks_stack_per_sample(batch, conv_groups, t, p, d):
    """conv_groups > 1: sample b owns rows b*g .. b*g+g-1, stacked into a [g*p, d] gradient."""
    block = OuterGrad(
        torch.randn(batch * conv_groups, t, p, dtype=torch.float64),
        torch.randn(batch * conv_groups, t, d, dtype=torch.float64),
        conv_groups=conv_groups,
    )
    per_sample = materialised(block).view(batch, conv_groups * p, d)
    coef = torch.rand(batch, dtype=torch.float64)
    for strategy in ("ghost", "direct"):
        grad = ParamGradient("w", (conv_groups * p, d), batch, strategy)
        grad.add(block, "test")
        norm = grad.norm_sq(keep_for_sum=True)
        torch.testing.assert_close(norm.norm_sq, per_sample.flatten(1).square().sum(1))
        torch.testing.assert_close(norm.plan.clipped_sum(coef), torch.einsum("b,bpd->pd", coef, per_sample))


def test_without_keep_for_sum_no_plan_is_kept():
    """ghost and flash take the clipped sum from a second backward: nothing is kept for it."""
    grad = ParamGradient("w", (3, 2), 2, "direct")
    grad.add(OuterGrad(torch.randn(2, 4, 3), torch.randn(2, 4, 2)), "test")
    norm = grad.norm_sq(keep_for_sum=False)
    assert norm.plan is None and norm.strategy == "direct"


def test_half_precision_factors_accumulate_in_float32():
    """The norms ghost and flash clip by, and bk's from factors it keeps (bk's kept bfloat16 per-sample gradients:
    the next test)."""
    left = torch.randn(2, 300, 5).bfloat16()
    right = torch.randn(2, 300, 3).bfloat16()
    block = OuterGrad(left, right)
    exact = materialised(block).flatten(1).square().sum(1)
    for strategy, keep_for_sum in (("ghost", True), ("ghost", False), ("direct", False)):
        grad = ParamGradient("w", (5, 3), 2, strategy)
        grad.add(block, "test")
        got = grad.norm_sq(keep_for_sum=keep_for_sum).norm_sq
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_bk_keeps_a_bfloat16_layers_per_sample_gradients_in_bfloat16_and_clips_what_it_keeps():
    """Half the memory of float32 for a bfloat16 layer's kept per-sample gradients, their norms taken of the
    rounded values the clipped sum adds: every contribution within C; close to the float64 oracle."""
    torch.manual_seed(0)
    n, t, p, d, c = 6, 9, 4, 3, 0.5  # t (p + d) > p d: the direct norm, materialised
    left = (torch.randn(n, t, p) * torch.logspace(-2, 2, n)[:, None, None]).bfloat16()
    right = torch.randn(n, t, d).bfloat16()
    grad = ParamGradient("w", (p, d), n)
    grad.add(OuterGrad(left, right), "test")
    norm = grad.norm_sq(keep_for_sum=True)
    kept = norm.plan.per_sample
    assert norm.strategy == "direct" and kept.dtype == torch.bfloat16
    torch.testing.assert_close(norm.norm_sq.double(), kept.double().square().sum(1), rtol=1e-6, atol=0)
    coef = (c / norm.norm_sq.sqrt()).clamp(max=1.0)
    for b in range(n):
        alone = torch.zeros(n)
        alone[b] = coef[b]
        assert norm.plan.clipped_sum(alone).double().norm() <= c * (1 + 1e-6)
    exact = materialised(OuterGrad(left.double(), right.double()))
    torch.testing.assert_close(
        norm.plan.clipped_sum(coef).double(), torch.einsum("n,npd->pd", coef.double(), exact), rtol=1e-2, atol=1e-3
    )


def test_bk_keeps_a_bfloat16_convolutions_dense_per_sample_gradients_in_bfloat16():
    """The grouped convolution's per-sample gradients (float32) of a bfloat16 layer are kept as the factors' would
    be: in bfloat16, norms of the rounded values; a float32 layer's stay float32."""
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        layer = torch.nn.Conv2d(3, 4, 3, padding=1).to(dtype)
        x = torch.randn(5, 3, 6, 6, dtype=dtype)
        deferred = conv.conv_grads(layer, (x,), torch.randn(5, 4, 6, 6, dtype=dtype), frozenset({"weight"}))["weight"]
        grad = ParamGradient("w", layer.weight.shape, 5)
        grad.add(deferred, "test")
        norm = grad.norm_sq(keep_for_sum=True)
        kept = norm.plan.per_sample
        assert norm.strategy == "direct" and kept.dtype == dtype
        torch.testing.assert_close(norm.norm_sq.double(), kept.double().flatten(1).square().sum(1), rtol=1e-6, atol=0)
        exact = materialised(deferred.factors()).flatten(1).square().sum(1)
        torch.testing.assert_close(norm.norm_sq.double(), exact, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)


small = st.integers(1, 9)


@given(
    rows_form=st.booleans(), count=st.integers(1, 4), batch=st.integers(1, 3), t=st.integers(1, 5), p=small, d=small,
    strategy=st.sampled_from(["auto", "ghost", "direct"]), keep_for_sum=st.booleans(),
)  # fmt: skip
def test_norms_taken_together_are_each_parameters_own(rows_form, count, batch, t, p, d, strategy, keep_for_sum):
    """Several parameters' norms from one computation over their stacked rows: each norm and clipped sum is its own
    parameter's, against per-sample gradients materialised one parameter at a time."""
    gradients, dense = [], []
    for _ in range(count):
        gradient = ParamGradient("w", (p, d), batch, strategy)
        if rows_form:
            contribution = torch.randn(batch, p, d, dtype=torch.float64)
            dense.append(contribution)
        else:
            contribution = OuterGrad(*(torch.randn(batch, t, k, dtype=torch.float64) for k in (p, d)))
            dense.append(materialised(contribution))
        gradient.add(contribution, "test")
        gradients.append(gradient)
    assert len({g.stacking_key() for g in gradients} - {None}) == 1
    coef = torch.rand(batch, dtype=torch.float64)
    for norm, per_sample in zip(norms_together(gradients, keep_for_sum), dense, strict=True):
        torch.testing.assert_close(norm.norm_sq, per_sample.flatten(1).square().sum(1))
        if keep_for_sum or rows_form:  # (rows built whole are kept either way: `ParamGradient`)
            torch.testing.assert_close(norm.plan.clipped_sum(coef), torch.einsum("n,npd->pd", coef, per_sample))
        else:
            assert norm.plan is None


def test_only_gradients_of_one_small_simple_form_and_shape_share_a_stacking_key():
    def gradient(shape, *contributions, batch=2):
        g = ParamGradient("w", shape, batch)
        for c in contributions:
            g.add(c, "test")
        return g

    def block(t, p, d, dtype=torch.float32):
        return OuterGrad(torch.randn(2, t, p, dtype=dtype), torch.randn(2, t, d, dtype=dtype))

    keys = [
        gradient((3, 4), block(5, 3, 4)).stacking_key(),
        gradient((3, 4), block(6, 3, 4)).stacking_key(),  # another T
        gradient((3, 4), block(5, 3, 4, torch.float64)).stacking_key(),
        gradient((3, 4), torch.randn(2, 3, 4)).stacking_key(),
        gradient((4, 3), torch.randn(2, 4, 3)).stacking_key(),
    ]
    assert None not in keys and len(set(keys)) == len(keys)
    assert gradient((3, 4), block(5, 3, 4), block(5, 3, 4)).stacking_key() is None  # two blocks
    tokens = OuterGrad(TokenRows(torch.zeros(2, 5, dtype=torch.long), 3), torch.randn(2, 5, 4))
    assert gradient((3, 4), tokens).stacking_key() is None
    assert gradient((3, 4), block(4096, 3, 4)).stacking_key() is None  # large
    assert gradient((3, 4), torch.randn(0, 3, 4), batch=0).stacking_key() is None


@given(calls=st.integers(1, 6), positions=st.integers(1, 5), stacked=st.booleans())
def test_a_bound_through_rounding_covers_every_part_of_every_call(calls, positions, stacked):
    """The gradient added sums every part of every call (a layer called K times: autograd adds the calls'
    gradients), in whatever order: each of the two sums (measured, added) may be off by `(n - 1) eps / 2` times S,
    n the parts, S their norms' sum (first order), so the bound's margin over the measured norm must be at least
    `(n - 1) eps S`. (A breaker's convolution called 512 times, one position each, added 1.8 C where the bound
    counted the parts of one call.)"""
    layer = torch.nn.Conv1d(2, 2, 1, bias=False)
    gradient = ParamGradient("weight", layer.weight.shape, 3, "direct")
    expected_parts = torch.zeros(3, dtype=torch.float64)
    for _ in range(calls):
        x, grad_output = torch.randn(3, 2, positions), torch.randn(3, 2, positions)
        gradient.add(conv.conv_grads(layer, (x,), grad_output, frozenset({"weight"}))["weight"], "test")
        expected_parts += (x.double().norm(dim=1) * grad_output.double().norm(dim=1)).sum(1)
    if stacked:
        other = ParamGradient("other", layer.weight.shape, 3, "direct")
        other.add(conv.conv_grads(layer, (x,), grad_output, frozenset({"weight"}))["weight"], "test")
        norm = norms_together([gradient, other], keep_for_sum=False)[0]
    else:
        norm = gradient.norm_sq(keep_for_sum=False)
    margin = norm.bound_sq.sqrt() - norm.norm_sq.double().sqrt()
    parts = calls * positions
    assert bool((margin >= (parts - 1) * torch.finfo(torch.float32).eps * expected_parts * (1 - 1e-6)).all())
