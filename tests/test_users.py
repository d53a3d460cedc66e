"""User-level clipping, `engine.backward(loss, users=ids)`, against an oracle that runs each example ALONE (float64),
sums each user's per-example gradients and clips the sums (DESIGN.md, written out again here)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import flashdp
from flashdp import FlashDPError
from flashdp._pipeline.users import UserGroups
from flashdp.audit import epsilon_lower_bound
from tests.conftest import MODES, requires_triton
from tests.oracle import assert_clipped_sums, clip, per_sample_grads, seeded
from tests.strategies import clippings, norm_strategies, per_sample_loss


class Tied(nn.Module):
    """An embedding whose table is also the output head (a token block and a dense block of one parameter)."""

    def __init__(self, vocab: int = 7, d: int = 4):
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, d), nn.LayerNorm(d)

    def forward(self, ids):
        return self.norm(self.embed(ids)) @ self.embed.weight.T


class TwiceAndGeneric(nn.Module):
    """A Linear called twice (its calls' positions concatenated) and a parameter no dedicated rule knows (the
    generic rule's per-sample gradients)."""

    def __init__(self, d: int = 3):
        super().__init__()
        self.inner, self.scale = nn.Linear(d, d), nn.Parameter(torch.randn(d))

    def forward(self, x):
        return self.inner(torch.sin(self.inner(x)) * self.scale)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.out = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.gru(x)[0])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.out = nn.MultiheadAttention(4, 2, batch_first=True, kdim=3, vdim=3), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.attn(x @ torch.ones(3, 4, dtype=x.dtype), x, x, need_weights=False)[0])


def _ids(batch: int) -> Tensor:
    return torch.randint(0, 7, (batch, 3))


def _seq(batch: int) -> Tensor:
    return torch.randn(batch, 3, 3, dtype=torch.float64)


def _image(batch: int) -> Tensor:
    return torch.randn(batch, 4, 5, 5, dtype=torch.float64)


#: name -> (model, batch -> input): every kind of contribution a rule gives (dense blocks of 3-D inputs, token
#: blocks, a tied table's cross term, grouped-convolution blocks, materialised norm, recurrent and generic rows)
MODELS = {
    "transformer": (
        lambda: nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 6), nn.GELU(), nn.RMSNorm(6)),
        _ids,
    ),
    "tied": (Tied, _ids),
    "conv": (
        lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, 2)),
        _image,
    ),
    "twice_and_generic": (TwiceAndGeneric, _seq),
    "recurrent": (Recurrent, _seq),
    "attention": (Attention, _seq),
}


def first_appearance(users: Tensor) -> list[int]:
    return list(dict.fromkeys(users.tolist()))


def per_user(per_sample: dict[str, Tensor], users: Tensor) -> dict[str, Tensor]:
    """Each user's summed gradient `[U, ...]`, users in order of first appearance."""
    order = first_appearance(users)
    return {name: torch.stack([g[users == u].sum(0) for u in order]) for name, g in per_sample.items()}


def expected_step(model: nn.Module, x: Tensor, users: Tensor, clipping: str, c: float, signs: Tensor | None = None):
    """(each row's user norm `[B]`, the clipped sums) by the oracle, on a copy of the model (row i's loss times
    `signs[i]`)."""
    reference = copy.deepcopy(model)
    weights = torch.ones(len(users), dtype=torch.float64) if signs is None else signs

    def loss_of(s: slice) -> Tensor:
        return per_sample_loss(reference(x[s])) * weights[s]

    grads = per_sample_grads(reference, loss_of, len(users))
    # per_layer groups: a layer's own parameters (attention's output projection is its layer's)
    layers = {name: name.replace(".out_proj", "").rpartition(".")[0] for name in grads}
    norms, sums = clip(per_user(grads, users), clipping, c, layers)
    position = {u: k for k, u in enumerate(first_appearance(users))}
    return norms[[position[u] for u in users.tolist()]], sums


def check_users(model, x, users, *, mode="bk", clipping="flat", c=0.5, rtol=1e-9, **engine_kwargs) -> None:
    """flashdp's user-level step on `model` against the oracle's, on a float64 copy of it (`rtol`: of the sums,
    and of the norms where above the float64 tolerance)."""
    wide = x.double() if x.is_floating_point() else x
    expected_norms, expected_sums = expected_step(copy.deepcopy(model).double(), wide, users, clipping, c)
    with flashdp.make_private(
        model, mode=mode, max_grad_norm=c, noise_multiplier=0.0, clipping=clipping, **engine_kwargs
    ) as engine:
        norms = engine.backward(per_sample_loss(model(x)), users=users)
    assert norms.dtype == torch.float32 and norms.shape == users.shape
    norm_tol = max(rtol, 1e-6)
    torch.testing.assert_close(norms.double(), expected_norms, rtol=norm_tol, atol=norm_tol)
    assert_clipped_sums(model, {n: s.to(model_dtype(model)) for n, s in expected_sums.items()}, rtol)


def model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


user_ids = st.lists(st.integers(0, 3), min_size=1, max_size=6)


@pytest.mark.parametrize("name", sorted(MODELS))
@given(ids=user_ids, mode=st.sampled_from(["bk", "ghost"]), clipping=clippings, strategy=norm_strategies)
def test_each_users_summed_gradient_is_clipped(name, ids, mode, clipping, strategy):
    build, data = MODELS[name]
    torch.manual_seed(len(ids))
    model = build().double()
    users = torch.tensor(ids)
    check_users(model, data(len(ids)), users, mode=mode, clipping=clipping, norm_strategy=strategy)


@requires_triton
@given(ids=user_ids, strategy=norm_strategies)
def test_flash_clips_users_exactly(ids, strategy):
    """float32, so that the Triton kernels run (float64 goes to PyTorch); the float64 oracle's tolerance is
    float32's (as tests/kernels/test_flash_mode.py)."""
    build, data = MODELS["transformer"]
    model = build()
    check_users(model, data(len(ids)), torch.tensor(ids), mode="flash", norm_strategy=strategy, rtol=2e-4)


@pytest.mark.parametrize("mode", MODES)
def test_one_user_per_row_is_example_level_clipping(mode):
    """Distinct ids in any order clip each row alone: the same `.grad` and norms as no users at all."""
    build, data = MODELS["transformer"]
    x, model = data(5), build().double()
    twin = copy.deepcopy(model)
    with flashdp.make_private(model, mode=mode, max_grad_norm=0.3, noise_multiplier=0.0) as engine:
        by_user = engine.backward(per_sample_loss(model(x)), users=torch.tensor([40, 3, 17, 8, 1]))
    with flashdp.make_private(twin, mode=mode, max_grad_norm=0.3, noise_multiplier=0.0) as engine:
        by_row = engine.backward(per_sample_loss(twin(x)))
    torch.testing.assert_close(by_user, by_row, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_removing_one_user_moves_the_sum_by_at_most_c(mode):
    """The sensitivity of the clipped sum to one USER, with many rows, is C: the step's DP guarantee."""
    build, data = MODELS["transformer"]
    model, x = build().double(), data(8)
    users = torch.tensor([0, 1, 0, 0, 2, 1, 0, 3])
    c = 0.05  # well below every user's norm: each user's sum is clipped to C (times ||g_u|| / (||g_u|| + 1e-6))

    def clipped_sum(keep: Tensor) -> Tensor:
        model.zero_grad(set_to_none=True)
        with flashdp.make_private(model, mode=mode, max_grad_norm=c, noise_multiplier=0.0) as engine:
            engine.backward(per_sample_loss(model(x[keep])), users=users[keep])
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    everyone = clipped_sum(torch.ones(8, dtype=torch.bool))
    for user in range(4):
        moved = float((everyone - clipped_sum(users != user)).norm())
        assert c * (1 - 1e-4) <= moved <= c * (1 + 1e-9)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_users_across_micro_batches_and_steps(mode):
    """A step's users may come in several backward calls, each user's rows in one of them; after step() the same
    users may come again. Each step's `.grad` before the noise (sigma 0) matches the oracle on the step's rows."""
    build, data = MODELS["transformer"]
    model = build().double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=0.4, noise_multiplier=0.0, optimizer=optimizer, expected_batch_size=1
    )
    try:
        for step in range(3):
            x, users = data(6), torch.tensor([[4, 1, 4, 2, 2, 9], [0, 0, 0, 0, 0, 0], [5, 6, 5, 7, 6, 5]][step])
            split = {0: 3, 1: 6, 2: 3}[step]  # rows [:split] then [split:]: users 4, 2 / 0 / 5 on one side each
            if step == 2:
                order = torch.tensor([0, 2, 5, 1, 4, 3])  # users 5 then 6, 7
                x, users = x[order], users[order]
            _, expected = expected_step(reference, x, users, "flat", 0.4)
            engine.backward(per_sample_loss(model(x[:split])), users=users[:split])
            if split < 6:
                engine.backward(per_sample_loss(model(x[split:])), users=users[split:])
            assert_clipped_sums(model, expected, 1e-9, where=f"step {step}: ")
            engine.step()
    finally:
        engine.detach()


def test_a_user_split_across_backward_calls_of_one_step_is_refused():
    build, data = MODELS["transformer"]
    model = build().double()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        engine.backward(per_sample_loss(model(data(3))), users=torch.tensor([1, 2, 1]))
        before = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(FlashDPError, match=r"User\(s\) \[2\] have rows in several backward calls of one step"):
            engine.backward(per_sample_loss(model(data(2))), users=torch.tensor([3, 2]))
        for p, b in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.grad, b)  # nothing added by the refused backward
        engine.backward(per_sample_loss(model(data(2))), users=torch.tensor([3, 4]))  # other users: fine


def test_the_privacy_unit_is_fixed_at_the_first_backward():
    build, data = MODELS["transformer"]
    model = build().double()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        engine.backward(per_sample_loss(model(data(2))))
        with pytest.raises(FlashDPError, match=r"clips by sample .* since its first backward"):
            engine.backward(per_sample_loss(model(data(2))), users=torch.tensor([0, 1]))
    model = build().double()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        engine.backward(per_sample_loss(model(data(2))), users=torch.tensor([0, 0]))
        with pytest.raises(FlashDPError, match=r"clips by user .* Pass users= on every backward"):
            engine.backward(per_sample_loss(model(data(2))))


@pytest.mark.parametrize(
    ("users", "match"),
    [
        ([0, 1, 2], "Received list"),
        (torch.tensor([0, 1]), r"one id per row of the loss \(3\)\. Received shape \(2,\)"),
        (torch.tensor([[0, 1, 2]]), r"Received shape \(1, 3\)"),
        (torch.tensor([0.0, 1.0, 2.0]), "must hold integer ids. Received dtype torch.float32"),
    ],
)
def test_bad_user_ids_are_refused(users, match):
    build, data = MODELS["transformer"]
    model = build().double()
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0)
    with engine, pytest.raises(FlashDPError, match=match):
        engine.backward(per_sample_loss(model(data(3))), users=users)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_the_self_check_compares_each_users_gradient(mode):
    """A grouping that drops a user's later rows is caught by the self-check, which takes autograd's gradient of a
    user's summed losses."""
    build, data = MODELS["transformer"]
    model = build().double()

    def first_rows_only(groups, per_sample):
        return per_sample[groups.members[:, 0]]

    wrong = mock.patch.object(UserGroups, "sum_rows", first_rows_only)
    refused = pytest.raises(
        FlashDPError, match=r"(?s)Self-check failed for user 0 \(rows \[0, 1, 2, 3\]\): .*'1.weight'"
    )
    with wrong, flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0) as engine, refused:
        engine.backward(per_sample_loss(model(data(4))), users=torch.tensor([0, 0, 0, 0]))


def pair_losses(scores: Tensor, pairs: int) -> Tensor:
    """`[2P]`: each pair's preference loss `-log sigmoid(s_chosen - s_rejected)` in its chosen row (rows
    `[chosen..., rejected...]`, as TRL's DPO batches them), 0 in its rejected row: rows mix within their pair."""
    pair = -nn.functional.logsigmoid(scores[:pairs] - scores[pairs:])
    return torch.cat([pair, torch.zeros_like(pair)])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_loss_mixing_the_rows_of_one_user_is_clipped_by_user(name, mode):
    """The unit a user-level clip needs independent is the user: a preference pair (DPO) is one user of two
    rows whose loss depends on both. Against each pair's gradient by autograd, one pair at a time."""
    build, data = MODELS[name]
    torch.manual_seed(0)
    model, pairs = build().double(), 3
    x, users = data(2 * pairs), torch.arange(pairs).repeat(2)
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    grads: dict[str, list[Tensor]] = {n: [] for n, p in reference.named_parameters() if p.requires_grad}
    for k in range(pairs):
        rows = per_sample_loss(reference(x[[k, k + pairs]]))
        for name_, g in zip(grads, torch.autograd.grad(pair_losses(rows, 1)[0], params), strict=True):
            grads[name_].append(g)
    norms, sums = clip({n: torch.stack(g) for n, g in grads.items()}, "flat", 0.5)
    with flashdp.make_private(model, mode=mode, max_grad_norm=0.5, noise_multiplier=0.0) as engine:
        got = engine.backward(pair_losses(per_sample_loss(model(x)), pairs), users=users)
    torch.testing.assert_close(got.double(), norms.repeat(2), rtol=1e-6, atol=1e-6)
    assert_clipped_sums(model, sums, 1e-9)


def test_a_loss_mixing_rows_is_refused_without_users_and_across_users():
    build, data = MODELS["transformer"]
    model = build().double()
    x = data(4)
    refused = pytest.raises(FlashDPError, match="Self-check failed")
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine, refused:
        engine.backward(pair_losses(per_sample_loss(model(x)), 2))
    refused = pytest.raises(FlashDPError, match="Self-check failed")
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine, refused:
        # rows 0 and 2 are a pair, but users 0 and 1
        engine.backward(pair_losses(per_sample_loss(model(x)), 2), users=torch.tensor([0, 0, 1, 1]))


def test_a_loss_mixing_users_is_refused():
    build, data = MODELS["transformer"]
    model = build().double()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        out = per_sample_loss(model(data(4)))
        with pytest.raises(FlashDPError, match="Self-check failed"):
            engine.backward(out - out.mean(), users=torch.tensor([0, 1, 0, 1]))


@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["bk", "ghost"]),
)
def test_sequences_of_steps_with_new_shapes_and_users(sizes, seed, mode):
    """One engine through steps whose batch size, sequence length and user assignment change: each step exact."""
    gen = seeded(seed)
    model = MODELS["tied"][0]().double()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = flashdp.make_private(
        model, mode=mode, max_grad_norm=0.3, noise_multiplier=0.0, optimizer=optimizer, expected_batch_size=1
    )
    try:
        for step, size in enumerate(sizes):
            x = torch.randint(0, 7, (size, 1 + step % 3), generator=gen)
            users = torch.randint(0, 3, (size,), generator=gen)
            expected_norms, expected_sums = expected_step(reference, x, users, "flat", 0.3)
            norms = engine.backward(per_sample_loss(model(x)), users=users)
            torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-6, atol=1e-6)
            assert_clipped_sums(model, expected_sums, 1e-9, where=f"step {step}: ")
            engine.step()
    finally:
        engine.detach()


def test_user_groups_number_users_by_first_appearance():
    groups = UserGroups.of(torch.tensor([7, 3, 7, 5, 3, 7]), 6, torch.device("cpu"))
    assert groups.ids.tolist() == [7, 3, 5]
    assert groups.index.tolist() == [0, 1, 0, 2, 1, 0]
    assert groups.members.tolist() == [[0, 2, 5], [1, 4, 6], [3, 6, 6]]
    assert [groups.rows_of(u) for u in range(3)] == [[0, 2, 5], [1, 4], [3]]


def _user_audit(per_row_clipping: bool):
    """A one-run canary audit with USERS as the unit, through the real forward and backward: 1,000 canary users,
    each with 8 records whose gradient is 10 C on the user's own coordinate; each is in the training set with
    probability 1/2, and sampled at each step with probability q (`UserPoissonSampler`'s law)."""
    canaries, rows, c = 1000, 8, 1.0
    gen = seeded(2)
    signs = torch.randint(0, 2, (canaries,), generator=gen).double() * 2 - 1
    included = torch.rand(canaries, generator=gen) < 0.5
    model = nn.Linear(canaries, 1, bias=False)
    nn.init.zeros_(model.weight)
    engine = flashdp.make_private(
        model, max_grad_norm=c, noise_multiplier=AUDIT_SIGMA, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        expected_batch_size=round(AUDIT_Q * int(included.sum())), sample_rate=AUDIT_Q, seed=1,
    )  # fmt: skip
    for _ in range(AUDIT_STEPS):
        users = (included & (torch.rand(canaries, generator=gen) < AUDIT_Q)).nonzero().flatten().repeat_interleave(rows)
        x = torch.zeros(len(users), canaries)
        x[torch.arange(len(users)), users] = 10 * c * signs[users].float()
        ids = torch.arange(len(users)) if per_row_clipping else users  # the planted bug: each row its own unit
        engine.backward(model(x).sum(1), users=ids)
        engine.step()
    scores = -model.weight.detach().double().flatten() * signs  # how far each coordinate descended its canary
    order = scores.argsort(descending=True)
    guessed_in, guessed_out = order[:100], order[-100:]
    correct = int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())
    return epsilon_lower_bound(200, correct, canaries, 1e-5, 0.05), engine.epsilon(1e-5)


AUDIT_STEPS, AUDIT_Q, AUDIT_SIGMA = 50, 0.5, 13.4  # epsilon about 1 at delta 1e-5


def test_a_user_level_canary_audit_shows_no_violation_and_catches_per_row_clipping():
    bound, claimed = _user_audit(per_row_clipping=False)
    assert 0.9 < claimed < 1.0 and bound < claimed
    with pytest.warns(flashdp.FlashDPWarning, match="Poisson"):  # (8 times the batches of users expected)
        bound, claimed = _user_audit(per_row_clipping=True)  # each user enters 8 times: the claim does not hold
    assert bound > 2 * claimed


@given(
    ids=st.lists(st.integers(0, 4), min_size=1, max_size=8),
    size=st.integers(1, 8),
    mode=st.sampled_from(["bk", "ghost"]),
)
def test_micro_batches_that_keep_users_whole_add_up_to_the_whole_batch(ids, size, mode):
    """Any assignment split by `micro_batches(..., users=)` into backward calls: `.grad` is the oracle's on the
    whole batch (or the split is refused when a user has more rows than a micro-batch)."""
    users = torch.tensor(ids)
    size = max(size, int(torch.bincount(users).max()))
    model = MODELS["twice_and_generic"][0]().double()
    x = _seq(len(ids))
    _, expected = expected_step(model, x, users, "flat", 0.5)
    with flashdp.make_private(model, mode=mode, max_grad_norm=0.5, noise_multiplier=0.0) as engine:
        for part, who in flashdp.micro_batches((x, users), size, users=users):
            engine.backward(per_sample_loss(model(part)), users=who)
    assert_clipped_sums(model, expected, 1e-9)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_user_whose_rows_cancel_gets_a_zero_norm_not_nan(mode, dtype):
    """The same example twice with opposite losses: the user's gradient is 0. Ghost norms are sums of inner
    products, which round a little below 0 there; the norm is at most its bound through rounding (about 1e-3 of
    the rows' norms in float32, 5e-7 in float64; not NaN in every .grad), the clipped sum exact, and the
    self-check does not mistake both sides' rounding of 0 for a disagreement."""
    model = TwiceAndGeneric().to(dtype)
    x = _seq(3).to(dtype)
    x = torch.cat([x[:1], x])
    signs = torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=dtype)
    users = torch.tensor([7, 7, 8, 9])
    expected_norms, expected_sums = expected_step(model.double(), x.double(), users, "flat", 0.5, signs.double())
    model.to(dtype)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=0.5, noise_multiplier=0.0, norm_strategy="ghost")
    with engine:
        norms = engine.backward(per_sample_loss(model(x)) * signs, users=users)
    assert bool(torch.isfinite(norms).all())
    if dtype == torch.float64:
        assert float(norms[:2].max()) < 1e-5
    torch.testing.assert_close(norms[2:].double(), expected_norms[2:], rtol=1e-5, atol=1e-6)
    rtol = 1e-9 if dtype == torch.float64 else 1e-5
    assert_clipped_sums(model, {n: s.to(dtype) for n, s in expected_sums.items()}, rtol)


def test_a_non_finite_user_gradient_is_named_by_its_user_id_and_rows():
    class Sqrt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 1)

        def forward(self, x, z):
            return self.a(x).squeeze(-1) + torch.sqrt(z * self.a.bias.square().sum())

    model = Sqrt().double()
    x, z = torch.randn(6, 3, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    z[5] = 0  # row 5: the gradient of sqrt at 0
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        refused = pytest.raises(FlashDPError, match=r"per-user gradient of user 99 \(rows \[5\]\) is not finite")
        with refused:
            engine.backward(model(x, z), users=torch.tensor([42, 42, 42, 42, 17, 99]))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_step_whose_users_group_the_rows_otherwise_is_verified_again(mode):
    """The same layers, sizes and loss code; only the users change: pairs within users at step 1, a pair across
    two users at step 2 (the check weights by user, so what it verified holds for that grouping only)."""
    build, data = MODELS["transformer"]
    model = build().double()
    x = data(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with flashdp.make_private(
        model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, optimizer=optimizer, expected_batch_size=2
    ) as engine:
        engine.backward(pair_losses(per_sample_loss(model(x)), 2), users=torch.tensor([0, 1, 0, 1]))
        engine.step()
        with pytest.raises(FlashDPError, match="Self-check failed"):
            engine.backward(pair_losses(per_sample_loss(model(x)), 2), users=torch.tensor([0, 0, 1, 1]))


def _linear_engine(**options) -> tuple[nn.Module, flashdp.DPEngine]:
    model = nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 2, "sample_rate": 0.5}
    return model, flashdp.make_private(model, optimizer=optimizer, **settings, **options)


def _losses(model: nn.Module) -> Tensor:
    return model(torch.randn(2, 3, dtype=torch.float64)).square().sum(1)


def test_the_privacy_unit_is_resumed_from_a_checkpoint():
    """(A breaker's finding: the checkpoint did not record the unit, so a run by rows resumed by users, and its
    epsilon mixed the two units.)"""
    model, by_rows = _linear_engine()
    by_rows.backward(_losses(model))
    by_rows.step()
    state = by_rows.state_dict()
    by_rows.detach()
    model, by_users = _linear_engine()
    by_users.backward(_losses(model), users=torch.tensor([3, 4]))
    with pytest.raises(FlashDPError, match="checkpoint's run clipped by sample, this engine by user"):
        by_users.load_state_dict(state)
    by_users.detach()
    model, fresh = _linear_engine()
    fresh.load_state_dict(state)  # (no backward yet: it takes the checkpoint's unit)
    with pytest.raises(FlashDPError, match="This engine clips by sample"):
        fresh.backward(_losses(model), users=torch.tensor([3, 4]))


def test_user_ids_on_the_meta_device_are_refused():
    model, engine = _linear_engine()
    with pytest.raises(FlashDPError, match="meta device"):
        engine.backward(_losses(model), users=torch.tensor([1, 2], device="meta"))


def test_the_user_sampler_refuses_ids_that_are_not_integers():
    """(A breaker's finding: float ids were truncated, merging users 0.2 and 0.7 into one.)"""
    with pytest.raises(FlashDPError, match="integer user ids"):
        flashdp.data.UserPoissonSampler(torch.tensor([0.2, 0.7, 1.5, 1.9]), 1.0, 1, steps=1, seed=0)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("parts", [1e4, 1e6])
def test_a_user_whose_huge_rows_cancel_to_more_than_c_adds_at_most_c(mode, dtype, parts):
    """(A breaker's finding: two rows of one user with gradients of norm `parts` that cancel to a norm of 3 to 300
    C: the float32 ghost norm rounded to about 0, and the user was added unclipped, 3 to 300 C.) The norm used for
    clipping is bounded through rounding (`rounding_bound_sq`): the user adds at most C, whatever cancels."""
    generator = seeded(0)
    model = nn.Linear(16, 16, bias=False).to(dtype)
    x = torch.randn(1, 16, generator=generator, dtype=dtype).repeat(2, 1)
    v, w = torch.randn(2, 16, generator=generator, dtype=dtype)
    v, w = v / v.norm(), w / w.norm()
    true_norm, scale = 3e-4 * parts, parts / float(x[0].norm())
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    with engine:
        out = model(x)
        loss = torch.stack([scale * (out[0] @ v), -scale * (out[1] @ v) + true_norm / float(x[0].norm()) * out[1] @ w])
        engine.backward(loss, users=torch.tensor([7, 7]))
    assert float(model.weight.grad.double().norm()) <= 1.0 + 1e-5
