"""The book-keeping clipped sum `sum_b c_b L_b^T R_b`: `kernel.py` (Triton), `reference.py`."""
