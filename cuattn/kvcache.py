"""flash_with_kvcache: attention of new tokens against a dense KV cache (FlashAttention's
flash_attn_with_kvcache without a block table), the new keys and values appended first.

A dense cache (batch_cache, seqlen_cache, nheads_kv, head_size) is an NHD paged cache
(cuattn.paged.layout) of one block per cache row: batch entry b's block table is the one
entry cache_batch_idx[b] (or b), and the block size is the power of two at or above
seqlen_cache, so key j of a sequence is slot j of its row, and the flash kernel's
clamp to a sequence's capacity (FlashFwdParams.seqlen_k) is seqlen_cache. The attention is
paged_prefill's flash form (cuattn/paged/prefill.py flash_form_plan) over q's rows packed
(batch x seqlen_q, one sequence per batch entry); the new keys, when given, are written by
cuda_src/kvcache_append.cuh in a launch before it, and the kernel counts them through
FlashFwdParams.new_keys, so cache_seqlens is read, never written, on the device.
Calls go through cuattn._launch: the checks below run once per call signature.
"""
from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from . import _arrays as A
from . import tuning
from ._dtypes import activation_dtype
from ._hooks import alibi_stride, check_hooks
from ._launch import NULL, Launch, Plan, execute, on_device, plan_cache, plan_for
from ._checks import INT32_MAX, MAX_GRID_YZ, check_options
from .jit import get_kernel
from .paged import scales
from .paged.layout import MAX_FLASH_CONTEXT, CacheInfo
from .paged.prefill import PagedFlashCall, flash_form_plan
from .param_structs import KVCACHE_APPEND_PARAMS

_plans = plan_cache()
# The arguments in the order of flash_form_plan's (q, k_cache, v_cache, block_tables,
# seqused_k, cu_seqlens_q, alibi_slopes, sinks), then the new keys and values, out last.
_NAMES = ("q", "k_cache", "v_cache", "cache_batch_idx", "cache_seqlens", "cu_seqlens_q",
          "alibi_slopes", "sinks", "k", "v", "out")
_Q_DOC = "(batch, seqlen_q, nheads, head_size)"
_CACHE_DOC = "(batch_cache, seqlen_cache, nheads_kv, head_size)"
_NEW_DOC = "(batch, seqlen_new, nheads_kv, head_size)"
# The Hopper kernel takes a call whose query rows fill its row tiles (one query head per
# tile: below this the mma.sync kernel, whose tiles pack the query heads of a KV head, does
# more with each K/V byte) and whose rows fill its boxes (a TMA box of K / V is at most 256
# keys of one cache row: cuattn/_tma.py paged_box_rows; the maps' boxes come from
# seqlen_cache, the kernel's from the block size, the power of two above it: they agree
# while this bound is at least the Hopper kernel's widest key tile).
_HOPPER_MIN_SEQLEN_Q = 64
_HOPPER_MIN_SEQLEN_CACHE = 256


def flash_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                       cache_batch_idx=None, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                       return_lse=False, num_splits=0, out=None, stream=None):
    """Attention of q against the first cache_seqlens[b] (+ seqlen_new) keys of each row of
    a dense KV cache, appending k, v there first.

    q: (batch, seqlen_q, nheads, head_size) float16 / bfloat16. k_cache, v_cache:
    (batch_cache, seqlen_cache, nheads_kv, head_size), q's dtype. cache_seqlens: int32
    (batch,) on the device (read on the device: a captured graph replays with new lengths),
    or an int for every row. cache_batch_idx: int32 (batch,), the cache row of each batch
    entry (None: row b). k, v: (batch, seqlen_new, nheads_kv, head_size) or None: written
    into the cache at slots cache_seqlens[b] .. + seqlen_new of its row before attending;
    the attention then sees cache_seqlens[b] + seqlen_new keys (cache_seqlens itself is not
    updated, as in FlashAttention). Causal and window_size are aligned to the bottom-right
    corner of each row's own length. Hooks, num_splits as flash_forward. Returns out (like
    q) or (out, lse) with lse float32 (batch, nheads, seqlen_q), natural log (a view of
    (nheads, batch, seqlen_q) storage).
    """
    if cache_seqlens is None:
        raise TypeError("cache_seqlens: expected an int32 device array (batch,) or an int, "
                        "got None")
    cache_len, seqlens = 0, cache_seqlens
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_len, seqlens = int(cache_seqlens), None
    options = (cache_len, cache_batch_idx is None, causal, softmax_scale, window_size, softcap,
               return_lse, num_splits)
    given = [q, k_cache, v_cache, cache_batch_idx, seqlens, None, alibi_slopes, sinks, k, v,
             out]
    q = given[0] = A.as_device_array(q, "q")
    key = (q.device.id,) + q.shape[:2] if q.ndim == 4 else None
    if key not in _constants:     # the call's checks first, then the device is touched
        _plan(_as_device_arrays(given), *options, check_only=True)
        _make_constants(*key)
    table, given[5] = _constants[key]
    if cache_batch_idx is None:
        given[3] = table
    plan, arrays, stream, ptrs = plan_for(
        _plans, tuple(given), _NAMES, options, lambda arrays: _plan(arrays, *options), stream, 3)
    result = execute(plan, arrays, stream, ptrs)
    return _unpack(result, q.shape, bool(return_lse))


# (device, batch, seqlen_q) -> the two constant arrays of such calls (_make_constants).
_constants: dict[tuple, tuple] = {}


def _make_constants(device_id: int, batch: int, seqlen_q: int) -> None:
    """The constant arrays of a (batch, seqlen_q) call on a device: the block table of a
    call without cache_batch_idx (row b: b) and cu_seqlens_q (b x seqlen_q). Made by the
    first such call, which waits for them (a later call, or a graph capturing one, reads
    them on any stream), and kept for the process: a plan reads their addresses."""
    with on_device(device_id):
        table = cupy.asarray(np.arange(batch, dtype=np.int32))
        cu_q = cupy.asarray(np.arange(batch + 1, dtype=np.int32) * np.int32(seqlen_q))
        cupy.cuda.Device(device_id).synchronize()
    _constants[device_id, batch, seqlen_q] = table, cu_q


def _as_device_arrays(given: list) -> tuple:
    """plan_for's view of the arguments (q, k_cache and v_cache required)."""
    return tuple(None if x is None and i >= 3 else A.as_device_array(x, name)
                 for i, (x, name) in enumerate(zip(given, _NAMES)))


def _unpack(result, q_shape, with_lse: bool):
    """out as (batch, seqlen_q, nheads, head_size) and lse as (batch, nheads, seqlen_q)."""
    batch, seqlen_q, nheads, head_size = q_shape if len(q_shape) == 4 else (0,) * 4
    out, lse = result if with_lse else (result, None)
    if out.ndim == 3:     # allocated by the plan, packed
        out = out.reshape(batch, seqlen_q, nheads, head_size)
    if lse is None:
        return out
    return out, lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2)


def _packed(x, name: str):
    """The (batch x seqlen, heads, head dim) view of a (batch, seqlen, heads, head dim) x
    whose batch and row strides merge, else a ValueError naming x."""
    batch, seqlen, heads, dim = x.shape
    sb, sr, sh, sd = x.strides
    if seqlen == 1:
        sr = sb
    elif batch > 1 and sb != seqlen * sr:
        raise ValueError(f"{name}: its batch stride must be seqlen x its row stride (the rows "
                         f"of every batch entry are read as one packed run), got strides "
                         f"{x.strides} for shape {tuple(x.shape)}")
    return cupy.ndarray((batch * seqlen, heads, dim), x.dtype, memptr=x.data,
                        strides=(sr, sh, sd))


def _check_int32_rows(x, batch: int, name: str) -> None:
    A.check_ndim(x, 1, name, "(batch,)")
    A.check_dtype(x, np.int32, name)
    A.check_shape(x, (batch,), name, "(batch,)")
    A.check_last_dim_contiguous(x, name)
    A.check_aligned(x, 4, name)


def _plan(arrays, cache_len, own_table, causal, softmax_scale, window_size, softcap,
          return_lse, num_splits, check_only=False) -> Plan | None:
    """Every check of flash_with_kvcache (raising before any launch) -> its Plan (None:
    check_only, before the call's constants exist)."""
    q, k_cache, v_cache, table, seqlens, cu_q, alibi_slopes, sinks, k, v, out = arrays
    A.check_ndim(q, 4, "q", _Q_DOC)
    dtype = activation_dtype(q.dtype, "q")
    batch, seqlen_q, nheads, head_size = q.shape
    if head_size % 8 or not 8 <= head_size <= 256:
        raise ValueError(f"q: head_size {head_size} is not supported; expected a multiple of 8 "
                         "from 8 to 256")
    if nheads == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    if batch > MAX_GRID_YZ:
        raise ValueError(f"q: batch {batch} must be <= {MAX_GRID_YZ} (grid dimensions)")
    if batch * seqlen_q > INT32_MAX:
        raise ValueError(f"q: batch x seqlen_q = {batch * seqlen_q} must fit in int32")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        A.check_ndim(x, 4, name, _CACHE_DOC)
        A.check_dtype(x, q.dtype, name)
    A.check_shape(v_cache, k_cache.shape, "v_cache", _CACHE_DOC)
    batch_cache, seqlen_cache, nheads_kv, cache_head_size = k_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"k_cache: head_size {cache_head_size} differs from q's {head_size}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"k_cache: nheads_kv = {nheads_kv} must divide nheads = {nheads}")
    if not 0 < seqlen_cache < MAX_FLASH_CONTEXT // 2:
        raise ValueError(f"k_cache: seqlen_cache {seqlen_cache} must be in [1, 2**28)")
    if batch_cache == 0 or batch_cache > INT32_MAX:
        raise ValueError(f"k_cache: batch_cache {batch_cache} must be in [1, 2**31)")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)
    if seqlens is None:
        if not 0 <= cache_len <= seqlen_cache:
            raise ValueError(f"cache_seqlens: an int must be in [0, seqlen_cache = "
                             f"{seqlen_cache}], got {cache_len}")
    else:
        _check_int32_rows(seqlens, batch, "cache_seqlens")
    if not own_table:
        _check_int32_rows(table, batch, "cache_batch_idx")
    elif batch > batch_cache:
        # (entry b reads row b: the append skips a row past the cache, but the attention
        # would read it, out of the caches' memory)
        raise ValueError(f"k_cache: batch_cache {batch_cache} is less than q's batch {batch} "
                         "and no cache_batch_idx is given (entry b reads cache row b)")
    device_id = q.device.id
    A.check_same_device({"k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": seqlens,
                         "cache_batch_idx": table if not own_table else None}, device_id)
    seqlen_new = _check_new(k, v, batch, nheads_kv, head_size, q.dtype, device_id)
    if seqlen_new > seqlen_cache:
        raise ValueError(f"k: seqlen_new {seqlen_new} is longer than the cache's rows "
                         f"(seqlen_cache {seqlen_cache})")
    softmax_scale, left, right, num_splits, return_lse = check_options(
        causal, softmax_scale, window_size, num_splits, return_lse, head_size)
    features, softcap = check_hooks(softcap, alibi_slopes, sinks, nheads, device_id, batch)
    if out is not None:
        A.check_output(out, q.shape, q.dtype, "out", _Q_DOC, device_id, align=16)
    q3 = _packed(q, "q")
    out3 = None if out is None else _packed(out, "out")
    if check_only:
        return None
    block_size = 1 << (seqlen_cache - 1).bit_length()
    info = CacheInfo(dtype.short, nheads_kv, head_size, block_size, 16, "nhd")
    plan = flash_form_plan(PagedFlashCall(
        q3, k_cache, v_cache, table.reshape(batch, 1), info, "nhd", dtype=dtype,
        features=features, softcap=softcap, softmax_scale=softmax_scale, left=left,
        right=right, num_splits=num_splits, k_scale=scales.NONE, v_scale=scales.NONE, out=out3,
        return_lse=return_lse, num_args=len(arrays), max_seqlen_q=seqlen_q,
        capacity=seqlen_cache, new_keys=cache_len + seqlen_new,
        alibi_stride=alibi_stride(alibi_slopes),
        hopper_ok=seqlen_q >= _HOPPER_MIN_SEQLEN_Q and seqlen_cache >= _HOPPER_MIN_SEQLEN_CACHE))
    if not seqlen_new or batch == 0:
        return plan
    return _with_append(plan, arrays, dtype, cache_len, seqlen_new)


def _check_new(k, v, batch, nheads_kv, head_size, dtype, device_id) -> int:
    """k, v: both None (0) or both (batch, seqlen_new, nheads_kv, head_size) -> seqlen_new."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise ValueError(f"{'k' if k is None else 'v'}: k and v are given together or not "
                         "at all")
    for name, x in (("k", k), ("v", v)):
        A.check_ndim(x, 4, name, _NEW_DOC)
        A.check_dtype(x, dtype, name)
        if x.shape[0] != batch or x.shape[2:] != (nheads_kv, head_size):
            raise ValueError(f"{name}: expected shape (batch={batch}, seqlen_new, "
                             f"nheads_kv={nheads_kv}, head_size={head_size}), got "
                             f"{tuple(x.shape)}")
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)
    A.check_shape(v, k.shape, "v", _NEW_DOC)
    A.check_same_device({"k": k, "v": v}, device_id)
    if k.shape[1] > INT32_MAX:
        raise ValueError(f"k: seqlen_new {k.shape[1]} must fit in int32")
    return k.shape[1]


def _with_append(plan: Plan, arrays, dtype, cache_len, seqlen_new) -> Plan:
    """The plan with the append launch (cuda_src/kvcache_append.cuh) before its own."""
    q, k_cache, v_cache, table, seqlens, _, _, _, k, v, _ = arrays
    variant = tuning.kvcache_append_variant(dtype.short)
    with on_device(plan.device_id):
        kernel = get_kernel(variant, plan.device_id)
    ks, vs, kcs, vcs = (A.element_strides(x) for x in (k, v, k_cache, v_cache))
    batch_cache, seqlen_cache, nheads_kv, head_size = k_cache.shape
    tail = KVCACHE_APPEND_PARAMS.tail(
        k_stride_batch=ks[0], k_stride_row=ks[1], k_stride_head=ks[2],
        v_stride_batch=vs[0], v_stride_row=vs[1], v_stride_head=vs[2],
        kc_stride_batch=kcs[0], kc_stride_row=kcs[1], kc_stride_head=kcs[2],
        vc_stride_batch=vcs[0], vc_stride_row=vcs[1], vc_stride_head=vcs[2],
        num_heads_kv=nheads_kv, head_dim=head_size, seqlen_cache=seqlen_cache,
        batch_cache=batch_cache, cache_len=cache_len)
    arg = {name: 1 + i for i, name in enumerate(_NAMES)}     # Slots.arg: 1 + argument index
    slots = (arg["k"], arg["v"], arg["cache_seqlens"] if seqlens is not None else NULL,
             arg["cache_batch_idx"], arg["k_cache"], arg["v_cache"])
    append = Launch(kernel, (seqlen_new, q.shape[0]), (variant.num_threads,), 0,
                    KVCACHE_APPEND_PARAMS.dtype, slots, tail)
    align = ((_NAMES.index("k"), 16), (_NAMES.index("v"), 16))
    return dataclasses.replace(plan, align=plan.align + align,
                               launches=(append,) + plan.launches)
