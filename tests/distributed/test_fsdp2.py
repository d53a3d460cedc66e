"""FSDP2 (fully_shard) on 2 gloo processes."""

import pytest
import torch

from tests.distributed import workloads
from tests.distributed.launch import run
from tests.distributed.suite import (
    AdapterSuite,
    check_noise_once_per_coordinate_with_the_right_std,
    check_shards_draw_independent_noise,
)


class TestFSDP2(AdapterSuite):
    wrapper = "fsdp2"
    uneven_reach_modes = ("bk",)


def test_noise_once_per_coordinate_with_the_right_std():
    check_noise_once_per_coordinate_with_the_right_std("fsdp2")


def test_shards_draw_independent_noise():
    check_shards_draw_independent_noise("fsdp2")


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_fsdp2_mixed_precision_matches_fp32_to_bf16_accuracy(mode):
    ranks = run(workloads.rank_run, "fsdp2-bf16", mode, 0.0, None)
    expected_norms, expected_params = workloads.single_process(mode)
    initial = list(workloads.build_model().parameters())
    torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=2e-2, atol=1e-3)
    for rank in ranks:
        for got, expected, start in zip(rank["params"], expected_params, initial, strict=True):
            assert got.dtype == torch.float32
            update, expected_update = got - start.detach(), expected - start.detach()
            scale = expected_update.abs().max()
            torch.testing.assert_close(update, expected_update, rtol=0, atol=0.03 * scale.item())


def test_a_coverage_refused_on_one_rank_is_refused_on_every_rank():
    """Rank 1 learns a layer time-major, then finds it batch-first again: the layer would move to an enclosing
    generic rule, which FSDP cannot run; that rank refused alone and the other waited in the next collective until
    the process died (or for ever)."""
    first, second = run(workloads.rank_relearning_a_layout, "fsdp2", "bk")
    assert first[0] == second[0] == "ok"
    assert "Under FSDP, flashdp counts a parameter used outside its own module" in second[1], second
    assert "Another rank refused" in first[1], first
