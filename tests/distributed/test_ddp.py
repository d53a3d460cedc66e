"""DistributedDataParallel on 2 gloo processes."""

from tests.distributed.suite import AdapterSuite, check_noise_once_per_coordinate_with_the_right_std


class TestDDP(AdapterSuite):
    wrapper = "ddp"


def test_noise_is_the_same_on_every_replica_with_the_right_std():
    check_noise_once_per_coordinate_with_the_right_std("ddp")
