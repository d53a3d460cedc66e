"""The self-check fires on planted bugs that no rule can see, at the documented schedule, and can be turned off.
(It runs by default in every oracle test of the suite, where it must stay silent on correct models.)"""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import flashdp
from flashdp import FlashDPError
from flashdp._pipeline import outer_products, self_check
from flashdp._pipeline.param_grad import ClippedSumPlan
from flashdp.rules import OuterGrad
from tests.conftest import MODES
from tests.oracle import check_against_oracle, per_sample_grads
from tests.strategies import per_sample_loss

DIFFERS = r"Self-check failed for sample \d+: what flashdp counted differs from autograd's"
#: the generic rule's re-run of a module one sample at a time differs from the module's batch outputs
RERUN_DIFFERS = r"recomputed '<root>' \(\w+\)'s output one sample at a time with the generic rule and got another"


def _engine(model, **kwargs):
    return flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0, **kwargs)


class Affine(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_rule_that_drops_a_parameter_is_caught(mode):
    class Dropping(Affine):
        pass

    def drops_bias(module, inputs, grad_output, trainable):
        (x,) = inputs
        return {"weight": (x * grad_output).flatten(1, -2).sum(1), "bias": torch.zeros_like(grad_output).sum(1)}

    flashdp.register_rule(Dropping, drops_bias)
    model = nn.Sequential(nn.Linear(3, 3), Dropping(3))
    with _engine(model, mode=mode) as engine, pytest.raises(FlashDPError, match=rf"(?s){DIFFERS}.*'1.bias'"):
        engine.backward(per_sample_loss(model(torch.randn(4, 5, 3))))


class Projection(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x):
        return x @ self.weight.t()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_strategy", ["ghost", "direct"])
def test_a_rule_that_drops_one_position_of_many_is_caught_in_float32(mode, norm_strategy):
    """(A breaker's finding: the self-check accepted any count within its rounding bound of autograd's, a few
    percent at T = 2048 in float32, and passed a rule dropping one position; a later step whose gradient sat there
    was counted 0 and added unclipped, 20000 C.) The bound's slack is granted only where the parts cancel."""

    class DropsLastPosition(Projection):
        pass

    def drops_last(module, inputs, grad_output, trainable):
        (x,) = inputs
        return {"weight": OuterGrad(grad_output[:, :-1], x[:, :-1])}

    flashdp.register_rule(DropsLastPosition, drops_last)
    torch.manual_seed(0)
    model = DropsLastPosition(2)
    engine = _engine(model, mode=mode, norm_strategy=norm_strategy)
    x = torch.randn(2, 2048, 2)
    with engine, pytest.raises(FlashDPError, match=DIFFERS):
        engine.backward((model(x) * torch.randn(2, 2048, 2)).sum((1, 2)))


class TimeMajor(nn.Module):
    """The inner Linear sees [T, B, d]: its dim 0 is time."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):  # x [B, T, d]
        return self.out(self.inner(x.transpose(0, 1)).transpose(0, 1).tanh())


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("steps", [4, 5], ids=["T==B", "T!=B"])
def test_a_time_major_linear_is_exact(steps, mode):
    """Its output [T, B, d]: with T != B the batch is found in dim 1; with T == B, dim 0 fails the verification
    (its rows are not samples), and dim 1 passes it."""
    model = TimeMajor().double()
    x = torch.randn(4, steps, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: model(x[s]).square().sum((1, 2)), 4, mode=mode)
    model.zero_grad()
    with _engine(model, mode=mode) as engine:
        engine.backward(model(x).square().sum((1, 2)))
        assert "generic" not in engine.strategies.values()


class Permuting(nn.Module):
    """`inner` runs on the rows reversed: its output rows are not samples (its size says they are). With `restore`
    the rows are put back in order: the model is per-sample; with `mix`, samples are mixed between the layers."""

    def __init__(self, restore: bool = True, mix: bool = False):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)
        self.restore, self.mix = restore, mix

    def forward(self, x):
        order = torch.arange(x.shape[0]).flip(0)
        h = self.inner(x[order])
        h = h[order] if self.restore else h
        return self.out((h - h.mean(0) if self.mix else h).tanh())


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_rows_permuted_and_restored_inside_the_forward_are_counted_exactly(mode):
    """Verification finds `inner`'s rows not per-sample: its parameters move to the generic rule of the model,
    whose outputs are."""
    model = Permuting().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4, mode=mode)
    model.zero_grad()
    with _engine(model, mode=mode) as engine:
        engine.backward(per_sample_loss(model(x)))
        assert engine.strategies["inner.weight"] == "generic"
        assert engine.strategies["out.weight"] != "generic"


def test_rows_left_permuted_belong_to_the_loss_that_reads_them():
    """loss[i] reads sample 3 - i alone: each sample still reaches one loss, and row i of every layer is loss i's."""
    model = Permuting(restore=False).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    reversed_ = lambda s: per_sample_loss(model(x.flip(0)[s].flip(0)))  # noqa: E731 (one sample: no reversal)
    check_against_oracle(model, reversed_, 4)


@pytest.mark.parametrize("self_check", [200, None], ids=["default", "self-check-off"])
def test_samples_mixed_between_layers_are_caught(self_check):
    """The model's generic rule, which `inner` moves to, recomputes it one sample at a time, which the batch mean
    makes differ from its outputs on the batch (recomputed for the comparison: the model was recorded as a scope);
    with the self-check off too."""
    model = Permuting(mix=True)
    with _engine(model, self_check=self_check) as engine, pytest.raises(FlashDPError, match=RERUN_DIFFERS):
        engine.backward(per_sample_loss(model(torch.randn(4, 3))))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_loss_using_the_batch_mean_is_caught(mode):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    out = model
    with _engine(model, mode=mode) as engine, pytest.raises(FlashDPError, match=r"(?s)loss.* mix samples"):
        out = model(torch.randn(5, 3))
        engine.backward((out - out.mean(0)).square().sum(1))


def test_a_contrastive_loss_over_the_batch_is_caught():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4))
    with _engine(model) as engine, pytest.raises(FlashDPError, match=r"(?s)loss.* mix samples"):
        z = nn.functional.normalize(model(torch.randn(5, 3)), dim=1)
        engine.backward(nn.functional.cross_entropy(z @ z.T / 0.1, torch.arange(5), reduction="none"))


def test_a_wrong_norm_is_caught():
    """A bug in a norm computation (here: the embedding's segment sums off by 20%) is caught by the comparison."""
    model = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 2))
    wrong = mock.patch.object(
        outer_products, "token_norm_sq", lambda block, _f=outer_products.token_norm_sq: 0.8 * _f(block)
    )
    with wrong, _engine(model) as engine, pytest.raises(FlashDPError, match=rf"(?s){DIFFERS}.*'0.weight'"):
        engine.backward(per_sample_loss(model(torch.randint(0, 9, (3, 6)))))


class SometimesMixing(nn.Module):
    """Correct until `mix` is set to 1: a bug in values alone (the same ops on every step, so the same verified
    structure), which the self-check meets only when it runs."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 3), nn.Linear(3, 2)
        self.mix = 0.0

    def forward(self, x):
        h = self.inner(x)
        return self.out((h - self.mix * h.mean(0)).tanh())


def test_the_self_check_runs_first_then_every_interval():
    model = SometimesMixing()
    x = torch.randn(4, 3)
    with _engine(model, self_check=3) as engine:
        engine.backward(per_sample_loss(model(x)))  # call 0: checked, correct
        model.mix = 1.0
        for _ in range(2):  # calls 1 and 2 are not checked: the bug goes through (the documented trade-off)
            model.zero_grad()
            engine.backward(per_sample_loss(model(x)))
        model.zero_grad()
        with pytest.raises(FlashDPError, match=rf"{DIFFERS}|{RERUN_DIFFERS}"):  # call 3 is (its layout check
            # moves `inner` to the model's generic rule, whose re-run differs from the batch's outputs)
            engine.backward(per_sample_loss(model(x)))


def test_the_self_check_can_be_turned_off():
    """Off, it no longer compares per-sample gradients: a wrong rule goes through (the layout check, one extra pass
    on every new forward structure, stays)."""

    class Dropping(Affine):
        pass

    flashdp.register_rule(Dropping, lambda m, inputs, g, trainable: {"weight": g.sum(1) * 0, "bias": g.sum(1) * 0})
    model = Dropping(3)
    with _engine(model, self_check=None) as engine:
        engine.backward(per_sample_loss(model(torch.randn(4, 5, 3))))


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "always"])
def test_a_bad_self_check_interval_is_refused(value):
    with pytest.raises(FlashDPError, match=r"self_check is the number of backward calls between two self-checks"):
        _engine(nn.Linear(2, 2), self_check=value)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_failed_verification_leaves_nothing_learnt(mode):
    """`[B, T, d]` with T == B and a loss that mixes samples: verifying, the Linears are tried time-major (their
    dim 1 has size B too) before the error. The next backward, with a correct loss and the same layers called,
    must not trust that layout."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(4, 4, 3, dtype=torch.float64)
    loss_of = lambda s: model(x[s]).square().sum((1, 2))  # noqa: E731
    with flashdp.make_private(model, mode=mode, max_grad_norm=1e6, noise_multiplier=1.0) as engine:
        out = model(x)
        with pytest.raises(FlashDPError, match=r"(?s)loss.* mix samples"):
            engine.backward((out - out.mean(0)).square().sum((1, 2)))
        model.zero_grad()
        norms = engine.backward(loss_of(slice(None)))
    expected = torch.cat([g.flatten(1) for g in per_sample_grads(model, loss_of, 4).values()], dim=1).norm(dim=1)
    torch.testing.assert_close(norms.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("shape", "dim"),
    [((6, 5, 7), 0), ((5, 6, 7), 1), ((18, 4), 0), ((6,), 0), ((6, 9, 1), 0), ((6, 3, 4, 5), 0)],
    ids=["batch-first", "time-major", "folded-rows", "one-value", "trailing-1", "4-d"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("down", [False, True], ids=["weights-up", "weights-down"])
def test_row_sketches_pass_scaled_rows_exactly_and_catch_mixed_ones(shape, dim, dtype, down):
    """The weighted pass's gradient of a per-sample output is each sample's rows times its power of two (at least 1,
    or at most 1 where rows would overflow): the sketch's error is then exactly 0. Rows that are another sample's
    are caught at every tolerance the check uses."""
    batch = 6
    grad = torch.randn(shape, dtype=torch.float64).to(dtype)
    top, generator = self_check._MAX_EXPONENT[dtype], torch.Generator().manual_seed(0)
    (weights,) = self_check._weight_passes(batch, top, down, generator).to(grad.device)
    assert (weights <= 1).all() if down else (weights >= 1).all()
    sketch = self_check.RowSketch.of(grad, torch.Size(shape), dim, batch, seed=3)
    by_sample = grad.movedim(dim, 0)
    by_sample = by_sample.reshape(batch, -1, *by_sample.shape[1:])  # (folded rows: k per sample)
    scale = weights.to(dtype).reshape(batch, *[1] * (by_sample.dim() - 1))
    scaled = (by_sample * scale).reshape(grad.movedim(dim, 0).shape).movedim(0, dim)
    floors = self_check.sample_floors([(sketch,)], batch, grad.device)
    assert not sketch.fails(scaled, torch.Size(shape), dim, weights, rtol=0.0, floor=floors)
    mixed = by_sample * scale
    mixed[1] = mixed[2]  # sample 1's rows are another sample's
    mixed = mixed.reshape(grad.movedim(dim, 0).shape).movedim(0, dim)
    assert sketch.fails(mixed, torch.Size(shape), dim, weights, rtol=self_check.tolerance([dtype]), floor=floors)


@pytest.mark.parametrize("wrong", ["negated", "rows swapped", "one entry off"])
def test_a_wrong_clipped_sum_is_caught_in_bk(wrong):
    """A bug in bk's clipped sum that leaves the norms right (the gradient negated, two of its rows swapped, one
    entry of a 16 x 16 weight off by 1% of the gradient's norm: a few times the tolerance) is caught through the
    projections of autograd's gradient, taken before the norm pass."""
    original = ClippedSumPlan.clipped_sum

    def clipped_sum(plan, coef):
        gradient = original(plan, coef)
        if wrong == "negated":
            return -gradient
        if gradient.dim() < 2:
            return gradient
        if wrong == "rows swapped":
            return gradient[[1, 0, *range(2, len(gradient))]]
        off = torch.zeros_like(gradient)
        off.view(-1)[off.numel() // 3] = 0.01 * gradient.norm()
        return gradient + off

    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16))
    with (
        mock.patch.object(ClippedSumPlan, "clipped_sum", clipped_sum),
        _engine(model, mode="bk") as engine,
        pytest.raises(FlashDPError, match=rf"(?s){DIFFERS}.*the gradient it would add"),
    ):
        engine.backward(per_sample_loss(model(torch.randn(4, 5, 3))))


def test_streamed_gradients_reduces_each_gradient_as_autograd_computes_it():
    """Leaves (reduced in their hook, a zero-strided stand-in returned to autograd), a tensor computed from a leaf
    (reduced after the pass, its hook would change what flows to the leaf), and a tensor the target does not reach
    (None): each reduced once, equal to autograd's gradient; the graph is kept."""
    weight, bias, unused = (torch.randn(n, requires_grad=True) for n in (6, 3, 2))
    scaled = weight * 2.0  # reached through the leaf `weight`: both are asked for
    x = torch.randn(5, 2, 3)
    target = ((x @ scaled.view(2, 3).T + bias[:2]) ** 2).sum()
    tensors = {"weight": weight, "scaled": scaled, "bias": bias, "unused": unused}
    expected = dict(
        zip(
            tensors,
            torch.autograd.grad(target, list(tensors.values()), retain_graph=True, allow_unused=True),
            strict=True,
        )
    )
    seen: dict[str, tuple[Tensor | None, int]] = {}

    def reduce(key, gradient, seed):
        assert key not in seen
        seen[key] = (None if gradient is None else gradient.clone(), seed)

    self_check.streamed_gradients(target, tensors, reduce)
    assert seen["unused"] == (None, 3)
    for seed, key in enumerate(["weight", "scaled", "bias"]):
        torch.testing.assert_close(seen[key][0], expected[key], rtol=0, atol=0)
        assert seen[key][1] == seed
    torch.autograd.grad(target, [weight])  # (the graph was kept)


@pytest.mark.parametrize("shape", [(7,), (5, 6), (4, 3, 2, 2), ()])
def test_projections_estimate_the_norm_of_a_difference(shape):
    """`project` is linear and the same for a seed; over many seeds the mean square of the projections of a
    difference is its squared norm (E[(u^T D v)^2] = ||D||^2), so a gradient off by d is told apart from one off by
    rounding."""
    a, d = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(self_check.project(a + d, 5), self_check.project(a, 5) + self_check.project(d, 5))
    mean_square = torch.stack([self_check.project(d, seed).square().mean() for seed in range(2000)]).mean()
    torch.testing.assert_close(mean_square, d.square().sum(), rtol=0.15, atol=0)
    assert (self_check.project(a, 5) - self_check.project(a.float(), 5)).abs().max() < 1e-4 * (1 + a.norm())


def test_no_entry_is_seen_only_through_small_projections():
    """A wrong entry's error reaches the comparison scaled by its directions' RMS (sqrt(mean_k (u_ik v_jk)^2)): with
    the projections kept, no entry of a 32 x 32 weight is scaled below 0.3 (an error a few times the tolerance is
    seen), for several draws."""
    basis = torch.eye(32 * 32).reshape(-1, 32, 32)
    for seed in range(3):
        scales = torch.stack([self_check.project(entry, seed).square().mean().sqrt() for entry in basis])
        assert scales.min() > 0.3, (seed, scales.min())


def test_each_self_check_draws_its_projections_anew():
    """A bug confined to entries that one draw sees weakly is not missed on every check: the directions' seed is
    drawn per check (the same on every rank: from the self-check's generator)."""
    seeds = []
    original = self_check.unit_gradients

    def recording(*args, seed, **kwargs):
        seeds.append(seed)
        return original(*args, seed=seed, **kwargs)

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with mock.patch.object(self_check, "unit_gradients", recording), _engine(model, self_check=1) as engine:
        for _ in range(3):
            engine.backward(per_sample_loss(model(torch.randn(4, 5, 3))))
            model.zero_grad()
    assert len(seeds) == 3 and len(set(seeds)) == 3, seeds


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("margin", [60.0, 100.0], ids=["squares-subnormal", "squares-zero"])
def test_samples_fit_so_well_that_float32_squares_underflow_pass(mode, margin):
    """A classifier whose every sample is fit with a logit margin of 60-100 (late training): each sample's gradient
    is about e^-margin (1e-26 to 1e-44), whose float32 squares are subnormal or 0, so the counted norms lose their
    digits or are 0 where autograd's float64 norms are not. Clipping cannot add more than C from such a sample
    whatever its counted norm: the self-check must not refuse it, on any step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        model[2].weight.mul_(0.1)
        model[2].bias.copy_(torch.tensor([margin, 0.0, 0.0]))
    x, y = torch.randn(4, 6), torch.zeros(4, dtype=torch.long)
    with _engine(model, mode=mode, self_check=1) as engine:
        for _ in range(3):
            model.zero_grad()
            norms = engine.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
    assert (norms < 1e-20).all()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize(("scale", "max_grad_norm"), [(1e-12, 1.0), (1e-16, 1e-17)])
def test_a_rule_that_drops_a_parameter_is_caught_on_tiny_gradients(mode, scale, max_grad_norm):
    """The self-check's allowance for float32 squares that underflow is no wider than that: a rule dropping a
    parameter is caught on samples whose gradients are 1e-12, far below any clipping bound in use, and on smaller
    ones where the clipping bound is smaller still (the allowance never exceeds the bound's share)."""

    class TinyDropping(Affine):
        pass

    flashdp.register_rule(
        TinyDropping, lambda m, inputs, g, trainable: {"weight": (inputs[0] * g).sum(1), "bias": g.sum(1) * 0}
    )
    model = TinyDropping(3)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=max_grad_norm, noise_multiplier=1.0)
    with engine, pytest.raises(FlashDPError, match=rf"(?s){DIFFERS}.*'bias'"):
        engine.backward(scale * per_sample_loss(model(torch.randn(4, 5, 3))))


class MixingInTheBackward(nn.Module):
    """Exact forward; in the backward, where the inputs' last feature is 1, row i - 1 of the first layer's output
    gradient also receives row i's (a straight-through term)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d, bias=False), nn.Linear(d, 1, bias=False)
        self.b.weight.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        rolled = (h * x[:, -1:]).roll(1, 0)
        return self.b(h + (rolled - rolled.detach())).squeeze(1)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_samples_mixing_at_float16s_subnormal_scale_are_caught(mode):
    """(A breaker's finding: the allowance for subnormal rounding was 2^8 float16 subnormals per element, 1.5e-5,
    so in float16 rows of another sample mixed in at that size passed and one sample added 2 C.) The allowance is
    capped far below any gradient that matters: float16 gets none."""
    torch.manual_seed(0)
    model = MixingInTheBackward(64).half()
    only_first = torch.tensor([1e-4, 0, 0, 0], dtype=torch.half)
    with flashdp.make_private(model, mode=mode, max_grad_norm=1e-5, noise_multiplier=0.0) as engine:
        for flag in (0.0, 1.0):
            x = torch.randn(4, 64)
            x[3], x[:, -1] = x[0], flag
            model.zero_grad()
            if flag:
                with pytest.raises(FlashDPError, match="not separable by sample"):
                    engine.backward(model(x.half()) * only_first)
            else:
                engine.backward(model(x.half()) * only_first)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("size", [1e15, 1e20])
def test_samples_mixing_in_output_gradients_too_large_for_float32_squares_are_caught(mode, size):
    """(A breaker's finding: the rows' float32 norms overflowed past 1.8e19, with the weighted pass's 2^15 already
    at 6e14, and an infinite tolerance passed rows mixing samples: one sample added 2 C.) Output gradients of size
    `size` over inputs of 1 / `size` (parameter gradients of order 1); sample 1's loss also flows into sample 0's
    rows, in the backward only."""
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    weights = torch.full((16,), size)
    weights[0] = 0
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None) as engine:
        h = model(torch.full((16, 3), 1 / size))
        mixed = torch.zeros_like(h).index_put((torch.tensor([1]),), (h[0] - h[0].detach())[None])
        with pytest.raises(FlashDPError, match="not separable by sample"):
            engine.backward((h + mixed).sum(1) * weights)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_large_sample_hides_no_mixing_between_others(mode, dtype):
    """(A breaker's finding: the error floor was relative to the batch's largest sample, so one sample 1e6 times
    the others (1e4 in bfloat16) let sample 1's loss flow into sample 0's rows unseen: sample 1 added 2 C.) The
    floor is each sample's own."""
    model = nn.Linear(3, 3, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    weights = torch.ones(16)
    weights[0], weights[15] = 0, 1e8 if dtype == torch.float32 else 1e5
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None) as engine:
        h = model(torch.ones(16, 3, dtype=dtype))
        mixed = torch.zeros_like(h).index_put((torch.tensor([1]),), (h[0] - h[0].detach())[None])
        with pytest.raises(FlashDPError, match="not separable by sample"):
            engine.backward((h + mixed).sum(1) * weights.to(dtype))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("mixing", [False, True])
def test_float16_output_gradients_the_weighted_pass_would_overflow_are_still_compared(mode, mixing):
    """(Output gradients of 3e4 in float16 overflow when weighted by 2 or more, and rows of inf passed every
    comparison: sample 1's loss flowing into sample 0's rows went unseen.) Where the largest rows would overflow,
    the weights are powers of two at most 1; a weighted row that is not finite where its unweighted one was fails.
    Each sample's gradient: 3 x 3 entries of 3e4 * 1e-4, norm 9."""
    model = nn.Linear(3, 3, bias=False).half()
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    weights = torch.full((16,), 3e4, dtype=torch.half)
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None) as engine:
        h = model(torch.full((16, 3), 1e-4, dtype=torch.half))
        mixed = torch.zeros_like(h).index_put((torch.tensor([0]),), (h[1] - h[1].detach())[None])
        if mixing:
            with pytest.raises(FlashDPError, match="not separable by sample"):
                engine.backward((h + mixed).sum(1) * weights)
        else:
            norms = engine.backward(h.sum(1) * weights)
            torch.testing.assert_close(norms.double(), torch.full((16,), 9.0, dtype=torch.float64), rtol=1e-2, atol=0)


@given(units=st.integers(0, 300), top=st.sampled_from([3, 15, 30]), down=st.booleans(), seed=st.integers(0, 99))
@settings(max_examples=60, deadline=None)
def test_every_two_units_are_weighted_apart_in_some_pass(units, top, down, seed):
    """With more units than distinct weights, more passes: the fewest that weigh every two units apart, each
    weight a power of two within its range (at least 1, or at most 1 where rows would overflow)."""
    passes = self_check._weight_passes(units, top, down, torch.Generator().manual_seed(seed))
    assert (top + 1) ** (passes.shape[0] - 1) < max(units, 2)
    exponents = passes.log2()
    assert ((exponents <= 0) & (exponents >= -top)).all() if down else ((exponents >= 0) & (exponents <= top)).all()
    assert len({tuple(passes[:, u].tolist()) for u in range(units)}) == units


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_samples_mixing_in_pairs_of_a_16_bit_batch_larger_than_its_weights_are_caught(mode, dtype):
    """(A breaker's finding: float16's and bfloat16's 4 weights left samples 0 and 1 of 8 with one weight, every
    time, and a model swapping their loss gradients passed.) Every two samples are weighted apart in some pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)
    swap = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])

    def forward(x):
        h = model[0](x)
        return model[2](model[1](h + (h[swap] - h[swap].detach()))).squeeze(1)

    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    with engine, pytest.raises(FlashDPError, match="not separable by sample"):
        engine.backward(forward(torch.randn(18, 4).to(dtype)).float().square())
