"""FSDP1 (FullyShardedDataParallel), use_orig_params False and True, on 2 gloo processes."""

from tests.distributed.suite import (
    AdapterSuite,
    check_noise_once_per_coordinate_with_the_right_std,
    check_shards_draw_independent_noise,
)


class TestFSDP1(AdapterSuite):
    wrapper = "fsdp1"


class TestFSDP1OrigParams(AdapterSuite):
    wrapper = "fsdp1-orig"


def test_noise_once_per_coordinate_with_the_right_std():
    check_noise_once_per_coordinate_with_the_right_std("fsdp1")


def test_shards_draw_independent_noise():
    check_shards_draw_independent_noise("fsdp1")
