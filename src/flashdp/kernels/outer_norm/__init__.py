"""Per-sample squared norms of outer-product gradients `g_n = L_n^T R_n`: `kernel.py` (Triton), `reference.py`."""
