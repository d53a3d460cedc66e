"""Rows moved by index values from the data, between a layer and the loss (a batch sorted by a key around a layer):
sizes do not say whose rows are whose, so a structure is trusted only under the index values it was verified
under. Every step is exact against per-sample gradients taken one sample at a time (float64), also when the
verified batch was already in sorted order (the move was the identity there); a structure without such moves, or
whose moves repeat, is verified once."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError
from flashdp._pipeline import self_check
from tests.oracle import clip, per_sample_grads
from tests.steps import check_steps

MODES = ["bk", "ghost"]
MOVES = ["index", "index_on_output", "index_select_on_output", "index_copy", "between_layers"]


def _rows(x, i):
    return x[i : i + 1]


def _sum_loss(model, x):
    out = model(x)
    return (out.tanh() + out).square().flatten(1).sum(1)


class SortedByKey(nn.Module):
    """`a` runs on the batch's rows sorted by a key of the data (its row j is sample `order[j]`'s), put back in
    order before `b`: a per-sample model whose layer rows are samples only on a batch already in key order."""

    def __init__(self, move: str = "index") -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.move = move

    def forward(self, x):
        order = x[:, 0].argsort()
        back = order.argsort()
        if self.move == "index":
            h = self.a(x[order]).tanh()[back]
        elif self.move == "index_on_output":  # (a move of the layer's own output, in its batch dim)
            h = self.a(x[order])[back].tanh()
        elif self.move == "index_select_on_output":
            h = self.a(x.index_select(0, order)).index_select(0, back).tanh()
        elif self.move == "index_copy":  # put back by writing row j at order[j]
            h = self.a(x[order]).tanh()
            h = torch.zeros_like(h).index_copy(0, order, h)
        else:  # moved between two layers: `a` sees the batch in order, `c` sorted
            h = self.c(self.a(x).tanh()[order]).tanh()[back]
        return self.b(h)


def _sorted_first(batches):
    """The first batch already in key order: the move verified on it is the identity."""
    first = batches[0]
    return [first[first[:, 0].argsort()], *batches[1:]]


@pytest.mark.parametrize("self_check", [None, 200], ids=["self-check-off", "default"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("move", MOVES)
def test_rows_sorted_by_the_data_are_exact_on_every_step_after_a_sorted_batch(move, mode, self_check):
    torch.manual_seed(0)
    model = SortedByKey(move).double()
    batches = _sorted_first([torch.randn(b, 3, dtype=torch.float64) for b in (4, 4, 4, 5, 5)])
    assert any(not torch.equal(x[:, 0].argsort(), torch.arange(len(x))) for x in batches[1:3])
    check_steps(model, batches, _sum_loss, _rows, [4, 4, 4, 5, 5], mode=mode, self_check=self_check)


class Shuffled(nn.Module):
    """Rows moved by a permutation and put back by its inverse, both kept by the model and changed in place
    (buffers; a batch of another size, one sample alone, keeps its order): the verified values must be a copy, not
    the model's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.register_buffer("perm", torch.arange(4))
        self.register_buffer("back", torch.arange(4))

    def forward(self, x):
        if len(x) != len(self.perm):
            return self.b(self.a(x).tanh())
        return self.b(self.a(x[self.perm]).tanh()[self.back])


@pytest.mark.parametrize("mode", MODES)
def test_a_permutation_changed_in_place_is_verified_again(mode):
    torch.manual_seed(0)
    model = Shuffled().double()
    batches = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    perms = iter([torch.arange(4), torch.tensor([2, 0, 3, 1]), torch.tensor([3, 2, 1, 0])])

    def loss_of(m, x):
        if m is model:
            perm = next(perms)
            m.perm.copy_(perm)
            m.back.copy_(perm.argsort())
        return _sum_loss(m, x)

    check_steps(model, batches, loss_of, _rows, [4, 4, 4], mode=mode)


class LastToken(nn.Module):
    """HF's sequence classifiers: the logits of each sample's last token, `logits[arange(B), lengths - 1]`; the
    rows stay each sample's whatever the lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):  # x [B, T, 3]; the length is read from the data
        lengths = (x[:, :, 0] > -0.5).sum(1).clamp(min=1)
        logits = self.head(self.a(x).tanh())
        return logits[torch.arange(x.shape[0]), lengths - 1]


class TopTokens(nn.Module):
    """Each sample's tokens reordered by a score of the data (token pruning), within the sample: `gather` or `sort`
    along the positions of the layer's output."""

    def __init__(self, move: str) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.move = move

    def forward(self, x):  # x [B, T, 3]
        h = self.a(x)
        if self.move == "sort":
            return self.head(h.sort(dim=-2).values[:, :3].tanh())
        keep = x[:, :, 0].argsort(dim=1, descending=True)[:, :3]
        return self.head(h.gather(1, keep[:, :, None].expand(-1, -1, 4)).tanh())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "model_of",
    [LastToken, lambda: TopTokens("gather"), lambda: TopTokens("sort")],
    ids=["last_token", "gather", "sort"],
)
def test_positions_picked_by_the_data_within_each_sample_are_exact_and_verified_once(model_of, mode):
    """The move's values that decide whose rows are whose (the index in the layer output's batch dim, none for a
    move along the positions) repeat: verified once, whatever the positions picked."""
    torch.manual_seed(0)
    model = model_of().double()
    batches = [torch.randn(b, 5, 3, dtype=torch.float64) for b in (4, 4, 4, 4)]
    if mode == "bk":
        assert _verifying_passes(model, batches) == [1, 0, 0, 0]
    check_steps(model, batches, _sum_loss, _rows, [4, 4, 4, 4], mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_last_tokens_of_batches_of_changing_size_are_verified_once_per_size(mode):
    """(Each size routes its own way, `arange(B)` in the batch dim, and only the last verified routing was kept: a
    Poisson-sampled sequence classifier verified on nearly every step.) Every routing verified is kept."""
    torch.manual_seed(0)
    model = LastToken().double()
    sizes = [3, 4, 3, 4, 5, 3]
    batches = [torch.randn(b, 5, 3, dtype=torch.float64) for b in sizes]
    assert _verifying_passes(model, batches, mode) == [1, 1, 0, 0, 1, 0]
    check_steps(model, batches, _sum_loss, _rows, sizes, mode=mode)


def _verifying_passes(model, batches, mode: str = "bk") -> list[int]:
    """The verifying passes each backward ran (self-check off: only those for the layout)."""
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    counted = mock.patch.object(self_check, "batch_independence_failures", wraps=self_check.batch_independence_failures)
    passes = []
    with engine, counted as spy:
        for x in batches:
            model.zero_grad()
            engine.backward(_sum_loss(model, x))
            passes.append(spy.call_count - sum(passes))
    return passes


def test_a_structure_whose_rows_no_index_moves_is_verified_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    assert _verifying_passes(model, [torch.randn(4, 3, dtype=torch.float64) for _ in range(4)]) == [1, 0, 0, 0]


class Positions(nn.Module):
    """Each sample's positions taken in a fixed order (`[:, order]`): moved by index, the same values every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.register_buffer("order", torch.tensor([4, 2, 0, 1, 3]))

    def forward(self, x):  # x [B, 5, 3]
        return self.head(self.a(x).tanh()[:, self.order])


def test_a_move_by_the_same_index_values_is_verified_once():
    torch.manual_seed(0)
    model = Positions().double()
    batches = [torch.randn(4, 5, 3, dtype=torch.float64) for _ in range(4)]
    assert _verifying_passes(model, batches) == [1, 0, 0, 0]
    check_steps(model, batches, _sum_loss, _rows, [4, 4, 4, 4])


def test_once_the_sorted_layer_is_counted_whole_nothing_is_verified_again():
    """Verified again where the order changed, `a` is found not batch-first and counted by the model's generic rule
    (whose rows are samples): no move is left between a counted layer and the loss, and later steps verify
    nothing."""
    torch.manual_seed(0)
    model = SortedByKey().double()
    batches = _sorted_first([torch.randn(4, 3, dtype=torch.float64) for _ in range(5)])
    passes = _verifying_passes(model, batches)
    assert passes[1] >= 1 and passes[-2:] == [0, 0]


def test_moves_within_each_sample_need_no_verifying_pass():
    """Where no verifying pass can run, a gather along the positions of a layer's output is still counted (sizes
    decide the batch dim there, as for every layer), exactly."""
    torch.manual_seed(0)
    model = TopTokens("gather").double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    expected, _ = clip(per_sample_grads(model, lambda s: _sum_loss(model, x[s]), 4), "flat", 1.0)
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    with engine, mock.patch.object(engine._adapter, "allows_second_pass", False):
        norms = engine.backward(_sum_loss(model, x))
    torch.testing.assert_close(norms.double(), expected, rtol=1e-5, atol=1e-6)


def test_rows_moved_by_index_where_no_verifying_pass_can_run_are_refused():
    """Under FSDP1 (no second pass over a forward) sizes alone would decide the layout: refused."""
    model = SortedByKey().double()
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    x = torch.randn(4, 3, dtype=torch.float64)
    with engine, mock.patch.object(engine._adapter, "allows_second_pass", False):
        with pytest.raises(FlashDPError, match=r"Under FSDP1.*moves rows by index values \(Index\)"):
            engine.backward(_sum_loss(model, x[x[:, 0].argsort()]))
        assert all(p.grad is None for p in model.parameters())


class SparsePermuted(nn.Module):
    """`b` runs on rows permuted by a sparse 0/1 matrix built from the data, put back by its inverse: the moves are
    the sparse matrices' indices (found by the second breaker helper: missed before)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x).tanh()
        rows = torch.arange(len(x))
        order = x[:, 0].argsort()

        def permutation(columns):
            return torch.sparse_coo_tensor(torch.stack([rows, columns]), torch.ones(len(x), dtype=x.dtype))

        return torch.sparse.mm(permutation(order.argsort()), self.b(torch.sparse.mm(permutation(order), h)))


@pytest.mark.parametrize("mode", MODES)
def test_rows_permuted_by_a_sparse_matrix_from_the_data_are_exact(mode):
    """After a batch already in key order, a step whose sparse permutation differs is verified again: `b`'s rows
    are not its samples', so the enclosing generic rule counts the model; vmap cannot run sparse ops, so it runs one
    sample at a time (warned; refused before that ran by plain autograd). Exact on every step."""
    torch.manual_seed(0)
    batches = _sorted_first([torch.randn(4, 3, dtype=torch.float64) for _ in range(3)])
    with pytest.warns(flashdp.FlashDPWarning, match="one sample at a time"):
        check_steps(SparsePermuted().double(), batches, _sum_loss, _rows, [4, 4, 4], mode=mode)
