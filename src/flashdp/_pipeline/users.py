"""User-level clipping: the rows of one backward grouped by the user they belong to.

With `engine.backward(loss, users=ids)` the clipped unit is a user's gradient in the step, `g_u = sum_{i in u}
g_i`. Everything up to a parameter's per-sample contributions is per row, as without users; `UserGroups` then
sums each user's rows exactly, in the form the contributions come in:

- materialised per-sample gradients `[B, ...]` are summed per user (`index_add`): `[U, ...]`;
- outer-product blocks `g_i = sum_t left[i, t] ⊗ right[i, t]` are regrouped: a user's rows are concatenated
  along positions (zero-padded to the most rows any user has), so that `g_u = sum_{t'} left'[u, t'] ⊗
  right'[u, t']` and every norm of a block (ghost, direct, tokens) and its clipped sum hold per user unchanged.

The norms and the bk clipped-sum plans are then per user; a second backward (ghost, flash) weights each row's
loss by its user's coefficient (`per_row`). Users are numbered by first appearance in the batch, so distinct ids
in any order give one row per user, and nothing is regrouped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashdp.errors import FlashDPError
from flashdp.per_sample import OuterGrad, TokenRows


@dataclass(frozen=True)
class UserGroups:
    """The users of one backward's B rows, numbered 0..U-1 by first appearance.

    index: `[B]` each row's user (on the loss's device). members: `[U, K]` each user's rows in batch order,
    padded with B (K = the most rows any user has). ids: `[U]` the users' ids (on the CPU). partition: each row's
    user number on the host, or () where every user has one row: which rows may mix, what a verified layout of a
    user-level step rests on besides the layers' sizes."""

    index: Tensor
    members: Tensor
    ids: Tensor
    partition: tuple[int, ...] = ()

    @staticmethod
    def of(users: object, batch: int, device: torch.device) -> UserGroups:
        """The groups of `users`, checked: a 1-D integer tensor with one id per row of the loss."""
        ids = _checked_ids(users, batch)
        if batch == 0:
            empty = torch.zeros(0, dtype=torch.long, device="cpu")
            return UserGroups(empty.to(device), empty.view(0, 0), empty)
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.arange(batch, device="cpu")
        first = torch.full((len(unique),), batch, device="cpu").scatter_reduce_(0, inverse, rows, "amin")
        order = first.argsort()  # the unique ids in order of first appearance
        number = torch.empty_like(order)
        number[order] = torch.arange(len(order), device="cpu")
        index = number[inverse]
        counts = torch.bincount(index, minlength=len(order))
        by_user = index.argsort(stable=True)
        starts = counts.cumsum(0) - counts
        position = rows - starts[index[by_user]]
        members = torch.full((len(order), int(counts.max())), batch, device="cpu")
        members[index[by_user], position] = by_user
        partition = tuple(index.tolist()) if members.shape[1] > 1 else ()
        return UserGroups(index.to(device), members.to(device), unique[order], partition)

    @property
    def count(self) -> int:
        """U, the number of users."""
        return self.members.shape[0]

    @property
    def batch(self) -> int:
        return self.index.shape[0]

    @property
    def one_row_each(self) -> bool:
        """Every user has one row, in batch order: user u is row u, nothing to regroup."""
        return self.members.shape[1] <= 1

    def rows_of(self, user: int) -> list[int]:
        """The batch rows of user number `user`."""
        return [r for r in self.members[user].tolist() if r < self.batch]

    def named(self, user: int) -> str:
        """User number `user` as the messages name it: its id and its batch rows."""
        return f"{int(self.ids[user])} (rows {self.rows_of(user)})"

    def per_row(self, values: Tensor) -> Tensor:
        """`[..., B]` each row's value from `[..., U]` per-user values (its user's)."""
        return values if self.one_row_each else values[..., self.index]

    def sum_rows(self, per_sample: Tensor) -> Tensor:
        """`[U, ...]` each user's sum of materialised per-row gradients `[B, ...]`."""
        if self.one_row_each:
            return per_sample
        out = per_sample.new_zeros(self.count, *per_sample.shape[1:])
        return out.index_add_(0, self.index, per_sample)

    def regroup(self, block: OuterGrad) -> OuterGrad:
        """The block with each user's rows concatenated along positions: `[U * g, K * T, ...]` (g convolution
        groups; zero rows where a user has fewer than K rows), whose outer products are the users' gradients."""
        if self.one_row_each:
            return block
        if block.is_tokens:  # (a padded position's id is 0: its right factor is zero, so it adds nothing)
            ids = self._gather(block.left.ids, block.conv_groups, fill=0)
            left: Tensor | TokenRows = TokenRows(ids, block.left.num_rows)
        else:
            left = self._gather(block.left, block.conv_groups, fill=0)
        return OuterGrad(left, self._gather(block.right, block.conv_groups, fill=0), block.conv_groups)

    def _gather(self, rows: Tensor, groups: int, fill: int) -> Tensor:
        """`[B * g, T, ...]` row-major by sample -> `[U * g, K * T, ...]`, each user's rows along T."""
        per_sample = rows.view(self.batch, groups, *rows.shape[1:])
        padding = per_sample.new_full((1, *per_sample.shape[1:]), fill)
        gathered = torch.cat([per_sample, padding])[self.members]  # [U, K, g, T, ...]
        gathered = gathered.transpose(1, 2)  # [U, g, K, T, ...]
        u, g, k, t = gathered.shape[:4]
        return gathered.reshape(u * g, k * t, *gathered.shape[4:])


class UserLedger:
    """The privacy unit of an engine's backwards (rows, or users: fixed at the first backward, the same on every
    rank) and the users clipped since the last step on every rank. A user's gradient is clipped as a whole only if
    all of the user's rows of a step are in ONE backward on ONE rank: a user seen twice in a step is refused."""

    def __init__(self) -> None:
        self.by_user: bool | None = None
        self._seen: set[int] = set()

    @property
    def unit(self) -> str | None:
        """ "user" or "sample" once the first backward fixed it (what a checkpoint records), else None."""
        return None if self.by_user is None else ("user" if self.by_user else "sample")

    def resume(self, state: object, load: Callable[[], None]) -> None:
        """Run `load()` (a checkpoint's other parts) if the checkpoint's unit (`state["unit"]`, None before its
        run's first backward) agrees with this engine's, then clip by it: one run has one privacy unit, which its
        epsilon describes."""
        unit = state.get("unit") if isinstance(state, dict) else None
        if unit not in (None, "user", "sample"):
            raise FlashDPError(f"Cannot resume: the checkpoint's unit is not one flashdp wrote. Received {unit!r}.")
        if unit is not None and self.unit is not None and unit != self.unit:
            raise FlashDPError(
                f"Cannot resume: the checkpoint's run clipped by {unit}, this engine by {self.unit}; one run has one "
                "privacy unit, which its epsilon describes. Nothing was loaded."
            )
        load()
        if unit is not None:
            self.by_user = unit == "user"

    def agree_unit(self, some: bool, not_all: bool) -> None:
        """On the engine's first backward, its unit, from whether any rank gave users= (`some`) and any did not
        (`not_all`), as every rank agreed."""
        if self.by_user is not None:
            return
        if some and not_all:
            raise FlashDPError(
                "engine.backward was given users= on some ranks and not on others: every rank must clip by the same "
                "unit. Pass users= on every rank (an empty tensor on a rank without rows)."
            )
        self.by_user = some

    def check(self, groups: UserGroups | None, dp_group: dist.ProcessGroup | None) -> frozenset[int]:
        """Check one backward's users (None: a backward by rows) against the unit (`agree_unit`) and the step so
        far; returns the users of every rank in it, for `clipped` once the backward has added them."""
        error = self.unit_changed(groups)
        if error is not None:
            raise error
        if groups is None:
            return frozenset()
        ranks = [groups.ids.tolist()]
        if dp_group is not None:
            ranks = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(ranks, groups.ids.tolist(), group=dp_group)
        every = Counter(u for ids in ranks for u in ids)  # (a rank's ids are distinct: a count of 2 is 2 ranks)
        repeated = sorted(u for u, count in every.items() if count > 1 or u in self._seen)
        if repeated:
            raise _split_user_error(repeated, len(ranks))
        return frozenset(every)

    def unit_changed(self, groups: UserGroups | None) -> FlashDPError | None:
        """The refusal of a backward by another unit than the engine's (None before its first backward)."""
        if self.by_user is None or self.by_user == (groups is not None):
            return None
        return FlashDPError(
            "This engine clips by "
            + ("user (engine.backward(loss, users=ids))" if self.by_user else "sample (engine.backward(loss))")
            + " since its first backward; one run has one privacy unit, which its epsilon describes. Pass "
            + ("users= on every backward." if self.by_user else "no users= (or build another engine).")
        )

    def clipped(self, users: frozenset[int]) -> None:
        """A backward added these users' clipped gradients to the step."""
        self._seen |= users

    def step_taken(self) -> None:
        self._seen.clear()


def _split_user_error(users: list[int], world: int) -> FlashDPError:
    where = "several backward calls or ranks" if world > 1 else "several backward calls"
    return FlashDPError(
        f"User(s) {users[:10]} have rows in {where} of one step: a user's gradient is clipped as a whole only "
        "when all of the user's rows of the step are in one backward on one rank. Nothing was added to .grad by "
        "this backward (earlier ones of the step were). Keep each user's rows together: split micro-batches at user "
        "boundaries (flashdp.micro_batches(batch, size, users=ids)) and shard users, not rows, across ranks "
        "(engine.data_loader(dataset, users=...) does both)."
    )


def holds_integers(ids: Tensor) -> bool:
    """Whether a tensor's dtype is an integer one (not floating, complex or bool): what user ids must be."""
    return not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)


def _checked_ids(users: object, batch: int) -> Tensor:
    """`[B]` int64 ids on the CPU (one device sync for ids on a GPU)."""
    if not isinstance(users, Tensor):
        raise FlashDPError(
            f"users= expects a 1-D integer tensor with the user id of each row of the loss. Received "
            f"{type(users).__name__}; e.g. torch.as_tensor(batch['user_id'])."
        )
    if users.is_meta:
        raise FlashDPError("users= must hold the user ids' values. Received a tensor on the meta device.")
    if users.dim() != 1 or users.shape[0] != batch:
        raise FlashDPError(
            f"Wrong shape: users= must be 1-D with one id per row of the loss ({batch}). Received shape "
            f"{tuple(users.shape)}."
        )
    if not holds_integers(users):
        raise FlashDPError(
            f"users= must hold integer ids. Received dtype {users.dtype}: map user names to integers first."
        )
    return users.detach().to("cpu", torch.long)
