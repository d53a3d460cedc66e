import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import flashdp
from flashdp._pipeline.param_grad import ParamGradient
from flashdp.per_sample import accumulation_dtype
from flashdp.rules import conv
from tests.oracle import assert_clipped_sums, check_against_oracle, clip, materialised, per_sample_grads
from tests.steps import check_steps
from tests.strategies import batches, modes, norm_strategies, per_sample_loss


@st.composite
def conv_configs(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    padding_mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    padding = draw(st.sampled_from([0, 1, 2, "same", "valid"]))
    stride = draw(st.integers(1, 2))
    if padding == "same":
        stride = 1  # PyTorch allows 'same' only with stride 1
    return {
        "in_channels": groups * draw(st.integers(1, 2)),
        "out_channels": groups * draw(st.integers(1, 2)),
        "kernel_size": draw(st.integers(1, 3)),
        "stride": stride,
        "padding": padding,
        "dilation": draw(st.integers(1, 2)),
        "groups": groups,
        "bias": draw(st.booleans()),
        "padding_mode": padding_mode,
    }


CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
TRANSPOSED = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@given(batch=batches, dims=st.sampled_from([1, 2, 3]), config=conv_configs(), mode=modes, strategy=norm_strategies)
def test_conv_matches_oracle(batch, dims, config, mode, strategy):
    conv = CONVS[dims](**config)
    size = (7, 6, 5)[:dims]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(torch.zeros(1, config["in_channels"], *size, dtype=torch.float64))
    x = torch.randn(batch, config["in_channels"], *size, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode, norm_strategy=strategy)


@st.composite
def transposed_configs(draw):
    groups = draw(st.sampled_from([1, 2]))
    stride, dilation = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    return {
        "in_channels": groups * draw(st.integers(1, 2)),
        "out_channels": groups * draw(st.integers(1, 2)),
        "kernel_size": draw(st.integers(1, 3)),
        "stride": stride,
        "padding": draw(st.integers(0, 1)),
        "output_padding": draw(st.integers(0, max(stride, dilation) - 1)),
        "dilation": dilation,
        "groups": groups,
        "bias": draw(st.booleans()),
    }


@given(
    batch=batches, dims=st.sampled_from([1, 2, 3]), config=transposed_configs(), mode=modes, strategy=norm_strategies
)
def test_transposed_conv_matches_oracle(batch, dims, config, mode, strategy):
    """Strides, dilations and output_padding leave windows past the input (output_padding < dilation)."""
    conv = TRANSPOSED[dims](**config)
    size = (4, 3, 3)[:dims]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(torch.zeros(1, config["in_channels"], *size, dtype=torch.float64))
    x = torch.randn(batch, config["in_channels"], *size, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode, norm_strategy=strategy)


def test_two_conv_layers_with_groupnorm_match_oracle():
    """A small CNN: the second conv sees activations that require grad."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.Flatten(),
        nn.LazyLinear(3),
    ).double()
    model(torch.zeros(1, 3, 8, 8, dtype=torch.float64))
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    for mode in ("bk", "ghost"):
        check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3, mode=mode)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's TF32 convolutions need a CUDA device")
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_float32_cnn_on_cuda_passes_the_self_check_though_cudnn_convolves_in_tf32(mode):
    """cuDNN convolves float32 in TF32 by default: autograd's weight gradients round to 10 mantissa bits where
    flashdp's per-sample products are IEEE float32; the first backward's self-check must take that as rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.Conv2d(32, 32, 3, stride=2),
        nn.Flatten(), nn.LazyLinear(10),
    ).cuda()  # fmt: skip
    x = torch.randn(8, 3, 16, 16, device="cuda")
    model(x)
    check_against_oracle(model, lambda rows: model(x[rows]).square().sum(1), 8, mode=mode, rtol=3e-2)


@given(
    dims=st.sampled_from([1, 2, 3]),
    config=st.one_of(conv_configs(), transposed_configs()),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    batch=st.integers(1, 3),
)
def test_the_dense_per_sample_weight_gradients_equal_the_product_of_the_factors(dims, config, dtype, batch):
    """The grouped convolution that materialises a direct norm's per-sample gradients against the float64 product
    of the factors a ghost norm reads (and the oracle tests above against per-sample backwards)."""
    transposed = "output_padding" in config
    layer = (TRANSPOSED if transposed else CONVS)[dims](**config).to(dtype)
    x = torch.randn(batch, config["in_channels"], *((4, 3, 3) if transposed else (7, 6, 5))[:dims], dtype=dtype)
    grad_output = torch.randn_like(layer(x))
    rule = conv.conv_transpose_grads if transposed else conv.conv_grads
    deferred = rule(layer, (x,), grad_output, frozenset({"weight"}))["weight"]
    dense = deferred.dense()
    assert dense.shape == (batch, *layer.weight.shape) and dense.dtype == accumulation_dtype(x)
    expected = materialised(deferred.factors()).view(dense.shape)
    torch.testing.assert_close(dense.double(), expected, rtol=1e-5, atol=1e-5)


@given(
    dims=st.sampled_from([1, 2, 3]),
    config=st.one_of(conv_configs(), transposed_configs()),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    batch=st.integers(1, 3),
    frames=st.integers(1, 2),
)
def test_the_parts_norm_is_the_sum_of_the_factors_rows_norms(dims, config, dtype, batch, frames):
    """What the floor of a direct norm's rounding is taken from (`parts_norm`: per sample, the sum over positions,
    groups and frames of `||left_t|| ||right_t||`) against the same sum over the unfolded factors, in float64."""
    transposed = "output_padding" in config
    layer = (TRANSPOSED if transposed else CONVS)[dims](**config).to(dtype)
    size = ((4, 3, 3) if transposed else (7, 6, 5))[:dims]
    x = torch.randn(batch * frames, config["in_channels"], *size, dtype=dtype)
    grad_output = torch.randn_like(layer(x))
    if frames > 1:  # k rows per sample
        x, grad_output = x.unflatten(0, (batch, frames)), grad_output.unflatten(0, (batch, frames))
    rule = conv.conv_transpose_grads if transposed else conv.conv_grads
    deferred = rule(layer, (x,), grad_output, frozenset({"weight"}))["weight"]
    factors = deferred.factors()
    left, right = factors.left.double(), factors.right.double()
    expected = (left.norm(dim=2) * right.norm(dim=2)).sum(1).view(batch, -1).sum(1)
    torch.testing.assert_close(deferred.parts_norm(torch.float64), expected, rtol=1e-6, atol=1e-9)


class TwoConvs(nn.Module):
    """8 channels, 3x3: the direct norm is cheaper from about 8 output positions on, ghost below."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).tanh()).mean((2, 3))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([2, 3, 6])), min_size=2, max_size=5),
    mode=modes,
)
def test_every_step_is_exact_while_image_sizes_move_the_norm_between_ghost_and_direct(shapes, mode):
    """Each step's image size decides each layer's form (2x2 images: ghost; 6x6: dense), batch sizes change too."""
    torch.manual_seed(len(shapes))
    batches = [torch.randn(b, 3, side, side, dtype=torch.float64) for b, side in shapes]
    check_steps(
        TwoConvs().double(),
        batches,
        lambda model, x: model(x).sum(1),
        lambda x, i: x[i : i + 1],
        [b for b, _ in shapes],
        mode=mode,
        self_check=3,
    )


def test_a_direct_conv_norm_unfolds_no_windows(monkeypatch):
    """Where the cost model picks the direct norm, the per-sample gradients come from one grouped convolution: no
    unfolded windows (9x the input for 3x3 kernels). With few positions the factors are built for a ghost norm."""
    model = TwoConvs()
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0)
    engine.backward(model(torch.randn(2, 3, 2, 2)).sum(1))
    assert engine.strategies == {"first.weight": "ghost", "first.bias": "per-sample"} | {
        "second.weight": "ghost", "second.bias": "per-sample"
    }  # fmt: skip
    monkeypatch.setattr(conv, "_unfold", lambda *args: pytest.fail("windows unfolded for a direct norm"))
    engine.backward(model(torch.randn(2, 3, 6, 6)).sum(1))
    assert engine.strategies["first.weight"] == engine.strategies["second.weight"] == "direct"


@pytest.mark.parametrize("strategy", ["auto", "ghost", "direct"])
def test_a_transposed_conv_given_an_output_size_matches_oracle(strategy):
    """`forward(x, output_size=...)` (U-Nets matching a skip connection) pads the output beyond the module's
    output_padding: the dense per-sample gradients use the call's own."""
    layer = nn.ConvTranspose2d(2, 3, 3, stride=2).double()
    x = torch.randn(4, 2, 5, 4, dtype=torch.float64)
    loss_of = lambda s: per_sample_loss(layer(x[s], output_size=[12, 10]).flatten(1))  # noqa: E731
    check_against_oracle(layer, loss_of, 4, norm_strategy=strategy)


@pytest.mark.parametrize(
    "layer, x",
    [
        (nn.ConvTranspose1d(6, 4, 2, stride=2), torch.randn(3, 1, 6).transpose(1, 2)),
        (nn.ConvTranspose2d(6, 4, 2, stride=2), torch.randn(3, 1, 1, 6).permute(0, 3, 1, 2)),
        (nn.Conv1d(6, 4, 1), torch.randn(3, 1, 6).transpose(1, 2)),
    ],
    ids=["transposed-1d", "transposed-2d", "conv-1d"],
)
def test_a_direct_norm_on_inputs_strided_in_a_size_one_dim_matches_oracle(layer, x):
    """A transposed view `[B, C, 1]` is contiguous but for the stride of its size-1 dim, which CPU's transposed
    convolution refused when computing its weight gradient."""
    layer, x = layer.double(), x.double()
    check_against_oracle(layer, lambda s: per_sample_loss(layer(x[s]).flatten(1)), 3, norm_strategy="direct")


def test_a_weight_tied_across_group_layouts_is_refused_on_the_first_step_whatever_the_forms():
    """A Conv2d (1 group) and a ConvTranspose2d (2 groups) sharing one `[8, 4, 3, 3]` weight: their factors cannot
    be summed. Refused at once, also on image sizes where both would be materialised (not first at a later size)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)
            self.back = nn.ConvTranspose2d(8, 8, 3, padding=1, groups=2, bias=False)
            self.back.weight = self.conv.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.back(self.conv(x).tanh()).flatten(1).sum(1)

    model = Tied()
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(flashdp.FlashDPError, match="do not share a layout"):
        engine.backward(model(torch.randn(2, 4, 6, 6)))


@pytest.mark.parametrize("build", [lambda: nn.Conv2d(4, 6, 3, groups=2), lambda: nn.ConvTranspose2d(4, 6, 3, stride=2)])
def test_bk_sums_a_ghost_norm_convolution_by_its_weight_gradient_and_keeps_no_windows(build):
    """The clipped sum of a ghost-norm convolution is the layer's weight gradient from its output gradient's rows
    scaled by the coefficients: bk keeps the layer's input and output gradient, not unfolded windows."""
    torch.manual_seed(0)
    layer = build().double()
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    rule = conv.conv_transpose_grads if isinstance(layer, nn.ConvTranspose2d) else conv.conv_grads
    grad = ParamGradient("weight", layer.weight.shape, 3, "ghost")
    grad.add(rule(layer, (x,), torch.randn_like(layer(x)), frozenset({"weight"}))["weight"], "test")
    plan = grad.norm_sq(keep_for_sum=True).plan
    assert plan.factors is None and len(plan.weighted) == 1
    check_against_oracle(layer, lambda s: per_sample_loss(layer(x[s]).flatten(1)), 3, norm_strategy="ghost")


class Frames(nn.Module):
    """A video model's per-frame convolution: `[B, F, c, *S]` frames folded into the batch (B * F rows, sample-
    major), as TimeSformer-style patch embeddings do, then unfolded again."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x.flatten(0, 1))
        return out.unflatten(0, x.shape[:2]).flatten(1).tanh()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.integers(2, 3),
    batch=st.integers(2, 3),
    transposed=st.booleans(),
    groups=st.sampled_from([1, 2]),
    mode=modes,
    strategy=norm_strategies,
)
def test_a_convolution_on_frames_folded_into_the_batch_matches_oracle(
    frames, batch, transposed, groups, mode, strategy
):
    """k rows per sample: a sample's gradient sums its frames' (their positions together, or one grouped
    convolution with the frames as its batch)."""
    torch.manual_seed(frames * 10 + batch)
    layer = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=groups) if transposed else nn.Conv2d(4, 6, 3, groups=groups)
    model = Frames(layer).double()
    x = torch.randn(batch, frames, 4, 5, 5, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode, norm_strategy=strategy)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize(
    "layer, later, side",
    [
        (lambda: nn.Conv1d(3, 4, 3, padding=1, stride=4), {"padding": "valid"}, 7),  # norms were 23% low
        (lambda: nn.Conv1d(3, 4, 3, padding=1), {"padding": 0}, 7),
        (lambda: nn.Conv2d(3, 4, 3, padding="same"), {"dilation": (2, 2)}, 6),  # 'same' widens with dilation
        (lambda: nn.Conv2d(3, 4, 3), {"stride": 2, "padding": 1, "dilation": 2}, 7),
        (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), {"padding": 0}, 6),  # stale, as PyTorch
        (lambda: nn.Conv2d(3, 4, (3, 2)), {"stride": (2,), "padding": [1]}, 7),  # one value for every dim
        (lambda: nn.ConvTranspose2d(3, 4, 3), {"stride": 2, "dilation": 2, "padding": (1, 1)}, 4),
    ],
)
@pytest.mark.parametrize("strategy", ["ghost", "direct"])
def test_settings_assigned_after_construction_are_read_as_the_forward_reads_them(layer, later, side, mode, strategy):
    """The constructor turns padding into F.pad's pairs and stride, padding and dilation into per-dim ints; the
    forward reads an assignment made later as it is (an int, 'valid', 'same' for the dilation of the call) except
    that a padding mode other than zeros pads by the constructor's pairs. The rule reads them alike, on a later
    step of one engine (it read the constructor's pairs: silently low norms, or a crash on ints)."""
    torch.manual_seed(0)
    model = layer().double()
    reference = copy.deepcopy(model)
    spatial = len(model.kernel_size)
    x = torch.randn(3, 3, *(side,) * spatial, dtype=torch.float64)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, norm_strategy=strategy)
    engine.backward(per_sample_loss(model(x)))
    model.zero_grad(set_to_none=True)
    for target in (model, reference):
        for name, value in later.items():
            setattr(target, name, value)
    expected_norms, expected_sums = clip(
        per_sample_grads(reference, lambda s: per_sample_loss(reference(x[s])), 3), "flat", 1.0
    )
    torch.testing.assert_close(
        engine.backward(per_sample_loss(model(x))).double(), expected_norms, rtol=1e-6, atol=1e-9
    )
    assert_clipped_sums(model, expected_sums, 1e-7)
