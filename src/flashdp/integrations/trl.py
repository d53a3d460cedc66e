"""DP-SGD with TRL's supervised fine-tuning: `DPSFTTrainer` is TRL's `SFTTrainer` (its dataset preparation:
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

from trl import SFTTrainer

from flashdp.errors import FlashDPError
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
