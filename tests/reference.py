"""Float64 NumPy references shared by the tests (and the tolerance rule of docs/ARCHITECTURE.md)."""
from __future__ import annotations

import numpy as np


def merge_reference(outs: np.ndarray, lses: np.ndarray):
    """outs (k, T, H, D), lses (k, H, T) -> float64 out (T, H, D), lse (H, T); +/-inf = empty."""
    outs = outs.astype(np.float64)
    lses = lses.astype(np.float64)
    lses = np.where(np.isinf(lses), -np.inf, lses)
    m = lses.max(axis=0)                                  # (H, T)
    safe_m = np.where(np.isinf(m), 0.0, m)
    w = np.exp(lses - safe_m)                             # (k, H, T), 0 for empty
    s = w.sum(axis=0)
    wt = np.transpose(w, (0, 2, 1))[..., None]            # (k, T, H, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(np.transpose(s)[..., None] > 0,
                       (wt * np.nan_to_num(outs)).sum(axis=0) / np.transpose(s)[..., None], 0.0)
        lse = np.where(s > 0, safe_m + np.log(s), -np.inf)
    return out, lse


def tolerance(kernel_err_ref_precision: float, floor: float) -> float:
    """FlashAttention's rule: 2x the error of the same math in the input precision + floor."""
    return 2.0 * kernel_err_ref_precision + floor
