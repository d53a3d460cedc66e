"""FSDP2 (fully_shard) on 2 gloo processes."""

import pytest
import torch

from tests.distributed import workloads
from tests.distributed.launch import run
from tests.distributed.suite import (
    AdapterSuite,
    assert_steps_of_one_process,
    check_noise_once_per_coordinate_with_the_right_std,
    check_raw_parameters,
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
    """Rank 1 uses a layer's weights outside the layer: they would move to an enclosing generic rule, which FSDP
    cannot run; that rank refused alone and the other waited in the next collective until the process died (or for
    ever)."""
    first, second = run(workloads.rank_using_a_weight_outside_its_layer, "fsdp2", "bk")
    assert first[0] == second[0] == "ok"
    assert "flashdp would miss part of these parameters' per-sample gradients" in second[1], second
    assert "'2.layer.weight' reaches the loss through TBackward0 outside the forward" in second[1], second
    assert "Another rank refused" in first[1], first


def _rank_run_summing(rank: int, mode: str) -> dict:
    """`workloads.rank_run` with every unit's reduction a sum (divide factor 1; a sum collective, gloo having no
    pre-multiplied sum): ghost's second pass scaled its loss by the world size all the same, doubling the update."""
    from torch.distributed.fsdp import FSDPModule

    model = workloads.build_model()
    wrapped = workloads.wrap(model, "fsdp2")
    for unit in (m for m in wrapped.modules() if isinstance(m, FSDPModule)):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    ids = workloads.global_batch()[rank * 4 : rank * 4 + 4]
    norms = workloads.train(model, wrapped, ids, mode, 0.0, micro=3)
    return {"norms": [norms], "params": workloads.full_params(wrapped)}


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_units_gradient_divide_factor_is_what_the_second_pass_scales_by(mode):
    expected_norms, expected_params = workloads.single_process(mode)
    assert_steps_of_one_process(run(_rank_run_summing, mode), [expected_norms], expected_params)


def _rank_run_frozen_outside_the_units(rank: int) -> dict:
    """The embedding and the norm after it frozen and left out of every unit, the root not sharded (make_private
    read the mesh from the first parameter: an AttributeError)."""
    from torch.distributed.fsdp import fully_shard

    model = workloads.build_model()
    model[:2].requires_grad_(False)
    for layer in (model[2], model[4]):
        fully_shard(layer)
    ids = workloads.global_batch()[rank * 4 : rank * 4 + 4]
    norms = workloads.train(model, model, ids, "bk", 0.0, micro=4)
    return {"norms": [norms], "params": workloads.full_params(model)}


def test_frozen_parameters_outside_every_unit_are_left_alone():
    expected_model = workloads.build_model()
    expected_model[:2].requires_grad_(False)
    norms = workloads.train(expected_model, expected_model, workloads.global_batch(), "bk", 0.0, micro=8)
    expected = [p.detach().clone() for p in expected_model.parameters()]
    assert_steps_of_one_process(run(_rank_run_frozen_outside_the_units), [norms], expected)


def _float16_rank_of_its_own_size(rank: int, mode: str) -> str:
    """A float16 model (4 check weights), rank 0 with 3 samples, rank 1 with 5."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import flashdp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)).half()
    for unit in (model[0], model[2], model):
        fully_shard(unit)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=8)
    x = torch.randn(3 + 2 * rank, 4, generator=torch.Generator().manual_seed(rank)).half()
    engine.backward(model(x).float().square().sum(1))
    return "ok"


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_ranks_with_more_and_fewer_samples_than_check_weights_run_the_same_weighted_passes(mode):
    """(A breaker's finding: the layout check's weighted passes were as many as the LOCAL batch needed, one for 3
    float16 samples and two for 5: the rank with two waited in FSDP2's all-gather for ever.)"""
    assert run(_float16_rank_of_its_own_size, mode) == ["ok", "ok"]


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_raw_parameters_of_a_module_without_a_rule_in_a_unit_of_their_own_equal_one_process(mode):
    """As the suite's test, the module resharded after its forward: counted where they meet the batch."""
    strategies = check_raw_parameters("fsdp2", mode, mixed=False, own_unit=True)
    assert [v for k, v in strategies.items() if k.endswith("3.g")] == ["broadcast"]


def test_a_unit_of_its_own_whose_forward_the_generic_rule_runs_again_is_refused():
    """FSDP2's hooks on the unit would gather its parameters for the re-run in place of the copies the rule
    differentiates: a breaker's module called without the batch counted 0 (refused by the self-check, and wrong
    on later steps where a gate at 0 hid it on the first)."""
    with pytest.raises(Exception, match="is a unit of its own"):
        check_raw_parameters("fsdp2", "bk", mixed=True, own_unit=True)


@pytest.mark.parametrize("how", ["forward", "masked"])
def test_a_module_called_without_its_hooks_or_its_own_parameter_is_refused(how):
    with pytest.raises(Exception, match="outside"):
        run(workloads.rank_with_a_bypassed_module, "fsdp2", how)
