"""DP-SGD with the Hugging Face `Trainer`: Poisson-sampled logical batches split into micro-batches, per-sample
losses from the model's logits, flashdp's clipping and noise, epsilon in the logs, the engine in checkpoints.

    from flashdp.integrations.transformers import DPTrainer, PrivacyArguments

    trainer = DPTrainer(
        model=model,
        args=TrainingArguments(output_dir="out", per_device_train_batch_size=16, max_grad_norm=1.0, ...),
        train_dataset=train,
        data_collator=collator,
        privacy=PrivacyArguments(expected_batch_size=256, target_epsilon=3.0, target_delta=1e-5),
    )
    trainer.train()

Needs `transformers` (not a dependency of flashdp).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import flashdp
from flashdp.data import count_users
from flashdp.engine import DPEngine
from flashdp.errors import FlashDPError
from flashdp.integrations import trainer_checks
from flashdp.integrations.shares import Piece, batch_size, first_row, rank_pieces, untouched_rng

#: the engine's state in a checkpoint folder, next to the model, optimizer and trainer state
ENGINE_STATE = "flashdp_engine.pt"


@dataclass(frozen=True)
class PrivacyArguments:
    """How DPTrainer makes training private.

    Args:
        expected_batch_size: the logical batch, in samples (all processes): each example is in a step's batch with
            probability `expected_batch_size / len(train_dataset)`. `per_device_train_batch_size` only bounds the
            micro-batches it is split into (memory).
        noise_multiplier: sigma. Or None, with target_epsilon: sigma is then calibrated for the run's steps.
        target_epsilon: spend at most this epsilon at `delta` over the whole run.
        delta: the delta of the guarantee (reported with epsilon in the logs); well below 1 / len(train_dataset).
        max_grad_norm: C, the per-sample clipping bound; default TrainingArguments.max_grad_norm.
        mode: as in `flashdp.make_private`.
        accountant: as in `flashdp.make_private`.
        clipping: as in `flashdp.make_private`.
        seed: as in `flashdp.make_private`; it also seeds the sampling.
        secure_rng: noise and sampling from the OS CSPRNG.
        user_column: user-level privacy: the column (or key of each example) holding its integer user id. Each step
            then samples USERS, `expected_batch_size` of them in expectation, with up to `examples_per_user` examples
            of each; a user's examples are clipped together (`engine.backward(loss, users=...)`), and epsilon is the
            users' (docs/guides/user-level.md).
        examples_per_user: k, with user_column.
    """

    expected_batch_size: int
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float | None = None
    mode: str = "bk"
    accountant: str = "pld"
    clipping: str = "flat"
    seed: int | None = None
    secure_rng: bool = False
    user_column: str | None = None
    examples_per_user: int | None = None


class DPTrainer(Trainer):
    """A `transformers.Trainer` that trains with DP-SGD (see the module docstring).

    What changes from Trainer: each optimizer step is one Poisson-sampled batch of `expected_batch_size` samples
    in expectation (possibly empty), split into micro-batches of `per_device_train_batch_size`; the loss is per
    sample (`per_sample_loss`); TrainingArguments.max_grad_norm bounds each sample's gradient, never the batch's;
    no gradient statistic computed before the noise is logged; `epsilon` is logged with the loss; checkpoints
    carry the engine's state, and `train(resume_from_checkpoint=...)` resumes the accounting.
    On several processes (`accelerate launch` or `torchrun`, DDP): every process receives the logical batch the
    main process sampled (`poisson_loader(..., shared_by=)`), takes every world_size-th row of it, and runs as many
    micro-batches as the others (a padding row through `engine.backward_padding` where it has no rows:
    `shares.py`); the engine, built on the DDP-wrapped model at the first step, sums the clipped gradients over the
    processes and adds the noise once.
    Refused: gradient_accumulation_steps > 1 (the logical batch is already sampled whole); on several processes,
    FSDP and DeepSpeed (not yet supported there).
    """

    def __init__(self, *args: Any, privacy: PrivacyArguments, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(privacy, PrivacyArguments):
            raise FlashDPError(f"privacy must be a PrivacyArguments. Received {type(privacy).__name__}.")
        self.privacy = privacy
        self.engine: DPEngine | None = None
        self._resume_dir: str | None = None
        if (privacy.user_column is None) != (privacy.examples_per_user is None):
            raise FlashDPError(
                "User-level privacy needs both PrivacyArguments.user_column and examples_per_user (the most examples "
                f"of one user in a step). Received user_column={privacy.user_column!r}, examples_per_user="
                f"{privacy.examples_per_user!r}."
            )
        self._users = None if privacy.user_column is None else _user_ids(self.train_dataset, privacy.user_column)
        self._check_arguments()

    def _check_arguments(self) -> None:
        """What DP-SGD cannot honour in these arguments, refused (`trainer_checks`); subclasses add theirs."""
        own_losses = type(self).per_sample_loss is DPTrainer.per_sample_loss
        trainer_checks.check_arguments(self, own_losses)

    @functools.cached_property
    def _units(self) -> int:
        """How many units are sampled from: the training samples, or the users (counted once)."""
        return len(self.train_dataset) if self._users is None else count_users(self._users)

    @property
    def sample_rate(self) -> float:
        return self.privacy.expected_batch_size / self._units

    # -- data ---------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """Poisson-sampled logical batches (sizes vary, empty ones included), one per optimizer step; with
        user_column, batches of sampled users, their ids in `batch[user_column]`."""
        dataset, column = self.train_dataset, self.privacy.user_column
        if _is_datasets_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        elif column is not None:
            dataset = _WithoutColumn(dataset, column)
        self._sampled_from = dataset
        return flashdp.poisson_loader(
            dataset,
            self.sample_rate,
            collate_fn=self.train_collator(),
            seed=self.privacy.seed,
            secure_rng=self.privacy.secure_rng,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            users=self._users,
            examples_per_user=self.privacy.examples_per_user,
            users_key=column,
            shared_by=torch.distributed.group.WORLD if self.args.world_size > 1 else None,
        )

    def train_collator(self) -> Any:
        """The collator of the training batches: Trainer's, whose rows are the units sampled (overridden where a
        unit spans several of its rows)."""
        return self.data_collator

    # -- the engine ---------------------------------------------------------------------------------------

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """Trainer's scheduler over the torch optimizer, which the engine steps; the engine itself at the first
        call on one process, once Trainer will not change the optimizer, and at the first step on several (on the
        model Trainer wrapped in DDP). (Trainer creates a scheduler again on every train().)"""
        torch_optimizer = optimizer or self._torch_optimizer()
        scheduler = super().create_scheduler(num_training_steps, torch_optimizer)
        if not any(isinstance(o, _EngineStep) for o in self._optimizer_chain()):
            self._training_steps = num_training_steps
            self.optimizer = _EngineStep(torch_optimizer, self)
            if self.args.world_size == 1:
                self._make_private(self.model)
        return scheduler

    def _optimizer_chain(self) -> list[Any]:
        """Trainer's optimizer and what it wraps (accelerate's wrapper, `_EngineStep`), down to the torch one."""
        chain = [self.optimizer]
        while getattr(chain[-1], "optimizer", None) is not None:
            chain.append(chain[-1].optimizer)
        return chain

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer_chain()[-1]

    def _make_private(self, model: nn.Module) -> None:
        """The engine, on `model` as Trainer trains it (DDP-wrapped on several processes)."""
        privacy, num_training_steps = self.privacy, self._training_steps
        self.engine = flashdp.make_private(
            model,
            mode=privacy.mode,
            max_grad_norm=privacy.max_grad_norm or self.args.max_grad_norm,
            noise_multiplier=privacy.noise_multiplier,
            target_epsilon=privacy.target_epsilon,
            target_delta=privacy.delta if privacy.target_epsilon is not None else None,
            steps=num_training_steps if privacy.target_epsilon is not None else None,
            optimizer=self._torch_optimizer(),
            expected_batch_size=privacy.expected_batch_size,
            sample_rate=self.sample_rate,
            clipping=privacy.clipping,
            accountant=privacy.accountant,
            seed=privacy.seed,
            secure_rng=privacy.secure_rng,
        )
        if self._resume_dir is not None:
            self.engine.load_state_dict(_load_engine_state(self._resume_dir))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise FlashDPError(f"No checkpoint to resume from in {self.args.output_dir}.")
        self._resume_dir = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    # -- one step -----------------------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        """One logical batch, through micro-batches. Returns this process's share of the batch's mean per-sample
        loss (its rows' losses over the batch's size, times the processes, which Trainer averages over): the mean
        loss of the batch once averaged, 0 for an empty batch."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self.engine is None:
            self._make_private(model)
        total = torch.zeros((), device=self.args.device)
        column = self.privacy.user_column
        for piece in self._pieces(inputs):
            if piece.rows == 0 and self.args.world_size == 1:
                self.engine.backward_empty()
                continue
            micro = dict(piece.inputs)
            micro_users = None if column is None else micro.pop(column)
            with self.compute_loss_context_manager():
                loss, micro_users = self.engine_losses(model, micro, micro_users)
            if piece.rows:
                self.engine.backward(loss, users=micro_users)
                total = total + loss.detach().sum()
            else:
                self.engine.backward_padding(loss, users=micro_users)
        return total * self.args.world_size / max(batch_size(inputs), 1)

    def _pieces(self, inputs: dict[str, Any]) -> Iterator[Piece]:
        """This process's micro-batches of the logical batch: on one process all of it (a user's rows together);
        on several, its share, as many micro-batches as every other process (`shares.rank_pieces`)."""
        size, world, column = self.args.per_device_train_batch_size, self.args.world_size, self.privacy.user_column
        if world > 1:
            padding = functools.partial(self._padding_row, inputs)
            yield from rank_pieces(inputs, self.args.process_index, world, size, padding, users_key=column)
            return
        users = None if column is None else inputs[column]
        for micro in flashdp.micro_batches(inputs, size, users=users):
            yield Piece(micro, batch_size(micro))

    def _padding_row(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The one-row batch a process without rows for a micro-batch runs through `engine.backward_padding`: the
        logical batch's first row, or the first training example where the logical batch is empty."""
        if batch_size(batch) > 0:
            return first_row(batch)
        with untouched_rng():  # (a collator that draws, as masked-LM ones do, must not shift this process's draws)
            row = self._prepare_inputs(self.train_collator()([self._sampled_from[0]]))
        column = self.privacy.user_column
        return row if column is None else {**row, column: torch.zeros(1, dtype=torch.long, device=self.args.device)}

    def engine_losses(
        self, model: nn.Module, inputs: dict[str, Any], users: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """What the engine clips from one micro-batch: one loss per row of the model's forward and each row's user
        (None: each row is a unit). Here `per_sample_loss` and the batch's users; a trainer whose unit spans several
        forward rows (a preference pair) overrides it."""
        return self.per_sample_loss(model, inputs), users

    def per_sample_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
        """`[B]` losses, one per sample, from the model's logits and `inputs["labels"]`: the next-token loss of a
        causal LM (labels shifted, -100 ignored), a token-level loss averaged over each sample's labelled tokens,
        cross entropy for classification, mean squared error for regression (one output). Override for others."""
        if "labels" not in inputs:
            raise FlashDPError(
                f"DPTrainer computes per-sample losses from inputs['labels']; the batch has {sorted(inputs)}. Add "
                "labels (a collator such as DataCollatorForLanguageModeling does) or override per_sample_loss."
            )
        labels = inputs["labels"]
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        if logits.dim() == 3 and labels.shape == logits.shape[:2]:
            return flashdp.per_sample_lm_loss(logits, labels, shift=_is_causal_lm(self.accelerator.unwrap_model(model)))
        if logits.dim() == 2 and labels.shape == logits.shape[:1]:
            if logits.shape[1] == 1 and labels.is_floating_point():
                return (logits[:, 0].float() - labels.float()).pow(2)
            return nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        raise FlashDPError(
            f"DPTrainer cannot tell how logits {tuple(logits.shape)} and labels {tuple(labels.shape)} make one loss "
            "per sample: override DPTrainer.per_sample_loss(model, inputs) to return a [B] tensor."
        )

    # -- what Trainer does around the step ------------------------------------------------------------------

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """No clipping of the batch gradient: each sample's was clipped by the engine."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Not logged: before the noise, the gradient's norm is a statistic of the private data."""
        return None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.engine is not None and "loss" in logs:
            logs["epsilon"] = self.engine.epsilon(self.privacy.delta)
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and self.engine is not None:
            torch.save(self.engine.state_dict(), os.path.join(folder, ENGINE_STATE))


class _EngineStep:
    """The optimizer as Trainer sees it: `step()` is the engine's DP-SGD step (noise, averaging, the optimizer's
    step and zero_grad, the accountant); everything else is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: DPTrainer) -> None:
        self.optimizer, self._trainer = optimizer, trainer

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise FlashDPError("DPTrainer's optimizer step takes no closure.")
        self._trainer.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _WithoutColumn(torch.utils.data.Dataset):
    """A dataset of mapping examples without one key (the user ids, which the collator should not see)."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.dataset, self.column = dataset, column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return {k: v for k, v in self.dataset[index].items() if k != self.column}


def _user_ids(dataset: Any, column: str) -> Tensor:
    """`[N]` the user id of each example, from a `datasets.Dataset` column or each mapping example's key."""
    if dataset is None or not hasattr(dataset, "__len__"):
        raise FlashDPError("DPTrainer needs a train_dataset with a length (Poisson sampling draws from it).")
    first = dataset[0] if len(dataset) else {}
    if not (isinstance(first, dict) and column in first):
        raise FlashDPError(
            f"PrivacyArguments.user_column={column!r}: the training examples have no such column (the first has "
            f"{sorted(first) if isinstance(first, dict) else type(first).__name__})."
        )
    by_column = _is_datasets_dataset(dataset)  # (a column read at once, not row by row)
    ids = list(dataset[column]) if by_column else [dataset[i][column] for i in range(len(dataset))]
    bad = next((i for i, u in enumerate(ids) if not _is_integer(u)), None)
    if bad is not None:
        raise FlashDPError(
            f"PrivacyArguments.user_column={column!r} must hold one integer user id per example; example {bad} has "
            f"{type(ids[bad]).__name__} {getattr(ids[bad], 'shape', ids[bad])!s:.60}."
        )
    return torch.tensor([int(u) for u in ids], dtype=torch.long, device="cpu")


def _is_integer(value: object) -> bool:
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point()
    return isinstance(value, int) and not isinstance(value, bool)


def _load_engine_state(folder: str) -> dict:
    path = os.path.join(folder, ENGINE_STATE)
    if not os.path.isfile(path):
        raise FlashDPError(
            f"Cannot resume from {folder}: it has no {ENGINE_STATE} (it was not saved by DPTrainer), so the privacy "
            "already spent is unknown. Resume from a DPTrainer checkpoint."
        )
    return torch.load(path, weights_only=True)


def _is_causal_lm(model: nn.Module) -> bool:
    """An HF causal LM (or a PEFT model of one): its labels are its inputs, predicted one position ahead."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    return type(base).__name__ in names or type(base).__name__.endswith("ForCausalLM")


def _is_datasets_dataset(dataset: object) -> bool:
    return type(dataset).__module__.startswith("datasets.")
