"""The distributed set-up checks (checks.py) and a tensor-parallel norm_group, on 2 gloo processes."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flashdp
from tests.distributed import workloads
from tests.distributed.launch import WORLD, run


class ColumnParallelLinear(nn.Module):
    """Each rank holds half of the output features; the full output is gathered (with autograd)."""

    def __init__(self, full: nn.Linear, rank: int) -> None:
        super().__init__()
        rows = full.out_features // WORLD
        self.local = nn.Linear(full.in_features, rows)
        with torch.no_grad():
            self.local.weight.copy_(full.weight[rank * rows : (rank + 1) * rows])
            self.local.bias.copy_(full.bias[rank * rows : (rank + 1) * rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(self.local(x)), dim=-1)


def _full_layer() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(5, 6), torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))


def _tp_rank(rank: int) -> dict:
    full, x = _full_layer()
    layer = ColumnParallelLinear(full, rank)
    engine = flashdp.make_private(layer, max_grad_norm=0.5, noise_multiplier=0.0, norm_group=dist.group.WORLD)
    # every rank computes the same loss and all_gather's backward sums over ranks: each holds 1 / WORLD of it
    norms = engine.backward(layer(x).tanh().square().sum((1, 2)) / WORLD)
    return {"norms": norms, "weight_grad": layer.local.weight.grad, "bias_grad": layer.local.bias.grad}


def test_norm_group_gives_the_norms_of_the_unsplit_layer():
    ranks = run(_tp_rank)
    full, x = _full_layer()
    with flashdp.make_private(full, max_grad_norm=0.5, noise_multiplier=0.0) as engine:
        expected = engine.backward(full(x).tanh().square().sum((1, 2)))
    rows = full.out_features // WORLD
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["norms"], expected)
        torch.testing.assert_close(result["weight_grad"], full.weight.grad[rank * rows : (rank + 1) * rows])
        torch.testing.assert_close(result["bias_grad"], full.bias.grad[rank * rows : (rank + 1) * rows])


def _error_of(fn) -> str:
    try:
        fn()
    except flashdp.FlashDPError as error:
        return str(error)
    return "no error"


def _norm_group_over_data_parallel_ranks(rank: int) -> str:
    wrapped = workloads.wrap(workloads.build_model(), "ddp")
    return _error_of(
        lambda: flashdp.make_private(wrapped, max_grad_norm=1.0, noise_multiplier=0.0, norm_group=dist.group.WORLD)
    )


def _norm_group_without_tensor_parallel_layers(rank: int) -> str:
    model = workloads.build_model()  # replicated, each rank its own samples: nothing is split
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0, norm_group=dist.group.WORLD)
    ids = workloads.global_batch()[rank * 4 : rank * 4 + 4]
    return _error_of(lambda: engine.backward(workloads.per_sample_loss(model, ids)))


def _per_rank_expected_batch_size(rank: int) -> str:
    torch.manual_seed(0)
    wrapped = workloads.wrap(nn.Linear(3, 1), "ddp")
    engine = flashdp.make_private(
        wrapped, max_grad_norm=1.0, noise_multiplier=0.0, optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.1),
        expected_batch_size=64,  # each rank's batch, not the global 128
    )  # fmt: skip
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(rank))
    engine.backward(wrapped(x).square().sum(1))
    return _error_of(engine.step)


def _per_rank_max_grad_norm(rank: int) -> str:
    wrapped = workloads.wrap(workloads.build_model(), "ddp")
    return _error_of(lambda: flashdp.make_private(wrapped, max_grad_norm=0.05 * (rank + 1), noise_multiplier=0.0))


def _fsdp2_without_the_root(rank: int) -> str:
    from torch.distributed.fsdp import fully_shard

    model = workloads.build_model()
    fully_shard(model[2])  # (the embedding and the last Linear left unsharded)
    return _error_of(lambda: flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=0.0))


def _ddp_with_a_static_graph(rank: int) -> str:
    wrapped = nn.parallel.DistributedDataParallel(workloads.build_model(), static_graph=True)
    return _error_of(lambda: flashdp.make_private(wrapped, max_grad_norm=1.0, noise_multiplier=0.0))


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (_per_rank_max_grad_norm, "different settings on different ranks (max_grad_norm: [0.05, 0.1]"),
        (_fsdp2_without_the_root, "needs every trainable parameter sharded by fully_shard; these are not: 0.weight"),
        (_ddp_with_a_static_graph, "DDP(static_graph=True)"),
        (_norm_group_over_data_parallel_ranks, "shares ranks [0, 1] with the model's data-parallel group"),
        (_norm_group_without_tensor_parallel_layers, "computed different per-sample losses"),
        (_per_rank_expected_batch_size, "128 samples over 2 ranks, implausibly many for expected_batch_size=64"),
    ],
)
def test_a_bad_distributed_setup_is_explained(setup, expected):
    for message in run(setup):
        assert expected in message, message


def _non_finite_loss_on_one_rank(rank: int, wrapper: str) -> list[str]:
    """Rank 1's first step has a non-finite loss: refused on that rank alone, before any collective of the
    backward, it left rank 0 waiting in the backward's agreement. Then a step like any other."""
    wrapped = workloads.wrap(workloads.build_model(), wrapper)
    engine = workloads.private(wrapped, "bk")
    ids = workloads.global_batch()[rank * 4 : rank * 4 + 4]
    outcomes = []
    for step in range(2):
        loss = workloads.per_sample_loss(wrapped, ids)
        if rank == 1 and step == 0:
            loss = loss + torch.tensor([float("inf"), 0.0, 0.0, 0.0])
        outcomes.append(_error_of(lambda loss=loss: engine.backward(loss)))
        if outcomes[-1] == "no error":
            engine.step()
    return outcomes


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_refusal_of_one_ranks_loss_is_raised_on_every_rank(wrapper):
    first, second = run(_non_finite_loss_on_one_rank, wrapper)
    assert "Another rank refused this backward" in first[0], first
    assert "Non-finite per-sample losses" in second[0], second
    assert first[1] == second[1] == "no error"
