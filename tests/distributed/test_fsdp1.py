"""FSDP1 (FullyShardedDataParallel), use_orig_params False and True, on 2 gloo processes."""

import pytest
import torch

from tests.distributed import workloads
from tests.distributed.launch import run
from tests.distributed.suite import (
    AdapterSuite,
    assert_steps_of_one_process,
    check_noise_once_per_coordinate_with_the_right_std,
    check_shards_draw_independent_noise,
)


class TestFSDP1(AdapterSuite):
    wrapper = "fsdp1"
    broadcast_counted_by = "generic"


class TestFSDP1OrigParams(AdapterSuite):
    wrapper = "fsdp1-orig"
    broadcast_counted_by = "generic"


def test_noise_once_per_coordinate_with_the_right_std():
    check_noise_once_per_coordinate_with_the_right_std("fsdp1")


def test_shards_draw_independent_noise():
    check_shards_draw_independent_noise("fsdp1")


def test_an_output_broadcast_over_the_batch_stays_shared_when_its_size_fits_the_batch_later():
    """Positions of [T] ids, found shared at T=5, B=4; at T=4, B=2 the [T, d] output's size fits 2 rows per sample:
    only what the first step learnt keeps it shared (FSDP1 cannot verify)."""
    for rank in run(workloads.rank_positions_under_fsdp1, workloads.POSITION_STEPS):
        for norms, expected in rank["steps"]:
            torch.testing.assert_close(norms, expected.float(), rtol=1e-5, atol=1e-6)


def test_an_output_broadcast_over_the_batch_whose_size_fits_the_batch_is_refused_on_a_first_step():
    """At T=4, B=2 first, sizes cannot tell a shared [T, d] from 2 rows per sample: refused on every rank, then a
    step whose sizes tell is exact."""
    for rank in run(workloads.rank_positions_under_fsdp1, [(2, 4), (4, 5), (2, 4)]):
        refused, *exact = rank["steps"]
        assert "fits the batch by size" in refused and "positions" in refused
        for norms, expected in exact:
            torch.testing.assert_close(norms, expected.float(), rtol=1e-5, atol=1e-6)


def test_fewer_losses_than_samples_are_refused_naming_the_mismatch():
    """Under FSDP the coverage walk's own errors come before the refusal of what FSDP cannot count."""
    for error in run(workloads.rank_with_fewer_losses_than_samples, "fsdp1-orig"):
        assert "Batch size mismatch" in error, error


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_shard_grad_op_is_refused_naming_what_to_use(use_orig_params):
    """It trained silently wrong from the second step (the forward read the gathered parameters of before the
    update), or was refused as if parameters had been replaced."""
    for error in run(workloads.rank_with_shard_grad_op, use_orig_params):
        assert "SHARD_GRAD_OP" in error and "Use FULL_SHARD, or FSDP2" in error, error


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_frozen_parameter_in_a_unit_over_steps_of_several_micro_batches_equals_one_process(mode):
    """FSDP1's forward zeroes, in place, the part of the flat gradient that belongs to a frozen parameter (its
    original .grad is None): flashdp took that for a foreign change, on the one rank whose shard holds that part,
    and the other rank hung in the next collective."""
    micros = (2, 2, 4)
    ranks = run(workloads.rank_steps_in_micro_batches, "fsdp1-orig", mode, micros, True)
    assert not any("error" in rank for rank in ranks), [rank.get("error") for rank in ranks]
    assert_steps_of_one_process(ranks, *workloads.single_process_micro_steps(mode, len(micros), frozen=True))


@pytest.mark.parametrize("wrapper", ["fsdp1", "fsdp1-orig"])
def test_a_module_called_without_its_hooks_is_refused(wrapper):
    """(Silently skipped with use_orig_params=True before 2026-12-08: the views it read, held by no recorded call,
    led to a flat parameter the coverage walk could not name, and its parameters got no gradient.)"""
    with pytest.raises(Exception, match="outside"):
        run(workloads.rank_with_a_bypassed_module, wrapper, "forward")


@pytest.mark.parametrize("how", ["masked", "transposed"])
def test_a_module_called_with_a_tensor_in_place_of_its_parameter_is_refused(how):
    """(Counted with use_orig_params=False before 2026-12-08, the masked or transposed tensor's gradient as the
    parameter's: its parameters were looked for among those FSDP1 unregisters for the forward; then the transpose,
    a view at the parameter's place, passed for FSDP1's own.) With use_orig_params=True FSDP1's forward reads its
    own views whatever `functional_call` swaps: nothing to tell apart."""
    with pytest.raises(Exception, match="outside"):
        run(workloads.rank_with_a_bypassed_module, "fsdp1", how)
