import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.oracle import check_against_oracle
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


@given(batch=batches, dims=st.sampled_from([1, 2, 3]), config=transposed_configs(), mode=modes)
def test_transposed_conv_matches_oracle(batch, dims, config, mode):
    """Strides, dilations and output_padding leave windows past the input (output_padding < dilation)."""
    conv = TRANSPOSED[dims](**config)
    size = (4, 3, 3)[:dims]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2)).double()
    model(torch.zeros(1, config["in_channels"], *size, dtype=torch.float64))
    x = torch.randn(batch, config["in_channels"], *size, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)


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
