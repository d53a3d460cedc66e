"""DP-SGD with TRL: `DPSFTTrainer` (supervised fine-tuning) and `DPDPOTrainer` (preference optimisation, below).

`DPSFTTrainer` is TRL's `SFTTrainer` (its dataset preparation:
tokenizing, chat templates, completion-only and assistant-only label masks, PEFT) with DPTrainer's training
(Poisson-sampled logical batches, per-sample losses, clipping and noise, epsilon in the logs, several processes).

    from flashdp.integrations.trl import DPSFTTrainer
    from flashdp.integrations.transformers import PrivacyArguments

    trainer = DPSFTTrainer(
        model=model,
        args=SFTConfig(output_dir="out", per_device_train_batch_size=8, max_grad_norm=1.0),
        train_dataset=dataset,  # "prompt" / "completion", "messages" or "text" records
        processing_class=tokenizer,
        privacy=PrivacyArguments(expected_batch_size=64, target_epsilon=8.0),
    )
    trainer.train()

The privacy unit is one record of the training set. Each record's loss is the mean next-token loss over its
labelled tokens (the completion only, by default for prompt-completion records, as TRL's own loss for a batch of
one). Refused: `packing=True` and `padding_free=True`, which put several records in one row (their gradients could
no longer be told apart, so no record's would be clipped); `activation_offloading=True`; settings of a loss
DPTrainer does not compute (`loss_type` other than "nll", label smoothing, `compute_loss_func`, the router's
auxiliary loss), unless `per_sample_loss` is overridden. Needs `trl` (not a dependency of flashdp).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from trl import DPOTrainer, SFTTrainer

import flashdp
from flashdp.errors import FlashDPError
from flashdp.integrations import trainer_checks
from flashdp.integrations.transformers import DPTrainer


class DPSFTTrainer(DPTrainer, SFTTrainer):
    """TRL's `SFTTrainer` trained with DP-SGD (see the module docstring); arguments as SFTTrainer's, plus
    `privacy=PrivacyArguments(...)`."""

    def _check_arguments(self) -> None:
        for option in ("packing", "padding_free"):
            if getattr(self.args, option, False):
                raise FlashDPError(
                    f"SFTConfig({option}=True) puts several training records in one row, so their gradients cannot "
                    "be told apart and no record's would be clipped: DP-SGD would not bound what one record changes. "
                    f"Set {option}=False (each row one record, padded), or make the privacy unit the row by packing "
                    "the dataset yourself before training, one packed row per record."
                )
        if getattr(self.args, "activation_offloading", False):
            raise FlashDPError(
                "SFTConfig(activation_offloading=True) is not supported by DPSFTTrainer: its training step replaces "
                "SFTTrainer's, which offloads. Set activation_offloading=False (gradient checkpointing works)."
            )
        super()._check_arguments()


#: TRL's DPO losses that are a function of each pair alone (the others sort or average over the batch)
PAIR_LOSSES = ("sigmoid", "hinge", "ipo")


class DPDPOTrainer(DPTrainer, DPOTrainer):
    """TRL's `DPOTrainer` trained with DP-SGD; arguments as DPOTrainer's, plus `privacy=PrivacyArguments(...)`.

    The privacy unit is one preference record (a prompt with its chosen and rejected completions): its two rows
    are clipped together as one user of the engine (their loss mixes them; no other record's rows enter it), and
    Poisson sampling draws records. Each record's loss is TRL's for a batch of one: `loss_type` "sigmoid" (DPO),
    "hinge" or "ipo" (several, weighted by `loss_weights`), on the completion tokens' summed log-probabilities
    against the reference model's (computed as TRL does, or precomputed). Refused: loss types that sort or
    average over the batch, `f_divergence_type` other than "reverse_kl", `ld_alpha`, `use_weighting`,
    `padding_free`, Liger kernels, `activation_offloading`, and a router's auxiliary loss (a model with a router and
    `router_aux_loss_coef` other than 0: set it to 0). With `PrivacyArguments.user_column`, a user's
    records are clipped together.
    """

    def _check_arguments(self) -> None:
        args = self.args
        unsupported = {
            "loss_type": [t for t in args.loss_type if t not in PAIR_LOSSES],
            "f_divergence_type": args.f_divergence_type != "reverse_kl",
            "ld_alpha": args.ld_alpha is not None,
            "use_weighting": args.use_weighting,
            "padding_free": getattr(args, "padding_free", False),
            "use_liger_kernel": getattr(args, "use_liger_kernel", False),
            "activation_offloading": getattr(args, "activation_offloading", False),
            # (TRL adds the router's loss wherever the model has one and router_aux_loss_coef != 0)
            "router_aux_loss_coef": getattr(self, "aux_loss_enabled", False),
        }
        if any(unsupported.values()):
            names = ", ".join(name for name, on in unsupported.items() if on)
            raise FlashDPError(
                f"DPDPOTrainer computes each preference record's loss alone, as TRL does for a batch of one with "
                f"loss_type in {PAIR_LOSSES}, reverse-KL scores, no length or weighting terms, one record per row "
                f"pair: these settings are not supported: {names}. (Loss types that sort or average over the batch, "
                "and a router's auxiliary loss, mix records, so no record's gradient could be clipped alone: for a "
                "model with a router, set router_aux_loss_coef=0.)"
            )
        trainer_checks.check_arguments(self, own_losses=False)

    def train_collator(self) -> Any:
        return _PairRows(self.data_collator)

    def engine_losses(
        self, model: nn.Module, inputs: dict[str, Any], users: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """`[2P]` losses over the rows `[chosen..., rejected...]` of P records: each record's loss in its chosen
        row, 0 in its rejected one; each row's user: its record's (or, with a user column, its record's user)."""
        rows = {key: torch.cat([inputs[f"chosen_{key}"], inputs[f"rejected_{key}"]]) for key in _ROW_KEYS}
        record = inputs[RECORD] if users is None else users
        logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], use_cache=False).logits
        logratios = _completion_logps(logits, rows["input_ids"], rows["completion_mask"]) - self._reference(
            model, rows, inputs
        )
        losses = self.pair_losses(logratios, rows["completion_mask"])
        return torch.cat([losses, torch.zeros_like(losses)]), record.repeat(2)

    def pair_losses(self, logratios: Tensor, completion_mask: Tensor) -> Tensor:
        """`[P]` each record's loss from the `[2P]` log-ratios of its chosen and rejected rows to the reference."""
        chosen, rejected = logratios.chunk(2)
        total = torch.zeros_like(chosen)
        weights = self.args.loss_weights or [1.0] * len(self.args.loss_type)
        for loss_type, weight in zip(self.args.loss_type, weights, strict=True):
            if loss_type == "sigmoid":
                loss = -nn.functional.logsigmoid(self.beta * (chosen - rejected))
            elif loss_type == "hinge":
                loss = torch.relu(1 - self.beta * (chosen - rejected))
            else:  # "ipo": scores averaged over each completion's tokens
                lengths = completion_mask.sum(1).clamp(min=1.0).chunk(2)
                loss = (chosen / lengths[0] - rejected / lengths[1] - 1 / (2 * self.beta)) ** 2
            total = total + weight * loss
        return total

    def _reference(self, model: nn.Module, rows: dict[str, Tensor], inputs: dict[str, Any]) -> Tensor:
        """`[2P]` the reference model's summed completion log-probabilities: precomputed, or by TRL (without
        gradients: the engine records no call of it)."""
        if self.precompute_ref_logps:  # (not whenever the columns are there: TRL reads them only then)
            return torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).to(rows["input_ids"].device)
        return torch.cat(self.compute_ref_log_probs(self.ref_model if self.ref_model is not None else model, rows))


_ROW_KEYS = ("input_ids", "attention_mask", "completion_mask")
#: each record's position in its logical batch: its rows' user id in the engine, unique across micro-batches
RECORD = "record_in_batch"


class _PairRows:
    """TRL's preference collator with one row per record: its `[2P, T]` tensors (chosen rows, then rejected ones)
    split into `chosen_*` and `rejected_*` halves of `[P, T]`, so that DPTrainer's sampling, micro-batches and
    shares across processes, which take rows, take records; and each record's position in the batch (`RECORD`)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(records)
        batch[RECORD] = torch.arange(len(records), device="cpu")
        halves = {key: batch.pop(key).chunk(2) for key in _ROW_KEYS}
        return batch | {
            f"{side}_{key}": halves[key][k] for key in _ROW_KEYS for k, side in enumerate(("chosen", "rejected"))
        }


def _completion_logps(logits: Tensor, input_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """`[N]` each row's summed log-probability of its completion tokens (next-token, in float32)."""
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    return -flashdp.per_sample_lm_loss(logits, labels, reduction="sum")
