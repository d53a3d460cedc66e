"""TF32 settings: where flashdp reads them (a check's tolerance) and where it turns TF32 off (a convolution whose
per-sample gradients give a norm)."""

import types

import pytest
import torch

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
