"""What the distributed tests run on 2 gloo processes: a small model, its data split over the ranks, each wrapper
(DDP, FSDP2, FSDP1 with and without use_orig_params), and one DP step."""

import copy

import torch
import torch.distributed as dist
from torch import nn

import flashdp
from tests import oracle

GRADIENT_COLLECTIVES = ("allreduce", "all_reduce", "reduce_scatter")

BATCH = 8  # global; rank r holds samples [r * 4, r * 4 + 4)
LR = 0.5


def build_model() -> nn.Module:
    torch.manual_seed(0)
    # 12 embedding rows: both ranks hold [6, 6] shards, so equal generators would give them equal noise
    return nn.Sequential(nn.Embedding(12, 6), nn.LayerNorm(6), nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 11))


class TimeMajor(nn.Module):
    """Runs a layer on `[T, B, d]`: the input transposed, and the output transposed back."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(0, 1)).transpose(0, 1)


def build_time_major_model() -> nn.Module:
    """build_model with its middle Linear run time-major (the same indices for `wrap`)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(12, 6), nn.LayerNorm(6), TimeMajor(nn.Linear(6, 10)), nn.Tanh(), nn.Linear(10, 11)
    )


class Branch(nn.Module):
    """A Linear, plus a second one on the rows where `extra_rows` `[B]` is True: called on every row, on none (as
    an expert no row of a rank was routed to), or masked per row (the one-process reference)."""

    def __init__(self):
        super().__init__()
        self.main, self.extra = nn.Linear(6, 6), nn.Linear(6, 6)
        self.extra_rows: torch.Tensor | None = None

    def forward(self, x):
        rows = self.extra_rows
        if rows is None or not rows.any():
            return self.main(x)
        if rows.all():
            return self.main(x) + self.extra(x)
        return self.main(x) + rows.view(-1, *[1] * (x.dim() - 1)) * self.extra(x)


def build_branching_model() -> nn.Module:
    """build_model with a Branch as its middle layer (the same indices for `wrap`)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(12, 6), nn.LayerNorm(6), Branch(), nn.Tanh(), nn.Linear(6, 11))


def rank_with_a_branch_on_one_rank(rank: int, wrapper: str, mode: str) -> dict:
    """The Branch's second Linear is called on rank 0 only: ranks reach different parameters of one unit."""
    model = build_branching_model()
    model[2].extra_rows = torch.full((4,), rank == 0)
    wrapped = wrap(model, wrapper)
    norms = train(model, wrapped, global_batch()[rank * 4 : rank * 4 + 4], mode, 0.0, micro=BATCH)
    return {"norms": norms, "params": full_params(wrapped)}


def single_process_with_a_branch(mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build_branching_model()
    model[2].extra_rows = torch.arange(BATCH) < 4
    norms = train(model, model, global_batch(), mode, noise=0.0, micro=BATCH)
    return norms, [p.detach().clone() for p in model.parameters()]


class WeightOutside(nn.Module):
    """build_model's layers, with the middle Linear's weight also used outside it (`F.linear`, in this root's
    forward) where `outside` is set: flashdp then counts that weight with the root's generic rule, whose site comes
    first (another plan, learnt by the ranks whose batch takes that path)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.norm = nn.Embedding(12, 6), nn.LayerNorm(6)
        self.middle, self.head = nn.Linear(6, 10), nn.Linear(10, 11)
        self.outside = False

    def forward(self, ids):
        h = self.norm(self.embedding(ids))
        middle = self.middle(h)
        if self.outside:
            middle = middle + 0.5 * nn.functional.linear(h, self.middle.weight)
        return self.head(middle.tanh())


def rank_with_another_plan(rank: int, wrapper: str, mode: str, noise: float) -> dict:
    """Rank 1's batch uses the middle Linear's weight outside it, rank 0's does not: the ranks' plans differ."""
    model = WeightOutside()
    model.outside = rank == 1
    wrapped = wrap(model, wrapper)
    norms = train(model, wrapped, global_batch()[rank * 4 : rank * 4 + 4], mode, noise, micro=BATCH, seed=3)
    return {"norms": norms, "params": full_params(wrapped)}


def single_process_with_another_plan(mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One process, one step: rank 0's rows without the outside use, then rank 1's with it."""
    model = WeightOutside()
    engine = private(model, mode)
    norms = []
    for rank, rows in enumerate(global_batch().split(4)):
        model.outside = rank == 1
        norms.append(engine.backward(per_sample_loss(model, rows)))
    engine.step()
    engine.detach()
    return torch.cat(norms), [p.detach().clone() for p in model.parameters()]


def build_cnn() -> nn.Module:
    """Convolutions at the indices `wrap` shards, each with a direct norm at 7 x 7 images (dense per-sample
    gradients from one grouped convolution, built from the layer's settings, not from its sharded weight)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), nn.Tanh(),
        nn.Conv2d(8, 3, 3), nn.Flatten(),
    )  # fmt: skip


def cnn_step(model, wrapped, images, mode) -> tuple[torch.Tensor, dict[str, str]]:
    """One DP step on `images` (no noise): the norms and the engine's strategies."""
    engine = private(wrapped, mode)
    norms = engine.backward(wrapped(images).square().mean(1))
    engine.step()
    strategies = engine.strategies
    engine.detach()
    return norms, strategies


def cnn_images() -> torch.Tensor:
    return torch.randn(BATCH, 3, 7, 7, generator=torch.Generator().manual_seed(2))  # (no dim of 4: FSDP1)


def rank_cnn_run(rank: int, wrapper: str, mode: str) -> dict:
    model = build_cnn()
    wrapped = wrap(model, wrapper)
    norms, strategies = cnn_step(model, wrapped, cnn_images()[rank * 4 : rank * 4 + 4], mode)
    return {"norms": norms, "params": full_params(wrapped), "strategies": strategies}


def global_batch() -> torch.Tensor:
    return torch.randint(0, 11, (BATCH, 5), generator=torch.Generator().manual_seed(1))


def per_sample_loss(model, ids) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(1)


def train(model, wrapped, ids, mode, noise, micro, seed=None, group=None, users=None):
    """One DP step on `ids` in micro-batches of `micro` rows (with `users`: user-level clipping, each micro-batch
    split at user boundaries)."""
    engine = private(wrapped, mode, noise=noise, seed=seed)
    if users is None:
        parts = flashdp.micro_batches(ids, micro, group=group)
        norms = torch.cat([engine.backward(per_sample_loss(wrapped, part)) for part in parts])
    else:
        parts = flashdp.micro_batches((ids, users), micro, group=group, users=users)
        norms = torch.cat([engine.backward(per_sample_loss(wrapped, part), users=who) for part, who in parts])
    engine.step()
    engine.detach()
    return norms


def private(wrapped: nn.Module, mode: str, noise: float = 0.0, seed: int | None = None) -> flashdp.DPEngine:
    """The engine every workload trains with: SGD at `LR`, C = 0.05, the global batch's expected size."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    return flashdp.make_private(
        wrapped, mode=mode, max_grad_norm=0.05, noise_multiplier=noise, optimizer=optimizer,
        expected_batch_size=BATCH, sample_rate=0.1, seed=seed,
    )  # fmt: skip


def full_params(wrapped: nn.Module) -> list[torch.Tensor]:
    """The full parameters in the unwrapped model's order (FSDP1 gathers them; FSDP2 DTensors gather themselves)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(wrapped, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapped):
            return [p.detach().clone() for p in wrapped.module.parameters()]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in wrapped.parameters()]


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


class TanhScale(nn.Module):
    """`tanh(x) * g + b`: raw parameters meeting the batch by broadcast (counted where they meet it); `mixed`:
    `tanh(x) @ g + b`, a matrix `g` (the generic rule's)."""

    def __init__(self, width: int, mixed: bool = False) -> None:
        super().__init__()
        shape = (width, width) if mixed else (width,)
        self.g, self.b = nn.Parameter(torch.rand(shape) + 0.5), nn.Parameter(torch.randn(width) / 4)
        self.mixed = mixed

    def forward(self, x):
        return (torch.tanh(x) @ self.g if self.mixed else torch.tanh(x) * self.g) + self.b


def build_scaled_model(mixed: bool = False) -> nn.Module:
    """build_model with its Tanh a `TanhScale` (the same indices for `wrap`: its parameters in the root's unit)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(12, 6), nn.LayerNorm(6), nn.Linear(6, 10), TanhScale(10, mixed), nn.Linear(10, 11)
    )


def rank_with_a_layer_scale(rank: int, wrapper: str, mode: str, mixed: bool, own_unit: bool = False) -> dict:
    """`own_unit` (FSDP2): the `TanhScale` sharded on its own too (resharded after its forward)."""
    model = build_scaled_model(mixed)
    if own_unit:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[3])
    wrapped = wrap(model, wrapper)
    engine = private(wrapped, mode)
    norms = engine.backward(per_sample_loss(wrapped, global_batch()[rank * 4 : rank * 4 + 4]))
    strategies = dict(engine.strategies)
    engine.step()
    engine.detach()
    return {"norms": norms, "params": full_params(wrapped), "strategies": strategies}


def rank_run(rank: int, wrapper: str, mode: str, noise: float, seed):
    model = build_model()
    ids = global_batch()[rank * 4 : rank * 4 + 4]
    wrapped = wrap(model, wrapper)
    norms = train(model, wrapped, ids, mode, noise, micro=3, seed=seed)
    params = full_params(wrapped)
    locals_ = [p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in wrapped.parameters()]
    return {"norms": norms, "params": params, "local": locals_}


#: the global batch's users: rank 0 holds users 0-2 (user 0 twice), rank 1 users 3-4 (user 3 three times)
USERS = torch.tensor([0, 1, 0, 2, 3, 3, 4, 3])


def rank_with_users(rank: int, wrapper: str, mode: str, shared_user: bool) -> dict:
    """User-level clipping with each rank's users its own; with `shared_user`, rank 1's first row belongs to
    user 2 of rank 0 (refused on every rank)."""
    model = build_model()
    rows = slice(rank * 4, rank * 4 + 4)
    users = USERS[rows].clone()
    if shared_user and rank == 1:
        users[0] = 2
    wrapped = wrap(model, wrapper)
    try:
        norms = train(model, wrapped, global_batch()[rows], mode, 0.0, micro=3, group=dist.group.WORLD, users=users)
    except flashdp.FlashDPError as error:
        return {"error": str(error)}
    return {"norms": norms, "params": full_params(wrapped)}


def single_process(mode: str):
    model = build_model()
    norms = train(model, model, global_batch(), mode, noise=0.0, micro=BATCH)
    return norms, [p.detach().clone() for p in model.parameters()]


def rank_with_empty_batch(rank: int, wrapper: str, mode: str):
    """Rank 1 draws no sample this step (Poisson sampling per rank does that); it must still take part, in as
    many micro-batches as rank 0 (FSDP's forward and backward run collectives)."""
    model = build_model()
    ids = global_batch()[:4] if rank == 0 else global_batch()[:0]
    wrapped = wrap(model, wrapper)
    norms = train(model, wrapped, ids, mode, 0.0, micro=3, group=dist.group.WORLD)
    return {"norms": norms, "params": full_params(wrapped)}


def noise_only(ranks_with, ranks_without) -> list[list[torch.Tensor]]:
    """Per rank, per parameter: the local update due to noise alone (-lr * noise / B)."""
    return [
        [a - b for a, b in zip(w["local"], wo["local"], strict=True)]
        for w, wo in zip(ranks_with, ranks_without, strict=True)
    ]


def count_backward_collectives(rank: int, wrapper: str, mode: str) -> dict:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.profiler import ProfilerActivity, profile

    wrapped = wrap(build_model(), wrapper)
    engine = flashdp.make_private(
        wrapped, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0,
        optimizer=torch.optim.SGD(wrapped.parameters(), lr=0.1), expected_batch_size=8, sample_rate=0.1,
    )  # fmt: skip
    loss = per_sample_loss(wrapped, global_batch()[rank * 4 : rank * 4 + 4])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.backward(loss)
    names = [e.name for e in prof.events() if e.name.startswith("c10d::")]
    gradient = [n for n in names if any(k in n for k in GRADIENT_COLLECTIVES)]
    return {
        "gradient_collectives": gradient,
        "fsdp1_units": len(FullyShardedDataParallel.fsdp_modules(wrapped)),
        "fsdp2_units": sum(isinstance(m, FSDPModule) for m in wrapped.modules()),
    }


def rank_with_a_nan_gradient(rank: int, wrapper: str, mode: str) -> str:
    """Rank 1's third sample has a finite loss and a NaN gradient; what each rank's backward says."""
    wrapped = wrap(build_model(), wrapper)
    engine = flashdp.make_private(wrapped, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    ids = global_batch()[rank * 4 : rank * 4 + 4]
    logits = wrapped(ids)
    loss = nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none").mean(1)
    if rank == 1:  # sqrt'(0) * 0 = NaN in sample 2's gradient only
        zero = (logits[2] - logits[2].detach()).sum().abs().sqrt()
        loss = torch.cat([loss[:2], (loss[2] + zero)[None], loss[3:]])
    try:
        engine.backward(loss)
    except flashdp.FlashDPError as error:
        return str(error)
    return "no error"


def rank_with_a_batch_as_long_as_the_sequence(rank: int, wrapper: str, mode: str) -> dict:
    """Rank 0 holds 5 samples of length 5, rank 1 the other 3. On rank 0 the time-major Linear's `[T, B, d]` passes
    the size check and is found by verifying; rank 1 finds it by size. Every rank must run the same passes."""
    ids = global_batch()[:5] if rank == 0 else global_batch()[5:]
    model = build_time_major_model()
    wrapped = wrap(model, wrapper)
    norms = train(model, wrapped, ids, mode, 0.0, micro=BATCH)
    return {"norms": norms, "params": full_params(wrapped)}


#: per step, the batch sizes of ranks 0 and 1: a batch of one first, then B == T = 4 on rank 0
STEP_SIZES = [(1, 3), (4, 3), (2, 4)]
STEP_LENGTH = 4


def step_batches() -> list[torch.Tensor]:
    """The union batch of each step of STEP_SIZES (rank 0's samples first), sequences of STEP_LENGTH tokens."""
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 11, (sum(sizes), STEP_LENGTH), generator=generator) for sizes in STEP_SIZES]


def _train_steps(
    wrapped: nn.Module, mode: str, batches: list[torch.Tensor], micros: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """One engine, one step per batch, step s in micro-batches of `micros[s]` rows (default: the whole batch in
    one): each step's norms."""
    engine = private(wrapped, mode)
    norms = []
    for ids, micro in zip(batches, micros or [len(ids) for ids in batches], strict=True):
        norms.append(torch.cat([engine.backward(per_sample_loss(wrapped, part)) for part in ids.split(micro)]))
        engine.step()
    engine.detach()
    return norms


def rank_steps_with_changing_batches(rank: int, wrapper: str, mode: str) -> dict:
    """STEP_SIZES on a model with a time-major Linear: rank 0 learns nothing from its batch of one, then meets
    B == T. Each rank's norms per step and the final parameters, or the error its backward raised."""
    mine = [
        ids[: sizes[0]] if rank == 0 else ids[sizes[0] :] for ids, sizes in zip(step_batches(), STEP_SIZES, strict=True)
    ]
    wrapped = wrap(build_time_major_model(), wrapper)
    try:
        norms = _train_steps(wrapped, mode, mine)
    except flashdp.FlashDPError as error:
        return {"error": str(error)}
    return {"norms": norms, "params": full_params(wrapped)}


def micro_step_batches(steps: int) -> list[torch.Tensor]:
    """The global batch of each step of the multi-step runs."""
    return [torch.roll(global_batch(), step, dims=0) for step in range(steps)]


def _maybe_frozen(model: nn.Module, frozen: bool) -> nn.Module:
    """With `frozen`, the middle Linear's bias frozen: a frozen parameter in a unit of trainable ones."""
    if frozen:
        model[2].bias.requires_grad_(False)
    return model


def rank_steps_in_micro_batches(
    rank: int, wrapper: str, mode: str, micros: tuple[int, ...], frozen: bool = False
) -> dict:
    """Steps of one engine, step s in micro-batches of `micros[s]` rows of the rank's 4: gradients accumulate
    across micro-batches and are cleared by each step."""
    batches = [ids[rank * 4 : rank * 4 + 4] for ids in micro_step_batches(len(micros))]
    wrapped = wrap(_maybe_frozen(build_model(), frozen), wrapper)
    try:
        norms = _train_steps(wrapped, mode, batches, micros)
    except flashdp.FlashDPError as error:
        return {"error": str(error)}
    return {"norms": norms, "params": full_params(wrapped)}


def single_process_micro_steps(
    mode: str, steps: int, frozen: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """rank_steps_in_micro_batches' steps on one process, each global batch in one backward."""
    model = _maybe_frozen(build_model(), frozen)
    norms = _train_steps(model, mode, micro_step_batches(steps))
    return norms, [p.detach().clone() for p in model.parameters()]


def single_process_steps(mode: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = build_time_major_model()
    norms = _train_steps(model, mode, step_batches())
    return norms, [p.detach().clone() for p in model.parameters()]


class Positions(nn.Module):
    """A position embedding looked up with ids `[T]`: its output `[T, d]` is broadcast over the batch `[B, T, d]`;
    with T a multiple of B its size alone fits a batch of B * k rows."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(11, 6), nn.Embedding(8, 6), nn.Linear(6, 11)

    def forward(self, ids):
        return self.head(torch.tanh(self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))))


#: per step, (B, T) on each rank: T not a multiple of B first (the embedding is found shared), then T == 2B
POSITION_STEPS = [(4, 5), (2, 4)]


def _position_batches(rank: int, steps: list[tuple[int, int]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3 + rank)
    return [torch.randint(0, 11, (b, t), generator=generator) for b, t in steps]


def rank_positions_under_fsdp1(rank: int, steps: list[tuple[int, int]]) -> dict:
    """FSDP1 (no verifying pass) over `Positions`: each step's norms with the float64 oracle's, or the error."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = Positions().double()
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    engine = flashdp.make_private(
        wrapped, max_grad_norm=1.0, noise_multiplier=0.0, optimizer=torch.optim.SGD(wrapped.parameters(), lr=LR),
        expected_batch_size=8, sample_rate=0.1,
    )  # fmt: skip
    found = []
    for ids in _position_batches(rank, steps):
        with FullyShardedDataParallel.summon_full_params(wrapped):
            alone = copy.deepcopy(model)
        grads = oracle.per_sample_grads(alone, lambda part, m=alone, x=ids: per_sample_loss(m, x[part]), len(ids))
        expected = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
        try:
            found.append((engine.backward(per_sample_loss(wrapped, ids)), expected))
        except flashdp.FlashDPError as error:
            found.append(str(error))
            continue
        engine.step()
    return {"steps": found}


def rank_with_fewer_losses_than_samples(rank: int, wrapper: str) -> str:
    """3 per-sample losses after a forward of 4 samples: the error the backward raises."""
    wrapped = wrap(build_model(), wrapper)
    engine = flashdp.make_private(wrapped, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
    ids = global_batch()[:4]
    try:
        engine.backward(per_sample_loss(wrapped, ids)[:3])
    except flashdp.FlashDPError as error:
        return str(error)
    return "no error"


def rank_with_shard_grad_op(rank: int, use_orig_params: bool) -> str:
    """FSDP1 with SHARD_GRAD_OP: make_private's refusal (flashdp's backward runs under no_sync(), where the
    gathered parameters outlive the backward and the next forward would miss the optimizer's update)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    options = {"device_id": torch.device("cpu"), "use_orig_params": use_orig_params}
    wrapped = FullyShardedDataParallel(build_model(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, **options)
    try:
        flashdp.make_private(wrapped, mode="bk", max_grad_norm=1.0, noise_multiplier=0.0)
    except flashdp.FlashDPError as error:
        return str(error)
    return "no error"


def rank_with_a_foreign_grad_write(rank: int, wrapper: str, mode: str, before_step: bool = False) -> dict:
    """Between two micro-batches (`before_step`: after the first, before engine.step), rank 1 alone writes into a
    trainable parameter's .grad: what each rank's second backward (step) says (every rank must raise: one rank
    raising alone left the others in the next collective), or the parameters after the step where nothing was
    refused."""
    wrapped = wrap(build_model(), wrapper)
    engine = private(wrapped, mode)
    first, second = global_batch()[rank * 4 : rank * 4 + 4].split(2)
    engine.backward(per_sample_loss(wrapped, first))
    if rank == 1:  # (a parameter with a part on this rank: FSDP1's original parameters may hold none of it)
        param = next(p for p in wrapped.parameters() if p.requires_grad and p.numel())
        with torch.no_grad():
            if param.grad is None:
                param.grad = torch.ones_like(param)
            else:
                param.grad.add_(1.0)
    try:
        if not before_step:
            engine.backward(per_sample_loss(wrapped, second))
        engine.step()
    except flashdp.FlashDPError as error:
        return {"error": str(error)}
    return {"params": full_params(wrapped)}


class SometimesFunctional(nn.Module):
    """A Linear, or its weights used by `F.linear` outside its own forward where `functional` is set."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.layer, self.functional = layer, False

    def forward(self, x):
        if self.functional:
            return nn.functional.linear(x, self.layer.weight, self.layer.bias)
        return self.layer(x)


def rank_using_a_weight_outside_its_layer(rank: int, wrapper: str, mode: str) -> list[str]:
    """Rank 1 uses the middle Linear's weights outside the Linear on the second step: its parameters would move to
    the enclosing module's generic rule, which FSDP cannot run. What each step said on each rank ("ok" or the
    error)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(12, 6), nn.LayerNorm(6), SometimesFunctional(nn.Linear(6, 10)), nn.Tanh(), nn.Linear(10, 11)
    )
    wrapped = wrap(model, wrapper)
    engine = private(wrapped, mode)
    said = []
    for step in range(2):
        model[2].functional = rank == 1 and step == 1
        ids = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            engine.backward(per_sample_loss(wrapped, ids))
            engine.step()
            said.append("ok")
        except flashdp.FlashDPError as error:
            said.append(str(error))
    return said


class Bypassing(nn.Module):
    """An embedding, then a module without a rule (`x @ w + b`) called `how`: "forward" by `mid.forward(h)` (its
    hooks skipped: no call recorded), "masked" by `functional_call(mid, {"g": mid.g * mask}, (h,))` (a tensor in
    place of its parameter), "transposed" likewise with `mid.g.t()` (under FSDP1, a view of its flat parameter at
    the parameter's place and shape); then a head."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.head = nn.Embedding(12, 6), TanhScale(6, mixed=True), nn.Linear(6, 11)
        self.how = how

    def forward(self, ids):
        h = self.emb(ids)
        if self.how == "forward":
            return self.head(self.mid.forward(h))
        mask = torch.ones(6, 6)
        mask[:, 1] = 0
        g = self.mid.g.t() if self.how == "transposed" else self.mid.g * mask
        return self.head(torch.func.functional_call(self.mid, {"g": g}, (h,)))


def rank_with_a_bypassed_module(rank: int, wrapper: str, how: str) -> dict:
    """One backward of `Bypassing(how)` wrapped at its root alone (FSDP1, or FSDP2)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    model = Bypassing(how)
    if wrapper == "fsdp2":
        wrapped = fully_shard(model)
    else:
        orig = wrapper == "fsdp1-orig"
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig)
    engine = private(wrapped, "bk")
    norms = engine.backward(per_sample_loss(wrapped, global_batch()[rank * 4 : rank * 4 + 4]))
    engine.detach()
    return {"norms": norms}
