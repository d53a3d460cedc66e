"""Per-sample LayerNorm / RMSNorm affine gradients: `kernel.py` (Triton), `reference.py`."""
