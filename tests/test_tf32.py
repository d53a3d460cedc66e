"""TF32 settings: where flashdp reads them (a check's tolerance) and where it turns TF32 off (a convolution whose
per-sample gradients give a norm)."""

import types

import pytest
import torch
from torch import nn

from flashdp._pipeline import measurement
from flashdp._pipeline.loss_graph import LossGraph
from flashdp.per_sample import allows_tf32, ieee_float32_convolutions


def test_float32_convolutions_turn_tf32_off_inside_and_restore_the_setting():
    """Through the fp32_precision settings where torch has them: reading the older allow_tf32 flag raises once a
    user has set cuDNN's convolutions and recurrent layers apart."""
    cudnn = torch.backends.cudnn
    if not hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        pytest.skip("this torch has no fp32_precision settings (torch < 2.9)")
    before = cudnn.conv.fp32_precision
    try:
        cudnn.conv.fp32_precision = "tf32"
        cudnn.rnn.fp32_precision = "ieee"
        with ieee_float32_convolutions():
            assert cudnn.conv.fp32_precision == "ieee"
        assert cudnn.conv.fp32_precision == "tf32"
    finally:
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision = before, "none"


def test_tf32_is_read_from_the_first_setting_that_is_not_none():
    setting = lambda value: types.SimpleNamespace(fp32_precision=value)  # noqa: E731
    assert allows_tf32(setting("none"), setting("tf32"))
    assert not allows_tf32(setting("ieee"), setting("tf32"))
    assert allows_tf32(setting("tf32"), setting("ieee"))
    assert not allows_tf32(setting("none"), setting("none"))


@pytest.mark.parametrize("matmul_tf32", [False, True])
def test_the_checks_take_tf32s_tolerance_only_where_the_graph_may_have_used_tf32(monkeypatch, matmul_tf32):
    """(On CUDA every float32 loss was checked at TF32's tolerance, 1e-2, since cuDNN's convolutions allow TF32 by
    default, and a rule dropping one position of 2048 passed the self-check.) cuDNN's settings count where the
    graph holds one of its convolutions or recurrent layers; cuBLAS's setting counts for every graph."""
    monkeypatch.setattr(measurement, "computed_in_tf32", lambda loss: True)  # (a CUDA float32 loss, on any machine)
    monkeypatch.setattr(measurement, "tf32_allowed", lambda operation: operation != "matmul" or matmul_tf32)
    x = torch.randn(2, 1, 4, 4, device="cpu")
    linear, conv = nn.Linear(16, 1, device="cpu"), nn.Conv2d(1, 1, 3, device="cpu")
    assert measurement._in_tf32(LossGraph(linear(x.flatten(1)).sum(1))) == matmul_tf32
    assert measurement._in_tf32(LossGraph(conv(x).sum((1, 2, 3))))
