"""Poisson sampling for DP-SGD, and splitting one large logical batch into bounded micro-batches."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from flashdp._checks import is_int
from flashdp._pipeline.users import holds_integers
from flashdp.errors import FlashDPError
from flashdp.privacy import csprng, keyed
from flashdp.privacy.settings import check_sample_rate

#: how far apart the seeds of two epochs are (an odd constant: the golden ratio in 64 bits)
_EPOCH_STRIDE = 0x9E3779B97F4A7C15
#: how far apart the seeds of `engine.data_loader`s made one step apart are (another odd 64-bit constant)
LOADER_STRIDE = 0xD1B54A32D192ED03


class PoissonSampler(Sampler[list[int]]):
    """Batches of indices in which every example is included independently with probability `sample_rate`.

    Batch sizes vary (and may be 0), as the privacy analysis of Poisson-subsampled DP-SGD requires. With
    `world_size > 1` each rank samples only its own shard (indices `rank::world_size`) with the same rate, so the
    union over ranks is one Poisson sample of the whole dataset.

    Args:
        num_samples: size of the dataset.
        sample_rate: q in (0, 1].
        steps: batches per iteration; default one epoch in expectation, `ceil(1 / q)`.
        seed: seeds the sampling (reproducible, NOT private); default OS entropy.
        secure_rng: draw from the OS CSPRNG instead (not reproducible).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        steps: int | None = None,
        seed: int | None = None,
        secure_rng: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if sample_rate is None:
            raise FlashDPError("sample_rate, the Poisson sampling probability q in (0, 1], is required. Received None.")
        check_sample_rate(sample_rate)
        if steps is not None and not (is_int(steps) and steps > 0):
            raise FlashDPError(f"steps (batches per pass over the loader) must be a positive int. Received {steps!r}.")
        if not 0 <= rank < world_size:
            raise FlashDPError(f"rank must be in [0, world_size). Received rank={rank}, world_size={world_size}.")
        if secure_rng and seed is not None:
            raise FlashDPError("secure_rng=True samples from the OS CSPRNG and cannot be seeded; pass seed=None.")
        self.indices = torch.arange(rank, num_samples, world_size, device="cpu")
        self.sample_rate = sample_rate
        self.steps = steps if steps is not None else math.ceil(1 / sample_rate)
        self.secure_rng = secure_rng
        self._seed = None if seed is None else seed + rank
        self._key = keyed.secret_key() if seed is None else None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch `epoch`'s batches from then on: a function of the seed and the epoch alone, so that a run
        resumed at a later epoch draws what the uninterrupted run drew (HF Trainer calls it at every epoch; epoch 0
        is the stream a new sampler starts with). Without calls, epochs continue one stream. Unseeded, the
        generator's whole state comes from a secret key (who knows the batches loses the subsampling's
        amplification; a seed from OS entropy would keep 32 bits)."""
        if self._key is not None:
            self.generator = keyed.keyed_generator(self._key, epoch, torch.device("cpu"))
        else:
            self.generator = torch.Generator().manual_seed((self._seed + epoch * _EPOCH_STRIDE) % 2**63)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            yield self.indices[self._uniform(len(self.indices)) < self.sample_rate].tolist()

    def _uniform(self, count: int) -> torch.Tensor:
        if self.secure_rng:
            return csprng.uniform(count)
        return torch.rand(count, generator=self.generator, dtype=torch.float64, device="cpu")


class SharedBatches(Sampler[list[int]]):
    """Every rank of `group` iterates the batches its first rank draws from `sampler` (one broadcast per batch):
    one logical batch for processes that each take a share of it, whatever generator drew it (the OS CSPRNG
    cannot be seeded alike on every rank). Call it on every rank of the group, as many batches on each."""

    def __init__(self, sampler: Sampler[list[int]], group: dist.ProcessGroup | None = None) -> None:
        self.sampler, self.group = sampler, group
        self.source = dist.get_global_rank(group, 0) if group is not None else 0

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        drawn = iter(self.sampler) if dist.get_rank() == self.source else None
        for _ in range(len(self.sampler)):
            batch = [next(drawn) if drawn is not None else None]
            dist.broadcast_object_list(batch, src=self.source, group=self.group)
            yield batch[0]


class UserPoissonSampler(Sampler[list[int]]):
    """User-level Poisson sampling: each step includes every USER independently with probability `sample_rate`,
    and of each included user up to `examples_per_user` of their examples (all if fewer, else that many drawn
    uniformly without replacement). The accountant's sample rate is then the users' rate; a user's clipped
    gradient has sensitivity C whatever k is (`engine.backward(loss, users=...)`).

    With `world_size > 1` each rank samples only its own users (every `world_size`-th of the ids in sorted order):
    a user's examples never sit on two ranks. Batches list a user's examples together.

    Args:
        users: the user id of each example of the dataset, `[N]`.
        sample_rate: q in (0, 1], per user.
        examples_per_user: k >= 1, the most examples one user contributes to a step.
        steps: as `PoissonSampler`.
        seed: as `PoissonSampler` (each rank seeds with `seed + rank`).
        secure_rng: as `PoissonSampler`.
        rank: this rank, in [0, world_size).
        world_size: the ranks users are spread over.
    """

    def __init__(
        self,
        users: Sequence[int] | torch.Tensor,
        sample_rate: float,
        examples_per_user: int,
        *,
        steps: int | None = None,
        seed: int | None = None,
        secure_rng: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if isinstance(examples_per_user, bool) or not (isinstance(examples_per_user, int) and examples_per_user >= 1):
            raise FlashDPError(f"examples_per_user must be an integer >= 1. Received {examples_per_user!r}.")
        ids = torch.as_tensor(users, device="cpu")
        if not holds_integers(ids):
            raise FlashDPError(
                f"users must hold integer user ids. Received dtype {ids.dtype}: map user names to integers first."
            )
        ids = ids.to(torch.long).flatten()
        unique, inverse = torch.unique(ids, return_inverse=True)
        mine = torch.arange(rank, len(unique), world_size, device="cpu")
        self.examples = [(inverse == u).nonzero().flatten() for u in mine.tolist()]
        self.users = unique[mine]
        self.examples_per_user = examples_per_user
        seed = None if seed is None else seed + rank  # (its own users: not a shard of a PoissonSampler's indices)
        self._users_sampler = PoissonSampler(len(mine), sample_rate, steps=steps, seed=seed, secure_rng=secure_rng)

    @property
    def num_users(self) -> int:
        """Users this rank samples from."""
        return len(self.users)

    @property
    def sample_rate(self) -> float:
        """The users' rate (an engine's loader follows a rate set on its engine)."""
        return self._users_sampler.sample_rate

    @sample_rate.setter
    def sample_rate(self, q: float) -> None:
        self._users_sampler.sample_rate = q

    def __len__(self) -> int:
        return len(self._users_sampler)

    def set_epoch(self, epoch: int) -> None:
        """As `PoissonSampler.set_epoch` (the users drawn and their examples)."""
        self._users_sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        for chosen in self._users_sampler:
            yield [i for user in chosen for i in self._some_examples(self.examples[user])]

    def _some_examples(self, examples: torch.Tensor) -> list[int]:
        k = self.examples_per_user
        if len(examples) <= k:
            return examples.tolist()
        keys = self._users_sampler._uniform(len(examples))  # (a uniform random subset: the k smallest keys)
        return examples[keys.argsort()[:k].sort().values].tolist()


class EmptyBatchCollate:
    """Wraps a collate function so that an empty batch gives the same structure with a leading dim of 0."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any] = default_collate) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> Any:
        if samples:
            return self.collate_fn(samples)
        return _map_tensors(self.collate_fn([self.dataset[0]]), lambda t: t[:0])


class _WithUsers(Dataset):
    """`(example, user id)` pairs."""

    def __init__(self, dataset: Dataset, users: torch.Tensor) -> None:
        self.dataset, self.users = dataset, users

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.dataset[index], int(self.users[index])


class _UsersCollate:
    """Collates `(example, user id)` pairs into `(batch, users [B])`, or with `key` into the (mapping) batch with
    `batch[key] = users`."""

    def __init__(self, collate_fn: Callable[[list], Any], key: str | None) -> None:
        self.collate_fn, self.key = collate_fn, key

    def __call__(self, pairs: list) -> Any:
        batch = self.collate_fn([example for example, _ in pairs])
        users = torch.tensor([u for _, u in pairs], dtype=torch.long, device="cpu")
        if self.key is None:
            return batch, users
        if not isinstance(batch, Mapping):
            raise FlashDPError(f"users_key={self.key!r} puts the user ids into a mapping batch; the collate function "
                               f"returned {type(batch).__name__}.")  # fmt: skip
        batch[self.key] = users
        return batch


def check_loader_rate(
    sample_rate: float | None, expected_batch_size: int | None, size: int, counted: str = "len(dataset)"
) -> None:
    """An engine's loader samples at its `sample_rate`, which must agree with the `expected_batch_size` it averages
    by over `size` units: the dataset's records, or its users (`counted`: what `size` is, for the message)."""
    if sample_rate is None:
        raise FlashDPError("engine.data_loader() samples at the engine's rate: make_private(..., sample_rate=q).")
    expected = sample_rate * size
    if expected_batch_size is not None and abs(expected - expected_batch_size) > max(1.0, 0.01 * expected_batch_size):
        if expected_batch_size > size:
            raise FlashDPError(
                f"expected_batch_size={expected_batch_size} exceeds {counted} ({size}): a step cannot sample more "
                f"than all of them. Give make_private expected_batch_size=sample_rate * {counted}, at most {size}."
            )
        raise FlashDPError(
            f"sample_rate * {counted} = {sample_rate} * {size} = {expected:.1f}, but the engine averages by "
            f"expected_batch_size={expected_batch_size}. Give make_private expected_batch_size={round(expected)} "
            f"(or sample_rate={expected_batch_size / size:.6g})."
        )


def poisson_loader(
    dataset: Dataset,
    sample_rate: float,
    *,
    collate_fn: Callable[[list], Any] = default_collate,
    steps: int | None = None,
    seed: int | None = None,
    secure_rng: bool = False,
    rank: int = 0,
    world_size: int = 1,
    users: Sequence[int] | torch.Tensor | None = None,
    examples_per_user: int | None = None,
    users_key: str | None = None,
    shared_by: dist.ProcessGroup | None = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader of Poisson-sampled batches (see `PoissonSampler`); empty batches keep their structure.

    Give the engine the same rate: `make_private(..., sample_rate=sample_rate,
    expected_batch_size=round(sample_rate * len(dataset)))`.

    With `users` (the user id of each example) and `examples_per_user` k, users are sampled instead
    (`UserPoissonSampler`) and the loader yields `(batch, users)`, `users` `[B]` the ids to give
    `engine.backward(loss, users=users)` (with `users_key`, mapping batches that hold them as `batch[users_key]`).
    Then `expected_batch_size` is `sample_rate` times the number of users.

    With `shared_by` (a process group, or `dist.group.WORLD`), every rank of the group yields the batches its first
    rank samples (`SharedBatches`): for processes that split each logical batch among themselves, as DPTrainer
    does; needed with `secure_rng`, whose draws no seed makes equal on every rank.
    """
    if len(dataset) == 0:
        raise FlashDPError("poisson_loader: the dataset is empty.")
    if users is None and examples_per_user is not None:
        raise FlashDPError(
            "examples_per_user bounds each user's examples in a step: give users= too (the user id of each "
            "example), or leave examples_per_user out."
        )
    spread = {"steps": steps, "seed": seed, "secure_rng": secure_rng, "rank": rank, "world_size": world_size}
    if users is None:
        sampler: Sampler[list[int]] = PoissonSampler(len(dataset), sample_rate, **spread)
    else:
        users = _checked_users(users, len(dataset), examples_per_user)
        sampler = UserPoissonSampler(users, sample_rate, examples_per_user, **spread)
        dataset, collate_fn = _WithUsers(dataset, users), _UsersCollate(collate_fn, users_key)
    if shared_by is not None:
        sampler = SharedBatches(sampler, None if shared_by is dist.group.WORLD else shared_by)
    return PoissonLoader(
        dataset, batch_sampler=sampler, collate_fn=EmptyBatchCollate(dataset, collate_fn), **loader_kwargs
    )


class PoissonLoader(DataLoader):
    """A DataLoader over a Poisson batch sampler, with the sampler's `set_epoch` (HF Trainer calls the loader's)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def count_users(users: Sequence[int] | torch.Tensor) -> int:
    """The number of distinct users."""
    return len(torch.unique(torch.as_tensor(users, device="cpu")))


def _checked_users(users: Sequence[int] | torch.Tensor, size: int, examples_per_user: int | None) -> torch.Tensor:
    ids = torch.as_tensor(users, device="cpu")
    if ids.shape != (size,) or not holds_integers(ids):
        raise FlashDPError(
            f"users must hold one integer user id per example of the dataset ({size}). Received "
            f"{ids.dtype} of shape {tuple(ids.shape)}."
        )
    if examples_per_user is None:
        raise FlashDPError(
            "Sampling users needs examples_per_user=k, the most examples one user contributes to a step (the "
            "sensitivity is C whatever k is; a larger k uses more of each sampled user's data per step)."
        )
    return ids.to("cpu", torch.long)


def micro_batches(
    batch: Any, max_size: int, *, group: dist.ProcessGroup | None = None, users: torch.Tensor | None = None
) -> Iterator[Any]:
    """Split a batch (a tensor, or tuples / lists / dicts of tensors sharing the leading dim) into pieces of at
    most `max_size` samples, so memory stays bounded whatever size the Poisson sampler drew. An empty batch
    yields itself once, so that `engine.backward` still runs before `engine.step`.

    group: under FSDP, whose forward and backward run collectives, every rank must run as many micro-batches as
    the others; with the data-parallel group here, ranks that drew fewer samples add empty micro-batches (one
    all-reduce of the count). Call it on every rank of the group then.
    users: `[B]` the user of each row (user-level clipping, `engine.backward(loss, users=...)`): every user's rows
    go into ONE piece, users packed in order of first appearance (a user's rows in batch order). Include the ids in
    `batch` to receive each piece's ids with it. A user with more than `max_size` rows is refused.
    """
    if max_size < 1:
        raise FlashDPError(f"max_size must be at least 1. Received {max_size!r}.")
    sizes = {t.shape[0] for t in _tensors(batch)}
    if len(sizes) != 1:
        raise FlashDPError(
            f"micro_batches: every tensor of the batch must share the leading (batch) dim. Received sizes {sizes}."
        )
    size = sizes.pop()
    rows = None if users is None else _user_pieces(users, size, max_size)
    pieces = max(1, -(-size // max_size) if rows is None else len(rows))
    if group is not None:
        nccl = dist.get_backend(group) == "nccl"
        count = torch.tensor([pieces], dtype=torch.int64, device="cuda" if nccl else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        pieces = int(count.item())
    for piece in range(pieces):  # past the end, slices are empty
        if rows is None:
            yield _map_tensors(batch, lambda t, s=piece * max_size: t[s : s + max_size])
        else:
            yield _map_tensors(batch, lambda t, p=piece: t[rows[p].to(t.device)] if p < len(rows) else t[:0])


def _user_pieces(users: torch.Tensor, size: int, max_size: int) -> list[torch.Tensor]:
    """Row indices of each piece: whole users, packed in order of first appearance, at most `max_size` rows."""
    tensor = isinstance(users, torch.Tensor)
    if not (tensor and users.shape == (size,) and holds_integers(users)):
        got = f"{users.dtype} of shape {tuple(users.shape)}" if tensor else type(users).__name__
        raise FlashDPError(
            f"micro_batches: users must be an integer tensor of shape ({size},), one id per row. Received {got}."
        )
    by_user: dict[int, list[int]] = {}
    for row, user in enumerate(users.tolist()):
        by_user.setdefault(user, []).append(row)
    pieces: list[list[int]] = [[]]
    for user, rows in by_user.items():
        if len(rows) > max_size:
            raise FlashDPError(
                f"micro_batches: user {user} has {len(rows)} rows, more than max_size={max_size}, and a user's rows "
                "must be clipped in one backward. Raise max_size, or sample at most max_size examples per user "
                "(engine.data_loader(..., examples_per_user=k))."
            )
        if len(pieces[-1]) + len(rows) > max_size:
            pieces.append([])
        pieces[-1].extend(rows)
    return [torch.tensor(rows, dtype=torch.long, device="cpu") for rows in pieces if rows]


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return [t for v in batch for t in _tensors(v)]
    return []


def _map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):  # dict, or a Mapping such as HF's BatchEncoding (a UserDict)
        return type(batch)({k: _map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch
