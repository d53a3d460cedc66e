"""DPTrainer's refusals: the Trainer and privacy arguments DP-SGD cannot honour, each with what to do instead."""

from __future__ import annotations

from transformers import Trainer

from flashdp.errors import FlashDPError


def check_arguments(trainer: Trainer, own_losses: bool) -> None:
    """The arguments of a DPTrainer that DP-SGD cannot honour, refused with what to do instead. `own_losses`:
    whether the trainer's per-sample losses are DPTrainer's own (`per_sample_loss` not overridden)."""
    args = trainer.args
    if args.gradient_accumulation_steps != 1:
        raise FlashDPError(
            f"DPTrainer samples each logical batch whole (PrivacyArguments.expected_batch_size) and splits it "
            f"into micro-batches of per_device_train_batch_size; gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps} would make a step of several Poisson batches, which the "
            "accounting does not describe. Set gradient_accumulation_steps=1."
        )
    if args.world_size > 1:
        check_several_processes(trainer)
    if args.fp16:
        raise FlashDPError(
            "fp16=True trains with a dynamic loss scale, which GradScaler lowers and whose steps it skips whenever "
            "a gradient overflows: both depend on the private gradients outside the noise, so the epsilon would "
            "not cover them (docs/guides/hf-transformers.md). Use bf16=True (float32's exponent range, no "
            "scaler) or float32."
        )
    if trainer.train_dataset is None or not hasattr(trainer.train_dataset, "__len__"):
        raise FlashDPError("DPTrainer needs a train_dataset with a length (Poisson sampling draws from it).")
    if own_losses:
        check_losses(trainer)
    c_trainer, c_privacy = args.max_grad_norm, trainer.privacy.max_grad_norm
    if c_privacy is not None and c_trainer not in (0, None, c_privacy):
        raise FlashDPError(
            f"Two clipping bounds: PrivacyArguments.max_grad_norm={c_privacy} (per sample) and "
            f"TrainingArguments.max_grad_norm={c_trainer}. DPTrainer clips each sample, never the batch: give "
            "one of them (or the same value)."
        )
    if not (c_privacy or c_trainer):
        raise FlashDPError(
            "DP-SGD needs a per-sample clipping bound: TrainingArguments.max_grad_norm (or "
            "PrivacyArguments.max_grad_norm) must be positive."
        )
    k = trainer.privacy.examples_per_user
    if k is not None and k > args.per_device_train_batch_size:
        raise FlashDPError(
            f"PrivacyArguments.examples_per_user={k} exceeds per_device_train_batch_size="
            f"{args.per_device_train_batch_size}: a user's examples of a step are clipped together, in one "
            "micro-batch. Raise per_device_train_batch_size to at least examples_per_user, or lower the latter."
        )
    if trainer.privacy.expected_batch_size > trainer._units:
        units = "training samples" if trainer._users is None else "users"
        raise FlashDPError(
            f"expected_batch_size={trainer.privacy.expected_batch_size} exceeds the {trainer._units} {units}."
        )


def check_losses(trainer: Trainer) -> None:
    """Settings that change Trainer's loss, which `per_sample_loss` (plain cross entropy or squared error per
    sample) would silently not apply."""
    args = trainer.args
    ignored = {
        "label_smoothing_factor": args.label_smoothing_factor != 0,
        "compute_loss_func": trainer.compute_loss_func is not None,
        "use_liger_kernel": bool(getattr(args, "use_liger_kernel", False)),
        "loss_type": getattr(args, "loss_type", "nll") not in ("nll", None),  # (TRL's SFTConfig)
    }
    if any(ignored.values()):
        names = ", ".join(name for name, on in ignored.items() if on)
        raise FlashDPError(
            f"DPTrainer computes one loss per sample itself (per_sample_loss: cross entropy, or squared error for "
            f"regression), so these settings would be ignored: {names}. Remove them, or override "
            "per_sample_loss(model, inputs) to return the [B] losses you want."
        )
    overriding = next(cls for cls in type(trainer).__mro__ if "compute_loss" in vars(cls))
    if overriding.__module__.split(".")[0] not in ("transformers", "trl", "flashdp"):
        raise FlashDPError(
            f"{overriding.__name__} overrides compute_loss, which DPTrainer never calls: it computes one loss per "
            "sample itself (per_sample_loss), so the override would be silently ignored. Override "
            "per_sample_loss(model, inputs) to return the [B] losses you want instead."
        )
    if getattr(getattr(trainer.model, "config", None), "output_router_logits", False):
        raise FlashDPError(
            "The model's config has output_router_logits=True: its router's auxiliary (load-balancing) loss is a "
            "statistic of the whole batch, which mixes samples, so no sample's gradient could be clipped alone. "
            "Set model.config.output_router_logits = False."
        )


def check_several_processes(trainer: Trainer) -> None:
    """What DPTrainer does not support on several processes yet."""
    world = trainer.args.world_size
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        raise FlashDPError(
            f"DPTrainer on {world} processes runs under DDP; this run uses "
            f"{'FSDP' if trainer.is_fsdp_enabled else 'DeepSpeed'}, which DPTrainer does not support yet. Launch "
            "without it (DDP), or call flashdp.make_private on the FSDP-wrapped model in your own loop "
            "(docs/distributed.md)."
        )
