"""The one dtype table: each supported NumPy dtype, its C++ spelling and its short name.

The short name goes into variant names (``cuattn_merge__bf16_hd128``); the C++ type is
what a generated entry point instantiates the kernel template with.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    short: str      # in variant names: f16, bf16, e4m3, u8
    cpp: str        # C++ type of one element
    numpy: np.dtype


FLOAT16 = DType("f16", "__half", np.dtype(np.float16))
BFLOAT16 = DType("bf16", "__nv_bfloat16", np.dtype(ml_dtypes.bfloat16))
# fp8 KV caches: ml_dtypes' e4m3fn or raw bytes holding e4m3 values.
FP8_E4M3 = DType("e4m3", "__nv_fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn))
UINT8_E4M3 = DType("e4m3", "__nv_fp8_e4m3", np.dtype(np.uint8))

# Activations (q, k, v, out): 16-bit floats.
ACTIVATION_DTYPES = {d.numpy: d for d in (FLOAT16, BFLOAT16)}
BY_SHORT = {d.short: d for d in (FLOAT16, BFLOAT16, FP8_E4M3)}


def activation_dtype(dtype, name: str) -> DType:
    """The table entry for a 16-bit activation dtype, or a TypeError naming ``name``."""
    entry = ACTIVATION_DTYPES.get(np.dtype(dtype))
    if entry is None:
        raise TypeError(
            f"{name}: dtype {np.dtype(dtype)} is not supported; "
            "expected float16 or ml_dtypes.bfloat16")
    return entry
