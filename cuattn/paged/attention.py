"""paged_attention: decode attention of one query token per sequence over a paged KV cache.

One thread block serves ``group`` query heads of one KV head (the largest divisor of the
GQA ratio up to tuning.PAGED_MAX_GROUP), so each K/V byte leaves memory once per group.
v1: one block per (head group, sequence); v2: one per (head group, sequence, partition) and
a reduce kernel. Calls go through cuattn._launch: the checks below run once per signature;
values inside the arrays (seq_lens, block_tables) are never read on the host.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import _arrays as A
from .. import tuning
from .._dtypes import activation_dtype
from .._hooks import alibi_stride, check_hooks, hook_fields
from .._launch import NULL, Plan, execute, on_device, plan_cache, plan_for, returns
from ..constants import FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP
from . import scales
from .forms import decode_launches, form_for, window_bound
from .prefill import PagedFlashCall, flash_form_plan
from .layout import (check_caches, check_flash_context, check_head_size, check_layout,
                     check_tables)

_plans = plan_cache()
_NAMES = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "alibi_slopes", "sinks",
          "k_scale", "v_scale", "out")
_ARG = {name: i for i, name in enumerate(_NAMES)}
_Q_DOC = "(num_seqs, nheads, head_size)"


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, softmax_scale=None,
                    k_scale=1.0, v_scale=1.0, alibi_slopes=None, softcap=0.0, sinks=None,
                    window_size=(-1, -1), kv_layout="vllm", version="auto",
                    partition_size=None, return_lse=False, out=None, stream=None):
    """Decode attention of one query token per sequence over a paged KV cache.

    q: (num_seqs, nheads, head_size) float16 / bfloat16.
    k_cache: (num_blocks, nheads_kv, head_size // x, block_size, x), x = 16 // itemsize.
    v_cache: (num_blocks, nheads_kv, head_size, block_size). Same dtype as q, or fp8 e4m3
        (ml_dtypes.float8_e4m3fn or uint8) dequantised as value * k_scale / v_scale: floats,
        or float32 device arrays of shape (), (1,) or (nheads_kv,) read at every launch
        (cuattn.paged.scales; ignored for 16-bit caches, as in vLLM).
    block_tables: int32 (num_seqs, max_blocks_per_seq); seq_lens: int32 (num_seqs,). A
        sequence longer than max_blocks_per_seq * block_size is clamped to that.
    alibi_slopes: float32 (nheads,) or (num_seqs, nheads), or None; bias slope * (j - seq_len
        + 1) on key j.
    softcap, sinks: cuattn._hooks. window_size = (left, right): the query (position
        seq_len - 1) sees keys j >= seq_len - 1 - left (-1: unbounded; right is moot).
    kv_layout: "vllm" (above) or "nhd" (K and V (num_blocks, block_size, nheads_kv,
        head_size)). NHD caches of fp8 or of a head size not a multiple of 16 run on the
        flash form (paged_prefill's kernel, one query per sequence; q and out then need
        16-byte alignment), where version "v1" is one pass over the keys, "v2" and "auto"
        the split-KV rule's choice, and partition_size is not used.
    version: "v1", "v2" or "auto"; partition_size: v2's tokens per thread block, one of
        128 / 256 / 512 / 1024, or None: the tuning rule's choice (cuattn.tuning).
    Returns out (like q), or (out, lse) with lse float32 (nheads, num_seqs), natural log,
    -inf for an empty sequence: the layout cuattn.merge_attn_states takes.
    """
    (k_array, k_scale), (v_array, v_scale) = scales.split(k_scale), scales.split(v_scale)
    options = (softmax_scale, k_scale, v_scale, softcap, window_size, kv_layout, version,
               partition_size, return_lse)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, sinks, k_array,
                 v_array, out), _NAMES, options, lambda arrays: _plan(arrays, *options), stream, 5)
    return execute(plan, arrays, stream, ptrs)


def auto_version(q_shape, cache_dtype, nheads_kv: int, block_size: int, max_blocks_per_seq: int,
                 *, alibi: bool = False, partition_size: int | None = None,
                 device_id: int = 0) -> str:
    """What version="auto" runs for these shapes ("v1" or "v2 p<partition>"); for
    benchmarks and tests."""
    num_seqs, num_heads, head_size = q_shape
    group = tuning.paged_group(num_heads // nheads_kv)
    dt = np.dtype(cache_dtype)
    cache = "e4m3" if dt.itemsize == 1 else ("f16" if dt == np.float16 else "bf16")
    form = form_for(cache, head_size, group)
    key = form.variant("f16" if cache == "e4m3" else cache, cache, head_size, block_size,
                       group, 0, alibi)
    version, ps = form.choose("auto", partition_size, (num_heads // group) * num_seqs,
                              max_blocks_per_seq * block_size, device_id, key)
    return version if version == "v1" else f"v2 p{ps}"


def _window_left(window_size) -> int:
    """The kernels' window_left: keys j >= seq_len - 1 - window_left (right is moot)."""
    return window_bound(A.check_window(window_size)[0])


def _plan(arrays, softmax_scale, k_scale, v_scale, softcap, window_size, kv_layout, version,
          partition_size, return_lse) -> Plan:
    """Every check of paged_attention (raising before any launch) -> its Plan."""
    q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, sinks, k_array, v_array, out = arrays
    A.check_ndim(q, 3, "q", _Q_DOC)
    dtype = activation_dtype(q.dtype, "q")
    num_seqs, num_heads, head_size = q.shape
    check_head_size(head_size, "q")
    if num_seqs > 65535:
        raise ValueError(f"q: num_seqs {num_seqs} is more than one launch's 65535 "
                         "(a grid dimension); split the batch")
    A.check_last_dim_contiguous(q, "q")
    kv_layout = check_layout(kv_layout)
    info = check_caches(k_cache, v_cache, dtype, head_size, kv_layout)
    if num_heads == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    if info.num_kv_heads == 0 or num_heads % info.num_kv_heads:
        raise ValueError(f"q: nheads {num_heads} is not a multiple of the caches' nheads_kv "
                         f"{info.num_kv_heads}")
    check_tables(block_tables, seq_lens, num_seqs)
    features, softcap = check_hooks(softcap, alibi_slopes, sinks, num_heads, q.device.id,
                                    num_seqs)
    window_left = _window_left(window_size)
    if not isinstance(version, str) or version not in ("auto", "v1", "v2"):
        raise ValueError(f"version: expected 'auto', 'v1' or 'v2', got {version!r}")
    if partition_size is not None:
        if partition_size not in tuning.PAGED_PARTITION_SIZES or isinstance(partition_size, bool):
            raise ValueError(f"partition_size: expected None or one of "
                             f"{tuning.PAGED_PARTITION_SIZES}, got {partition_size!r}")
        partition_size = int(partition_size)
    k_scale, v_scale = scales.check_pair(k_array, k_scale, v_array, v_scale, info, q.device.id)
    softmax_scale = A.check_softmax_scale(softmax_scale, head_size, k_scale.factor)
    device_id = q.device.id
    A.check_same_device({"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                         "seq_lens": seq_lens}, device_id)
    # NHD caches the tensor-core form cannot take (fp8, head sizes not multiples of 16) run on
    # the flash form, whose kernel loads and stores 16-byte vectors of q and out
    flash_form = kv_layout == "nhd" and not tuning.tensor_core_decode_fits(info.cache, head_size)
    if flash_form:
        A.check_aligned(q, 16, "q")
        check_flash_context(block_tables, info.block_size)
    if out is not None:             # (the decode kernels' element stores need no alignment)
        A.check_output(out, q.shape, q.dtype, "out", _Q_DOC, device_id,
                       align=16 if flash_form else 0)
    out_arg = len(arrays) - 1
    if flash_form:
        return flash_form_plan(PagedFlashCall(
            q, k_cache, v_cache, block_tables, info, kv_layout, dtype=dtype, features=features,
            softcap=softcap, softmax_scale=softmax_scale, left=A.check_window(window_size)[0],
            right=0, num_splits=1 if version == "v1" else 0, k_scale=k_scale, v_scale=v_scale,
            out=out, return_lse=bool(return_lse), num_args=len(arrays), decode=True,
            alibi_stride=alibi_stride(alibi_slopes)))

    gqa = num_heads // info.num_kv_heads
    group = tuning.paged_group(gqa)
    max_blocks = block_tables.shape[1]
    max_context = max_blocks * info.block_size
    alibi = bool(features & FEAT_ALIBI)
    hooks = dict(softcap=bool(features & FEAT_SOFTCAP), sinks=bool(features & FEAT_SINKS),
                 nhd=kv_layout == "nhd")
    return_lse = bool(return_lse)
    lse_shape = (num_heads, num_seqs)
    slots, outputs, returned_slots, result = returns(
        len(arrays), [(out_arg if out is not None else None, q.shape, q.dtype)] +
        ([(None, lse_shape, np.float32)] if return_lse else []))
    out_slot, lse_slot = (returned_slots + (NULL,))[:2]
    align = ((_ARG["k_cache"], 16), (_ARG["v_cache"], info.v_align)) + tuple(
        (_ARG[n], 4) for n in ("block_tables", "seq_lens", "alibi_slopes", "sinks", "k_scale",
                               "v_scale"))
    common = dict(device_id=device_id, align=align, outputs=outputs, result=result)

    form = form_for(info.cache, head_size, group, nhd=hooks["nhd"])
    with on_device(device_id):
        v1_key = form.variant(dtype.short, info.cache, head_size, info.block_size, group, 0, alibi,
                              **hooks)
        version, partition_size = form.choose(version, partition_size,
                                              (num_heads // group) * num_seqs, max_context,
                                              device_id, v1_key)
        v1 = form.v1_launch(v1_key, max_context, device_id) if version == "v1" else None
        if num_seqs == 0:
            return Plan(**common)
        o_seq, o_head, _ = A.element_strides_or_contiguous(out, q.shape)
        l_head, l_seq = A.element_strides_or_contiguous(None, lse_shape) if return_lse else (0, 0)
        qs = A.element_strides(q)
        fields = dict(
            q_stride_seq=qs[0], q_stride_head=qs[1], **info.strides(k_cache, v_cache),
            bt_stride_seq=block_tables.strides[0] // 4,
            scale_log2=softmax_scale * k_scale.factor * A.LOG2E, v_scale=v_scale.factor,
            **scales.fields(k_scale, v_scale), alibi_stride_seq=alibi_stride(alibi_slopes),
            **hook_fields(softcap, 1 / A.LOG2E), window_left=window_left, window_right=0,
            num_seqs=num_seqs, num_heads=num_heads, gqa_ratio=gqa, max_blocks_per_seq=max_blocks,
            out_stride_seq=o_seq, out_stride_head=o_head, lse_stride_head=l_head,
            lse_stride_seq=l_seq)
        # decode_launches' inputs: q .. sinks, no cu_seqlens_q, then the scales
        inputs = tuple(slots.arg(_ARG[n]) for n in _NAMES[:_ARG["sinks"] + 1]) + (NULL,) + \
            scales.slots(slots, _ARG["k_scale"], k_scale, v_scale)
        key_for = functools.partial(form.variant, dtype.short, info.cache, head_size,
                                    info.block_size, group, alibi=alibi, **hooks)
        return Plan(**common, **decode_launches(
            form, key_for, version, partition_size, v1, grid=(num_heads // group, num_seqs),
            rows=num_seqs, max_context=max_context, sinks=hooks["sinks"],
            slots=(out_slot, lse_slot, slots.scratch(0), slots.scratch(1)) + inputs,
            fields=fields, device_id=device_id))
