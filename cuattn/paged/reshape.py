"""reshape_and_cache: write new tokens' keys and values into the paged caches.

Kernel: cuda_src/reshape_and_cache.cuh. Calls go through cuattn._launch: the checks below run
once per call signature.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .. import tuning
from .._dtypes import activation_dtype
from .._launch import Launch, Plan, Slots, execute, on_device, plan_cache, plan_for
from ..jit import get_kernel
from ..param_structs import RESHAPE_PARAMS
from . import scales
from .layout import PREFILL_HEAD_SIZES, check_caches, check_head_size, check_layout

_plans = plan_cache()
_NAMES = ("key", "value", "k_cache", "v_cache", "slot_mapping", "k_scale", "v_scale")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0,
                      kv_layout="vllm", stream=None):
    """Write new tokens into the paged caches: token i goes to slot slot_mapping[i]
    (= physical_block * block_size + offset); a negative slot is skipped.

    key, value: (num_tokens, nheads_kv, head_size) float16 / bfloat16.
    k_cache / v_cache: in ``kv_layout`` ("vllm" or "nhd", cuattn.paged.layout), the same
    dtype as key, or fp8 e4m3 (then the cache stores round-to-nearest(key / k_scale) and
    (value / v_scale); the scales floats, or float32 device arrays of shape (), (1,) or
    (nheads_kv,) read at every launch: cuattn.paged.scales).
    slot_mapping: int32 or int64 (num_tokens,).
    """
    (k_array, k_scale), (v_array, v_scale) = scales.split(k_scale), scales.split(v_scale)
    options = (k_scale, v_scale, kv_layout)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (key, value, k_cache, v_cache, slot_mapping, k_array, v_array), _NAMES, options,
        lambda arrays: _plan(arrays, *options), stream, 5)
    execute(plan, arrays, stream, ptrs)


def _plan(arrays, k_scale, v_scale, kv_layout) -> Plan:
    """Every check of reshape_and_cache -> its Plan (no launch when there is nothing to write)."""
    key, value, k_cache, v_cache, slot_mapping, k_array, v_array = arrays
    doc = "(num_tokens, nheads_kv, head_size)"
    A.check_ndim(key, 3, "key", doc)
    dtype = activation_dtype(key.dtype, "key")
    A.check_dtype(value, key.dtype, "value")
    A.check_shape(value, key.shape, "value", doc)
    num_tokens, nkv, head_size = key.shape
    check_head_size(head_size, "key", PREFILL_HEAD_SIZES)
    info = check_caches(k_cache, v_cache, dtype, head_size, check_layout(kv_layout),
                        PREFILL_HEAD_SIZES)
    if info.num_kv_heads != nkv:
        raise ValueError(f"key: nheads_kv {nkv} differs from the caches' {info.num_kv_heads}")
    for name, x in (("key", key), ("value", value)):
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)
    if slot_mapping.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"slot_mapping: expected dtype int32 or int64, got {slot_mapping.dtype}")
    A.check_shape(slot_mapping, (num_tokens,), "slot_mapping", "(num_tokens,)")
    A.check_last_dim_contiguous(slot_mapping, "slot_mapping")
    A.check_aligned(slot_mapping, slot_mapping.itemsize, "slot_mapping")
    device_id = key.device.id
    k_scale, v_scale = scales.check_pair(k_array, k_scale, v_array, v_scale, info, device_id)
    A.check_same_device({"value": value, "k_cache": k_cache, "v_cache": v_cache,
                         "slot_mapping": slot_mapping}, device_id)
    align = ((0, 16), (1, 16), (2, 16), (3, info.v_align), (4, slot_mapping.itemsize), (5, 4),
             (6, 4))
    common = dict(device_id=device_id, align=align, outputs=())
    if num_tokens == 0:
        return Plan(**common)
    variant = tuning.reshape_variant(dtype.short, info.cache, slot_mapping.dtype == np.int64)
    with on_device(device_id):
        kernel = get_kernel(variant, device_id)
    ks, vs = A.element_strides(key), A.element_strides(value)
    tail = RESHAPE_PARAMS.tail(
        key_stride_token=ks[0], key_stride_head=ks[1],
        value_stride_token=vs[0], value_stride_head=vs[1], **info.strides(k_cache, v_cache),
        k_scale=k_scale.factor, v_scale=v_scale.factor, **scales.fields(k_scale, v_scale),
        num_tokens=num_tokens, num_kv_heads=nkv, head_size=head_size,
        block_size=info.block_size)
    slots = Slots(len(arrays), 0)
    pointers = tuple(slots.arg(i) for i in range(5)) + scales.slots(slots, 5, k_scale, v_scale)
    launch = Launch(kernel, (num_tokens,), (variant.num_threads,), 0, RESHAPE_PARAMS.dtype,
                    pointers, tail)
    return Plan(**common, launches=(launch,))
