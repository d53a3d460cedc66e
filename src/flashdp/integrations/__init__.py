"""Integrations with training frameworks (optional dependencies, imported only from here):

flashdp.integrations.transformers   DPTrainer, a `transformers.Trainer` that trains with DP-SGD
flashdp.integrations.trl            DPSFTTrainer, TRL's `SFTTrainer` trained with DP-SGD
"""
