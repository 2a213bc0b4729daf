"""k_scale / v_scale of the fp8 caches (paged_attention, paged_prefill, reshape_and_cache).

A scale is a number, folded into the kernel's constants when the call's plan is built (a
captured graph replays that number), or a float32 device array of shape (), (1,) or
(nheads_kv,), as vLLM passes them: the kernel reads it at every launch
(common/types.cuh kv_head_scale), so a captured graph replays with whatever the array holds
then, and each KV head may have its own. A value means cache value * scale; for 16-bit
caches the scales are checked and ignored, as in vLLM.

An op passes the array with its array arguments (its pointer is read per call, like theirs)
and the number with its options: ``split`` separates the two, ``check`` validates them.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import cupy
import numpy as np

from .. import _arrays as A
from .._launch import NULL

SHAPES_DOC = "(), (1,) or (nheads_kv,)"


class Scale(NamedTuple):
    """A checked scale: the factor the host folds in, and how the kernel reads the array."""
    factor: float     # the number, or 1.0 when the array holds the scale
    stride: int       # the array's: 1 a scale per KV head, 0 one for all (no array: 0)
    on_device: bool   # an array holds it (its pointer goes into the params)


NONE = Scale(1.0, 0, False)   # a 16-bit cache's: the scales are ignored


def split(value) -> tuple:
    """(array argument, option) of a k_scale / v_scale argument: a device array (CuPy, or
    any with __cuda_array_interface__ / __dlpack__, viewed as CuPy by the op's launch path)
    is the array (None the option); anything else, a host array included, the option (None
    the array), which ``check`` takes as a number or refuses."""
    if type(value) is float:          # (the common call: no further look)
        return None, value
    if isinstance(value, cupy.ndarray):
        return value, None
    # (on the type: CuPy's own property would touch the device)
    kind = type(value)
    if isinstance(value, np.ndarray) or not (hasattr(kind, "__cuda_array_interface__")
                                             or hasattr(kind, "__dlpack__")):
        return None, value
    return value, None


def check(array, value, name: str, nheads_kv: int, device_id: int) -> Scale:
    """The scale from ``split``'s pair: a positive finite number, or a float32 device array
    of shape (), (1,) or (nheads_kv,) (its values are not read on the host)."""
    if array is None:
        return Scale(check_float(value, name), 0, False)
    A.check_dtype(array, np.float32, name)
    if array.shape not in ((), (1,), (nheads_kv,)):
        raise ValueError(f"{name}: expected a float, or a float32 device array of shape "
                         f"{SHAPES_DOC} with nheads_kv = {nheads_kv}, got shape "
                         f"{tuple(array.shape)}")
    if array.ndim == 1:
        A.check_last_dim_contiguous(array, name)
    A.check_aligned(array, 4, name)
    A.check_same_device({name: array}, device_id)
    per_head = array.ndim == 1 and array.shape[0] == nheads_kv and nheads_kv > 1
    return Scale(1.0, 1 if per_head else 0, True)


def check_float(value, name: str) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a float or a float32 device array, got bool")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a float or a float32 device array of shape "
                        f"{SHAPES_DOC}, got {type(value).__name__}") from None
    if not (math.isfinite(f) and f > 0):
        raise ValueError(f"{name}: expected a positive finite float, got {value!r}")
    return f


def check_pair(k_array, k_value, v_array, v_value, info, device_id: int) -> tuple[Scale, Scale]:
    """(k_scale, v_scale) of a call over caches ``info`` (layout.CacheInfo), each from
    ``split``'s pair: checked, and NONE for 16-bit caches (ignored, as in vLLM)."""
    k = check(k_array, k_value, "k_scale", info.num_kv_heads, device_id)
    v = check(v_array, v_value, "v_scale", info.num_kv_heads, device_id)
    return (k, v) if info.cache == "e4m3" else (NONE, NONE)


def fields(k: Scale, v: Scale) -> dict:
    """The params fields of the two scales' arrays (their pointers come from the slots)."""
    return dict(k_scales_stride=k.stride, v_scales_stride=v.stride)


def slots(call_slots, first: int, k: Scale, v: Scale) -> tuple:
    """The pointer slots of k_scales / v_scales: the call's arguments first and first + 1
    (cuattn._launch.Slots) when arrays hold the scales, else null."""
    return (call_slots.arg(first) if k.on_device else NULL,
            call_slots.arg(first + 1) if v.on_device else NULL)
