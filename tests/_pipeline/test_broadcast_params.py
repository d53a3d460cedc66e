"""Parameters that meet the batch by broadcast (layer scales, class tokens, position tables) held by modules without
a rule: counted where they meet the batch, from the norm pass's own backward, with no re-run of the module; exact
against the float64 oracle over sequences of steps, and left to the generic rule wherever that cannot be exact."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.oracle import assert_clipped_sums, clip, per_sample_grads
from tests.steps import check_steps
from tests.strategies import modes

WIDTH = 4


class ScaledBlock(nn.Module):
    """A pre-norm block with two layer scales (BEiT, CaiT, ConvNeXt): `x + g1 * attn(ln(x))`, then the MLP's
    output scaled by `g2` (on the right of the product: the other slot)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.mix, self.ln2, self.mlp = (nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH),
                                                  nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))  # fmt: skip
        self.g1, self.g2 = nn.Parameter(torch.rand(WIDTH) + 0.5), nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):  # [B, T, d]
        x = x + self.g1 * torch.tanh(self.mix(self.ln1(x)))
        return x + self.mlp(self.ln2(x)) * self.g2


class Tokens(nn.Module):
    """ViT's embeddings: a class token expanded to every sample and a position table sliced to the tokens."""

    def __init__(self, inputs: int = 3, positions: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, WIDTH)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH))
        self.pos = nn.Parameter(torch.randn(1, positions, WIDTH))

    def forward(self, x):  # [B, T, 3] -> [B, T + 1, d]
        h = self.proj(x)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1)
        return h + self.pos[:, : h.shape[1]]


class Scaled(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.tokens = Tokens()
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        h = self.tokens(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, 0] + h[:, 1:].mean(1))


def _loss(model, x):
    return model(x).square().sum(1)


def _rows(x, i):
    return x[i : i + 1]


def _generic_runs(monkeypatch) -> list[str]:
    """The modules the generic rule re-runs from here on."""
    from flashdp.rules import generic

    runs, original = [], generic._each_sample

    def counted(call, *args):
        runs.append(call.label)
        return original(call, *args)

    monkeypatch.setattr(generic, "_each_sample", counted)
    return runs


shapes = st.lists(st.tuples(st.integers(2, 5), st.integers(1, 5)), min_size=1, max_size=4)


@given(steps=shapes, blocks=st.integers(1, 2), mode=modes)
def test_layer_scales_class_tokens_and_position_tables_are_exact_over_steps(steps, blocks, mode):
    """Every (B, T) sequence, T + 1 == B among them (where a frontier's dims cannot be told apart, `g * x` of `[d]`
    and `[B, T + 1, d]`, the generic rule counts the parameter: exact either way)."""
    torch.manual_seed(0)
    batches = [torch.randn(b, t, 3, dtype=torch.float64) for b, t in steps]
    check_steps(Scaled(blocks).double(), batches, _loss, _rows, [b for b, _ in steps], mode=mode, max_grad_norm=0.5)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_they_are_counted_without_re_running_their_modules(mode, monkeypatch):
    runs = _generic_runs(monkeypatch)
    torch.manual_seed(0)
    batches = [torch.randn(4, t, 3, dtype=torch.float64) for t in (2, 4, 2)]  # (T + 1 == B: see above)
    check_steps(Scaled(2).double(), batches, _loss, _rows, [4, 4, 4], mode=mode, max_grad_norm=0.5)
    assert runs == []


class Shift(nn.Module):
    """`x * w + b`: a layer of raw parameters scaling and shifting the batch elementwise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(width)), nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.w + self.b


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_an_elementwise_layer_whose_output_an_inplace_relu_overwrites_is_exact(mode):
    """(The generic rule refuses it: its re-run cannot be checked against an overwritten output. Autograd's graph
    records the in-place op, and the parameters are counted from it.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), Shift(5), nn.ReLU(inplace=True), nn.Linear(5, 3)).double()
    batches = [torch.randn(b, 5, dtype=torch.float64) for b in (4, 3, 4)]
    check_steps(model, batches, lambda m, x: m(x).square().sum(1), _rows, [4, 3, 4], mode=mode, max_grad_norm=0.1)


class DropPathBlock(nn.Module):
    """A layer-scaled residual branch dropped per sample at random in training (BEiT's drop path): a random forward,
    which the generic rule's re-run cannot reproduce (refused under it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gamma, self.head = nn.Linear(WIDTH, WIDTH), nn.Parameter(torch.rand(WIDTH)), nn.Linear(WIDTH, 2)

    def forward(self, x):  # [B, T, d]
        keep = (torch.rand(x.shape[0], 1, 1, dtype=x.dtype) > 0.4).to(x.dtype) / 0.6
        return self.head(x + keep * (self.gamma * torch.tanh(self.lin(x)))).sum(1)


def test_a_random_forward_around_a_layer_scale_is_exact_against_its_own_graph():
    """The oracle here is autograd on the same forward (the same random masks), one row of the loss at a time:
    each row depends on its sample alone. (Three positions: at T == B the product's dims cannot be told apart, and
    the generic rule, which counts the scale there, refuses the random forward.)"""
    torch.manual_seed(0)
    model = DropPathBlock().double()
    norms = flashdp.PerSampleNorms(model)
    for batch in (5, 2):
        loss = model(torch.randn(batch, 3, WIDTH, dtype=torch.float64)).square().sum(1)
        params = [p for p in model.parameters()]
        expected = torch.stack(
            [
                torch.cat([g.flatten() for g in torch.autograd.grad(row, params, retain_graph=True)]).norm()
                for row in loss
            ]
        )
        torch.testing.assert_close(norms(loss).double(), expected, rtol=1e-6, atol=1e-9)
    norms.detach()


class ReadsTheData(nn.Module):
    """A scale computed from the batch's statistics: `g * x.mean()` makes every sample's loss read every sample's
    data. Not counted at the frontier (its path to the batch brings in another tensor): the generic rule's probe
    refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.g, self.head = nn.Parameter(torch.rand(WIDTH)), nn.Linear(WIDTH, 2)

    def forward(self, x):  # [B, d], untracked data
        return self.head(x * (self.g * x.mean()))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_scale_computed_from_the_batch_s_data_is_not_counted_at_its_frontier(mode):
    model = ReadsTheData().double()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=None)
    with pytest.raises(FlashDPError):
        engine.backward(model(torch.randn(4, WIDTH, dtype=torch.float64)).square().sum(1))
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


class TwiceCalled(nn.Module):
    """One layer-scaled block called twice per forward: its parameters are counted by two calls, so neither
    call's frontiers hold all of their gradient (the generic rule counts each call's part)."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = ScaledBlock(), nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.head(self.block(self.block(x)).mean(1))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_block_called_twice_is_exact(mode):
    torch.manual_seed(0)
    batches = [torch.randn(b, 3, WIDTH, dtype=torch.float64) for b in (3, 4)]
    check_steps(TwiceCalled().double(), batches, _loss, _rows, [3, 4], mode=mode, max_grad_norm=0.5)


# --- found by a breaker: rows that are not the samples' where a parameter meets the batch --------------------------


class SortedScale(nn.Module):
    """`(x[order] * g)[inv]`: rows sorted by a key from the data inside the module, scaled, put back. A first batch
    already in order verifies an identity; the next keys move rows between the frontier and the module's output
    (0.59 C from one sample before: the routing above the frontier is part of the structure now)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x, key):
        order = key.argsort()
        return (x[order] * self.g)[order.argsort()]


class Keyed(nn.Module):
    def __init__(self, scale: nn.Module, outside: bool = False, inputs: int | None = None) -> None:
        super().__init__()
        self.scale, self.head, self.outside = scale, nn.Linear(WIDTH, 2), outside
        self.first = nn.Identity() if inputs is None else nn.Linear(inputs, WIDTH)

    def forward(self, x, key):
        x = self.first(x)
        if self.outside:  # the rows sorted before the module, put back after it
            order = key.argsort()
            return self.head(self.scale(x[order])[order.argsort()])
        return self.head(self.scale(x, key))


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x):
        return x * self.g


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("outside", [False, True], ids=["sorted inside", "sorted around"])
def test_rows_sorted_by_the_data_around_a_scale_are_exact(mode, outside):
    """(Sorted around the module: refused before, the rows at the frontier taken for the samples'; the module's
    parameters go back to the generic rule, which is exact.)"""
    torch.manual_seed(0)
    keys = [torch.arange(4.0), torch.tensor([3.0, 1.0, 0.0, 2.0]), torch.tensor([2.0, 0.0, 3.0, 1.0])]
    batches = [(torch.randn(4, WIDTH, dtype=torch.float64), key) for key in keys]
    model = Keyed(Scale() if outside else SortedScale(), outside).double()
    check_steps(
        model, batches, lambda m, b: m(*b).square().sum(1), lambda b, i: (b[0][i : i + 1], b[1][i : i + 1]),
        [4, 4, 4], mode=mode, max_grad_norm=0.5,
    )  # fmt: skip


class ScaledFixedPositions(nn.Module):
    """`x + alpha * pe[:T]` with `pe` a buffer: at T == B, `alpha * pe[:T]` has the shape of a scaled batch."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.register_buffer("pe", torch.randn(16, WIDTH))
        self.proj, self.head = nn.Linear(3, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, x):  # [B, T, 3]
        return self.head(self.proj(x) + self.alpha * self.pe[: x.shape[1]])


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_scaled_fixed_table_as_long_as_the_batch_is_exact(mode):
    """(Refused before at T == B: the rows of `alpha * pe[:T]` taken for samples failed the verifying pass.)"""
    torch.manual_seed(0)
    steps = [(4, 3), (4, 4), (3, 3), (3, 5)]
    batches = [torch.randn(b, t, 3, dtype=torch.float64) for b, t in steps]
    sizes = [b for b, _ in steps]
    loss = lambda m, x: m(x).square().sum((1, 2))  # noqa: E731
    check_steps(ScaledFixedPositions().double(), batches, loss, _rows, sizes, mode=mode, max_grad_norm=0.5)


class Solve(nn.Module):
    """`triangular_solve(b, A)`: two outputs, both with the batch, both computed from `A` `[d, d]`, which aligns
    with `[B, d, d]` as a broadcast would."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.eye(3) * 2 + torch.triu(torch.rand(3, 3), 1))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):  # [B, 3, 3]
        solution, coefficient = torch.triangular_solve(self.lin(x), self.a, upper=True)
        return solution.square().sum((1, 2)) + (coefficient * x).sum((1, 2))


@pytest.mark.filterwarnings("ignore::UserWarning")  # (triangular_solve is deprecated)
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_parameter_meeting_the_batch_in_an_op_of_two_batch_outputs_is_exact(mode):
    """(Silently 0.5-0.6 off before: each sample's part was taken through the first output alone.)"""
    torch.manual_seed(0)
    batches = [torch.randn(b, 3, 3, dtype=torch.float64) for b in (3, 4)]
    check_steps(Solve().double(), batches, lambda m, x: m(x), _rows, [3, 4], mode=mode, max_grad_norm=0.5)


class OneHotSortedScale(nn.Module):
    """`SortedScale` with the rows moved by a one-hot matrix from the data, multiplied and summed."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(WIDTH) + 0.5)

    def forward(self, x, key):
        moves = nn.functional.one_hot(key.argsort(), x.shape[0]).to(x.dtype)  # [B, B]
        scaled = (moves[:, :, None] * x[None]).sum(1) * self.g
        return (moves.t()[:, :, None] * scaled[None]).sum(1)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_scale_sent_back_to_the_generic_rule_learns_no_layout(mode):
    """(A breaker's false refusal: after the frontier's rows failed and the pass was redone under the generic rule,
    the redone pass counted as one after layout learning, and a Linear whose rows read as samples in two dims was
    refused, on every step.)"""
    torch.manual_seed(0)
    keys = [torch.tensor([3.0, 1.0, 0.0, 2.0]), torch.tensor([2.0, 0.0, 3.0, 1.0]), torch.arange(4.0)]
    batches = [(torch.randn(4, 3, dtype=torch.float64), key) for key in keys]
    model = Keyed(OneHotSortedScale(), inputs=3).double()  # (a Linear's rows broadcast in the one-hot product)
    check_steps(
        model, batches, lambda m, b: m(*b).square().sum(1), lambda b, i: (b[0][i : i + 1], b[1][i : i + 1]),
        [4, 4, 4], mode=mode, max_grad_norm=0.5,
    )  # fmt: skip


class ChannelsFirstNorm(nn.Module):
    """ConvNeXt's channels-first LayerNorm: `F.layer_norm` over the channels of `[B, C, H, W]`, permuted."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(channels) + 0.5), nn.Parameter(torch.randn(channels))

    def forward(self, x):
        normed = nn.functional.layer_norm(x.permute(0, 2, 3, 1), self.weight.shape, self.weight, self.bias)
        return normed.permute(0, 3, 1, 2)


def _convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, WIDTH, 3, padding=1), ChannelsFirstNorm(WIDTH), nn.GELU(), nn.Conv2d(WIDTH, 3, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2),
    )  # fmt: skip


@given(steps=st.lists(st.tuples(st.integers(2, 5), st.integers(1, 4)), min_size=1, max_size=3), mode=modes)
def test_a_layer_norm_over_channels_is_counted_where_it_meets_the_batch(steps, mode):
    torch.manual_seed(0)
    batches = [torch.randn(b, 2, side, side + 1, dtype=torch.float64) for b, side in steps]
    loss = lambda m, x: m(x).square().sum(1)  # noqa: E731
    check_steps(_convnet().double(), batches, loss, _rows, [b for b, _ in steps], mode=mode, max_grad_norm=0.5)


def test_a_layer_norm_over_channels_runs_no_generic_rule(monkeypatch):
    runs = _generic_runs(monkeypatch)
    torch.manual_seed(0)
    model = _convnet().double()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        engine.backward(model(torch.randn(4, 2, 3, 3, dtype=torch.float64)).square().sum(1))
        assert engine.strategies["1.weight"] == "broadcast"
    assert runs == []


# --- found by a breaker: a table's positions taken for samples at T == B, its rows check without evidence -------


class ScaledTableLastToken(nn.Module):
    """`tanh(x + alpha * pe[:T])`, then the last token by a one-hot mask: at T == B, `alpha * pe[:T]` `[T, d]` passes
    for a batch by its size; on a batch whose samples each read one position alone, its rows check passes."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.register_buffer("pe", torch.randn(16, WIDTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, last):  # [B, T, d], [B]
        h = torch.tanh(x + self.alpha * self.pe[: x.shape[1]])
        pooled = (h * nn.functional.one_hot(last, x.shape[1]).to(h.dtype)[..., None]).sum(1)
        return self.head(pooled).squeeze(-1).square()


class GatedTable(nn.Module):
    """Mean-pooled tokens plus a gated branch reading `alpha * pe[:T]`, the gate `[d]` at 0 on the first step (a
    ReZero or layer-scale init): every row of the table's product then has gradient 0, and its check passes."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha, self.gate = nn.Parameter(torch.rand(WIDTH) + 0.5), nn.Parameter(torch.zeros(WIDTH))
        self.register_buffer("pe", torch.randn(16, WIDTH))
        self.first, self.head = nn.Linear(3, WIDTH), nn.Linear(WIDTH, 2)

    def forward(self, x):  # [B, T, 3]
        h = self.first(x)
        pooled = h.mean(1) + self.gate * torch.tanh(h + self.alpha * self.pe[: x.shape[1]]).mean(1)
        return self.head(pooled).square().sum(1)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_table_s_positions_are_not_taken_for_samples_when_one_sample_reads_each(mode):
    """(Silently wrong on the steps after the first before: 0.54 C.)"""
    torch.manual_seed(0)
    lasts = [torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([1, 0])]
    batches = [(torch.randn(2, 2, WIDTH, dtype=torch.float64), last) for last in lasts]
    check_steps(
        ScaledTableLastToken().double(), batches, lambda m, b: m(*b), lambda b, i: (b[0][i : i + 1], b[1][i : i + 1]),
        [2, 2, 2], mode=mode, max_grad_norm=0.5,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_table_s_positions_are_not_taken_for_samples_under_a_gate_at_zero(mode):
    """(Silently wrong once the gate moved before: 0.06 C.)"""
    torch.manual_seed(0)
    _check_gate_moving(GatedTable().double(), mode, (0.0, 0.7, 1.7))


def _check_gate_moving(model: nn.Module, mode: str, gates: tuple[float, ...]) -> None:
    """One engine through steps on `[3, 3, 3]` batches, `model.gate` set to each of `gates` in turn (as an optimizer
    moves it), each step against the oracle on a copy of the model as it is then."""
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=0.5, noise_multiplier=0.0, self_check=None)
    for gate in gates:
        with torch.no_grad():
            model.gate.fill_(gate)
        x, reference = torch.randn(3, 3, 3, dtype=torch.float64), copy.deepcopy(model)
        expected = per_sample_grads(reference, lambda rows, x=x, m=reference: m(x[rows]), 3)
        expected_norms, expected_sums = clip(expected, "flat", 0.5)
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(engine.backward(model(x)).double(), expected_norms, rtol=1e-5, atol=1e-6)
        assert_clipped_sums(model, expected_sums, 1e-7, where=f"gate {gate}: ")
    engine.detach()


class TimeMajorTable(GatedTable):
    """`alpha * pe[:T]` added to a time-major `[T, B, d]` batch: no later op shows the batch again (it is in dim 1),
    and a gate at 0 leaves the table's rows check nothing to see on the first step."""

    def forward(self, x):  # [B, T, 3]
        h = self.first(x)
        branch = torch.tanh(h.transpose(0, 1) + (self.alpha * self.pe[: x.shape[1]])[:, None]).mean(0)
        return self.head(h.mean(1) + self.gate * branch).square().sum(1)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_table_s_positions_added_to_a_time_major_batch_are_not_taken_for_samples(mode):
    """(A breaker's bypass of the check above: 0.04 C on later steps.) The batch side of a frontier must be tracked
    by autograd: a fixed table's rows are not."""
    torch.manual_seed(0)
    _check_gate_moving(TimeMajorTable().double(), mode, (0.0, 0.7, -1.3))
