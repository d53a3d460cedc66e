"""DDP, FSDP2 and FSDP1 on 2 gloo processes: every rank ends with the update of one process holding the global
batch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flashdp
from tests.distributed.launch import WORLD, run

BATCH = 8  # global; rank r holds samples [r * 4, r * 4 + 4)
LR = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 12 embedding rows: both ranks hold [6, 6] shards, so equal generators would give them equal noise
    return nn.Sequential(nn.Embedding(12, 6), nn.LayerNorm(6), nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 11))


def _data() -> torch.Tensor:
    return torch.randint(0, 11, (BATCH, 5), generator=torch.Generator().manual_seed(1))


def _loss(model, ids) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(1)


def _train(model, wrapped, ids, mode, noise, micro, seed=None, group=None):
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    engine = flashdp.make_private(
        wrapped, mode=mode, max_grad_norm=0.05, noise_multiplier=noise, optimizer=optimizer,
        expected_batch_size=BATCH, sample_rate=0.1, seed=seed,
    )  # fmt: skip
    parts = flashdp.micro_batches(ids, micro, group=group)
    norms = torch.cat([engine.backward(_loss(wrapped, part)) for part in parts])
    engine.step()
    engine.detach()
    return norms


def _full_params(wrapped: nn.Module) -> list[torch.Tensor]:
    """The full parameters in the unwrapped model's order (FSDP1 gathers them; FSDP2 DTensors gather themselves)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(wrapped, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapped):
            return [p.detach().clone() for p in wrapped.module.parameters()]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in wrapped.parameters()]


WRAPPERS = ["ddp", "fsdp2", "fsdp1", "fsdp1-orig"]


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    """DDP; FSDP2 with the embedding and both Linears sharded on their own, then the root; FSDP1 (fsdp1-orig:
    use_orig_params=True) with the middle Linear its own unit and the rest in the root's flat parameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if wrapper == "ddp":
        return DistributedDataParallel(model)
    if wrapper.startswith("fsdp1"):
        options = {"device_id": torch.device("cpu"), "use_orig_params": wrapper == "fsdp1-orig"}
        model[2] = FullyShardedDataParallel(model[2], **options)
        return FullyShardedDataParallel(model, **options)
    options = {}
    if wrapper == "fsdp2-bf16":  # bf16 compute, fp32 sharded parameters and reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def _rank_run(rank: int, wrapper: str, mode: str, noise: float, seed):
    model = _model()
    ids = _data()[rank * 4 : rank * 4 + 4]
    wrapped = wrap(model, wrapper)
    norms = _train(model, wrapped, ids, mode, noise, micro=3, seed=seed)
    params = _full_params(wrapped)
    locals_ = [p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in wrapped.parameters()]
    return {"norms": norms, "params": params, "local": locals_}


def _single_process(mode: str):
    model = _model()
    norms = _train(model, model, _data(), mode, noise=0.0, micro=BATCH)
    return norms, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_update_equals_one_process_on_the_union_batch(wrapper, mode):
    ranks = run(_rank_run, wrapper, mode, 0.0, None)
    expected_norms, expected_params = _single_process(mode)
    torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=1e-5, atol=1e-6)
    for rank in ranks:
        for got, expected in zip(rank["params"], expected_params, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _noise_only(ranks_with, ranks_without) -> list[list[torch.Tensor]]:
    """Per rank, per parameter: the local update due to noise alone (-lr * noise / B)."""
    return [
        [a - b for a, b in zip(w["local"], wo["local"], strict=True)]
        for w, wo in zip(ranks_with, ranks_without, strict=True)
    ]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2", "fsdp1"])
def test_noise_once_per_coordinate_with_the_right_std(wrapper):
    noisy = run(_rank_run, wrapper, "bk", 1.0, 3)  # seeded: the std check below is then deterministic
    clean = run(_rank_run, wrapper, "bk", 0.0, 3)
    per_rank = [torch.cat([n.flatten() for n in rank]) for rank in _noise_only(noisy, clean)]
    expected_std = LR * 1.0 * 0.05 / BATCH
    if wrapper == "ddp":  # replicated: the same noise on every rank
        assert torch.equal(per_rank[0], per_rank[1])
        coords = per_rank[0]
    else:  # sharded: each rank noises its own shard, independently
        coords = torch.cat(per_rank)
        full_noisy = torch.cat([p.flatten() for p in noisy[0]["params"]])
        full_clean = torch.cat([p.flatten() for p in clean[0]["params"]])
        assert torch.equal(full_noisy, torch.cat([p.flatten() for p in noisy[1]["params"]]))
        padding = coords.numel() - full_noisy.numel()  # FSDP1 pads each flat parameter to a multiple of WORLD
        assert padding == 0 if wrapper == "fsdp2" else 0 <= padding < 2 * (WORLD - 1) + 1
        assert abs((full_noisy - full_clean).std().item() / expected_std - 1) < 0.15
    assert abs(coords.std().item() / expected_std - 1) < 0.15  # ~300 coordinates


@pytest.mark.parametrize("wrapper", ["fsdp2", "fsdp1"])
def test_shards_draw_independent_noise(wrapper):
    noisy = run(_rank_run, wrapper, "bk", 1.0, 5)
    clean = run(_rank_run, wrapper, "bk", 0.0, 5)
    # the first local tensor noised (FSDP2: the embedding's shard, FSDP1: the root's flat shard), so equal
    # generators would give equal leading values
    first, second = (rank[0].flatten() for rank in _noise_only(noisy, clean))
    n = min(len(first), len(second))
    # equal generators leave only rounding between the two (1e-6 of the noise); independent ones differ by O(1)
    assert (first[:n] - second[:n]).abs().max() > 0.1 * first.abs().max()


def _rank_with_empty_batch(rank: int, wrapper: str, mode: str):
    """Rank 1 draws no sample this step (Poisson sampling per rank does that); it must still take part, in as
    many micro-batches as rank 0 (FSDP's forward and backward run collectives)."""
    model = _model()
    ids = _data()[:4] if rank == 0 else _data()[:0]
    wrapped = wrap(model, wrapper)
    norms = _train(model, wrapped, ids, mode, 0.0, micro=3, group=dist.group.WORLD)
    return {"norms": norms, "params": _full_params(wrapped)}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_rank_with_an_empty_batch_takes_part_in_the_step(wrapper, mode):
    ranks = run(_rank_with_empty_batch, wrapper, mode)
    model = _model()
    expected_norms = _train(model, model, _data()[:4], mode, noise=0.0, micro=BATCH)
    assert ranks[1]["norms"].shape == (0,)
    torch.testing.assert_close(ranks[0]["norms"], expected_norms, rtol=1e-5, atol=1e-6)
    for rank in ranks:
        for got, expected in zip(rank["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_fsdp2_mixed_precision_matches_fp32_to_bf16_accuracy(mode):
    ranks = run(_rank_run, "fsdp2-bf16", mode, 0.0, None)
    expected_norms, expected_params = _single_process(mode)
    initial = list(_model().parameters())
    torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=2e-2, atol=1e-3)
    for rank in ranks:
        for got, expected, start in zip(rank["params"], expected_params, initial, strict=True):
            assert got.dtype == torch.float32
            update, expected_update = got - start.detach(), expected - start.detach()
            scale = expected_update.abs().max()
            torch.testing.assert_close(update, expected_update, rtol=0, atol=0.03 * scale.item())
