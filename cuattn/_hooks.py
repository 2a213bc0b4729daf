"""The checks of the options every attention function shares beyond plain attention:
``softcap``, ``alibi_slopes`` and ``sinks`` (cuda_src/common/logits.cuh, the sinks of
cuda_src/common/softmax.cuh's callers).

- softcap: a float >= 0 (0: off). A scaled score s becomes softcap * tanh(s / softcap)
  before the mask and the bias (Gemma 2; FlashAttention-2's softcap).
- alibi_slopes: float32 (nheads,) or (batch, nheads) (a slope per sequence and head) on the
  call's device: the bias -slope * |i' - j| between query position i' (bottom-right
  aligned) and key j (FlashAttention-2's ALiBi, both shapes).
- sinks: float32 (nheads,): a logit per head, in the units of the scaled scores, that joins
  the softmax denominator and carries no value (gpt-oss's attention sinks); lse includes it.
"""
from __future__ import annotations

import math

import numpy as np

from . import _arrays as A
from .constants import FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP


def check_softcap(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap: expected a float (0.0: off), got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap: expected a finite float >= 0 (0.0: off), got {value}")
    return value


def check_head_vector(x, nheads: int, name: str, device_id: int,
                      batch: int | None = None) -> None:
    """sinks / alibi_slopes: float32 (nheads,) (or, batch given, also (batch, nheads): rows
    of any non-negative stride), the last dimension contiguous, 4-byte aligned, on the
    call's device."""
    doc = "(nheads,)" if batch is None else "(nheads,) or (batch, nheads)"
    if x.ndim != 1 and (batch is None or x.ndim != 2):
        raise ValueError(f"{name}: expected shape {doc}, got {tuple(x.shape)}")
    A.check_dtype(x, np.float32, name)
    A.check_shape(x, (nheads,) if x.ndim == 1 else (batch, nheads), name, doc)
    A.check_last_dim_contiguous(x, name)
    A.check_aligned(x, 4, name)
    if x.ndim == 2 and (x.strides[0] % 4 or not 0 <= x.strides[0] // 4 < 2**31):
        raise ValueError(f"{name}: row stride {x.strides[0]} bytes is not a non-negative "
                         "multiple of 4 below 2**33")
    A.check_same_device({name: x}, device_id)


def alibi_stride(alibi_slopes) -> int:
    """The params' alibi row stride (elements): 0 for none or (nheads,) slopes."""
    return 0 if alibi_slopes is None or alibi_slopes.ndim != 2 else alibi_slopes.strides[0] // 4


def check_hooks(softcap, alibi_slopes, sinks, nheads: int, device_id: int,
                batch: int) -> tuple[int, float]:
    """(the FEAT_* bits of the call, softcap as a float). batch: the sequences of the call
    (the first dimension of (batch, nheads) slopes)."""
    softcap = check_softcap(softcap)
    features = FEAT_SOFTCAP if softcap > 0 else 0
    if alibi_slopes is not None:
        check_head_vector(alibi_slopes, nheads, "alibi_slopes", device_id, batch)
        features |= FEAT_ALIBI
    if sinks is not None:
        check_head_vector(sinks, nheads, "sinks", device_id)
        features |= FEAT_SINKS
    return features, softcap


def hook_fields(softcap: float, unit: float) -> dict:
    """The softcap constants of a kernel that keeps scores in units of ``unit`` (a score u
    there is the scaled score u * unit): common/logits.cuh's cap_in and cap_out."""
    if softcap == 0:
        return dict(softcap_in=0.0, softcap_out=0.0)
    return dict(softcap_in=unit / softcap, softcap_out=softcap / unit)
