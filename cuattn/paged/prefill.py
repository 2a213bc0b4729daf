"""paged_prefill: attention of new tokens against a paged KV cache (chunked prefill, prefix
caching, speculative verification) in one call.

Two kernels (cuattn.tuning.paged_prefill_form picks one), each reading every K/V byte once
for all the query heads of its KV head and all the new tokens of its sequence:
- a few new tokens per sequence (speculative verification): multi-token decode, the
  tensor-core decode kernel (cuda_src/paged_attention_mma.cuh) with the tokens x heads of
  a sequence as the MMA's columns, through paged_attention's v1 / v2 launches;
- otherwise a flash forward: on Hopper, for 16-bit caches of blocks of >= 8 tokens in
  either layout (tuning.paged_prefill_path), the Hopper kernel (cuda_src/flash_fwd_sm90.cuh),
  whose TMA producer takes K / V a cache block at a time (a query head per block, as for
  dense calls); else the mma.sync kernel (cuda_src/flash_fwd.cuh) with its paged K/V source and
  the query heads of one KV head packed into a block's rows (cuattn.tuning.paged_prefill_tiles
  picks the tiles).
Calls go through cuattn._launch: the checks below run once per call signature; values
inside the arrays (seq_lens, block_tables, cu_seqlens_q) are never read on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import _arrays as A
from .. import _tma, tuning
from .._dtypes import ACTIVATION_DTYPES, FP8_E4M3, UINT8_E4M3, activation_dtype
from .._hooks import alibi_stride, check_hooks, hook_fields
from .._launch import NULL, Plan, execute, on_device, plan_cache, plan_for, returns
from .._checks import (MAX_GRID_YZ, check_cu_seqlens, check_fp8, check_max_seqlen,
                       check_options)
from ..flash import Call, QuantizeQ
from ..flash import _plan as flash_plan
from ..jit import device_info
from ..constants import FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, KV_PAGED_NHD, KV_PAGED_VLLM
from . import scales
from .forms import FORMS, decode_launches, window_bound
from .layout import (PREFILL_HEAD_SIZES, check_caches, check_flash_context, check_head_size,
                     check_layout, check_tables)

_plans = plan_cache()
_NAMES = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "alibi_slopes",
          "sinks", "k_scale", "v_scale", "q_scale", "q_descale", "out")
_Q_DOC = "(total_q, nheads, head_size)"


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, *,
                  causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  sinks=None, alibi_slopes=None, k_scale=1.0, v_scale=1.0, q_scale=None,
                  q_descale=None, kv_layout="vllm", return_lse=False, num_splits=0, out=None,
                  stream=None):
    """Attention of the new tokens of each sequence against its whole paged context.

    q: (total_q, nheads, head_size) float16 / bfloat16, the new tokens of every sequence
        packed; cu_seqlens_q: int32 (num_seqs + 1,) their prefix sums; max_seqlen_q bounds
        every sequence's new tokens (not checked against the device values).
    k_cache, v_cache: the paged cache in ``kv_layout`` ("vllm" or "nhd", cuattn.paged.layout),
        the query's dtype or fp8 e4m3 (ml_dtypes.float8_e4m3fn or uint8, dequantised as value
        * k_scale / v_scale), the new tokens already written (reshape_and_cache).
    k_scale / v_scale: floats, or float32 device arrays of shape (), (1,) or (nheads_kv,)
        read at every launch (cuattn.paged.scales); ignored for 16-bit caches, as in vLLM.
    FP8 math (sm_90, fp8 NHD caches of blocks of >= 8 tokens: the Hopper kernel's FP8 form,
        e4m3 Q K^T and P V): either q_scale, a float or float32 device array like k_scale
        (vLLM's static query scale), with which the call quantizes the 16-bit q to e4m3
        (q / q_scale, saturating) before the kernel; or q itself e4m3
        (ml_dtypes.float8_e4m3fn or uint8) with q_descale, float32 (num_seqs, nheads_kv) or
        None (FlashAttention-3's), the output then bfloat16 (or out='s 16-bit dtype).
        Without either, fp8 caches are widened to 16 bits in the kernel (16-bit math).
        q_scale is checked and ignored for 16-bit caches, as k_scale is.
    block_tables: int32 (num_seqs, max_blocks_per_seq); seq_lens: int32 (num_seqs,), each
        sequence's whole length, new tokens included (clamped to the table's capacity).
        Query i of sequence s sits at position seq_lens[s] - q_len[s] + i: causal is aligned
        to the bottom-right corner, window_size = (left, right) around that diagonal (a
        sequence with fewer keys than new tokens: its queries at negative positions see no
        key under causal, zeros and lse -inf, as in flash-attn).
    head_size: any multiple of 8 from 8 to 256 (layout.PREFILL_HEAD_SIZES; fp8 caches the
        multiples of 16); those outside paged_attention's run on the flash form.
    softcap, alibi_slopes ((nheads,) or (num_seqs, nheads)), sinks: cuattn._hooks.
        num_splits: split-KV (0: the tuning rule). Returns
        out (like q), or (out, lse) with lse float32 (nheads, total_q), natural log: the
        layout merge_attn_states takes.
    """
    (k_array, k_scale), (v_array, v_scale) = scales.split(k_scale), scales.split(v_scale)
    q_array, q_scale = scales.split(q_scale) if q_scale is not None else (None, None)
    options = (max_seqlen_q, causal, softmax_scale, window_size, softcap, k_scale, v_scale,
               q_scale, kv_layout, return_lse, num_splits)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, alibi_slopes, sinks,
                 k_array, v_array, q_array, q_descale, out), _NAMES, options,
        lambda arrays: _plan(arrays, *options), stream, 6)
    return execute(plan, arrays, stream, ptrs)


def _plan(arrays, max_seqlen_q, causal, softmax_scale, window_size, softcap, k_scale, v_scale,
          q_scale, kv_layout, return_lse, num_splits) -> Plan:
    """Every check of paged_prefill (raising before any launch) -> its Plan."""
    q, k_cache, v_cache, block_tables, seq_lens, cu_q, alibi_slopes, sinks, k_array, v_array, \
        q_array, q_descale, out = arrays
    A.check_ndim(q, 3, "q", _Q_DOC)
    fp8_q = q.dtype in (FP8_E4M3.numpy, UINT8_E4M3.numpy)
    dtype = FP8_E4M3 if fp8_q else activation_dtype(q.dtype, "q")
    total_q, nheads, head_size = q.shape
    check_head_size(head_size, "q", PREFILL_HEAD_SIZES)
    if nheads == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    A.check_last_dim_contiguous(q, "q")
    A.check_aligned(q, 16, "q")
    kv_layout = check_layout(kv_layout)
    info = check_caches(k_cache, v_cache, dtype, head_size, kv_layout, PREFILL_HEAD_SIZES)
    k_scale, v_scale = scales.check_pair(k_array, k_scale, v_array, v_scale, info, q.device.id)
    if info.num_kv_heads == 0 or nheads % info.num_kv_heads:
        raise ValueError(f"q: nheads {nheads} is not a multiple of the caches' nheads_kv "
                         f"{info.num_kv_heads}")
    check_cu_seqlens(cu_q, "cu_seqlens_q")
    num_seqs = cu_q.shape[0] - 1
    check_tables(block_tables, seq_lens, num_seqs)   # num_seqs: cu_seqlens_q has num_seqs + 1
    max_seqlen_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    check_flash_context(block_tables, info.block_size)
    softmax_scale, left, right, num_splits, return_lse = check_options(
        causal, softmax_scale, window_size, num_splits, return_lse, head_size)
    device_id = q.device.id
    A.check_same_device({"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                         "seq_lens": seq_lens, "cu_seqlens_q": cu_q}, device_id)
    features, softcap = check_hooks(softcap, alibi_slopes, sinks, nheads, device_id, num_seqs)
    fp8_math = _check_fp8_math(q, q_array, q_scale, q_descale, out, info, kv_layout, dtype,
                               num_seqs, (k_cache, v_cache))
    out_type = fp8_math.out_type if fp8_math is not None else dtype
    if out is not None:
        A.check_output(out, q.shape, out_type.numpy, "out", _Q_DOC, device_id, align=16)
    if tuning.paged_prefill_form(info.cache, head_size, max_seqlen_q, total_q) == "decode":
        return _decode_plan(q, info, block_tables, num_seqs, max_seqlen_q, dtype, features,
                            softcap, softmax_scale, left, right, num_splits,
                            cache_strides=info.strides(k_cache, v_cache),
                            lse_shape=(nheads, total_q) if return_lse else None, out=out,
                            num_args=len(arrays), kv_layout=kv_layout,
                            alibi_stride_seq=alibi_stride(alibi_slopes))

    return flash_form_plan(PagedFlashCall(
        q, k_cache, v_cache, block_tables, info, kv_layout, dtype=dtype, features=features,
        softcap=softcap, softmax_scale=softmax_scale, left=left, right=right,
        num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, out=out,
        return_lse=return_lse, alibi_stride=alibi_stride(alibi_slopes), num_args=len(arrays),
        max_seqlen_q=max_seqlen_q, fp8_math=fp8_math))


class Fp8Math(NamedTuple):
    """paged_prefill on the Hopper kernel's FP8 form: where its e4m3 queries come from."""
    out_type: object            # cuattn._dtypes entry of out
    quantize: QuantizeQ | None  # 16-bit q quantized with q_scale (None: q is e4m3, its
    #                             q_descale argument _Q_DESCALE, a null pointer when absent)
    q8: object                  # what the kernel's Q map describes: q, or the e4m3 copy
    fields: dict                # q_descale's strides (FlashFwdParams)


_Q_SCALE, _Q_DESCALE = _NAMES.index("q_scale"), _NAMES.index("q_descale")


def _check_fp8_math(q, q_array, q_scale, q_descale, out, info, kv_layout, dtype, num_seqs,
                    caches) -> Fp8Math | None:
    """The FP8 form's queries (None: the call runs 16-bit math), every bad option refused by
    name: q_scale for a 16-bit q, q_descale for an e4m3 one, on sm_90 over NHD caches of fp8
    and blocks the kernel's TMA boxes take."""
    fp8_q = dtype is FP8_E4M3
    quantize = q_array is not None or q_scale is not None
    if fp8_q and quantize:
        raise ValueError("q_scale: quantizes a 16-bit q; an e4m3 q takes q_descale")
    if q_descale is not None and not fp8_q:
        raise ValueError(f"q_descale: only for an e4m3 q (float8_e4m3fn), got {q.dtype}; a "
                         "16-bit q takes q_scale")
    scale = scales.check(q_array, q_scale, "q_scale", info.num_kv_heads, q.device.id) \
        if quantize else None
    if not fp8_q and not (quantize and info.cache == "e4m3"):
        return None             # (q_scale over 16-bit caches: checked and ignored)
    name = "q" if fp8_q else "q_scale"
    if kv_layout != "nhd":
        raise ValueError(f"{name}: FP8 math takes kv_layout 'nhd' caches (vLLM's V layout "
                         "lands no tile the FP8 kernel reads); got 'vllm'")
    if info.block_size < tuning.PREFILL_SM90_MIN_BLOCK:
        raise ValueError(f"{name}: FP8 math loads each cache block by TMA, blocks of at least "
                         f"{tuning.PREFILL_SM90_MIN_BLOCK} tokens; k_cache has {info.block_size}")
    if fp8_q and out is not None and out.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"out: an e4m3 q writes float16 or ml_dtypes.bfloat16, got {out.dtype}")
    if not fp8_q:    # (an e4m3 q: check_fp8's own, naming q)
        arch = device_info(q.device.id).arch
        if arch != tuning.SM90_ARCH:
            raise ValueError(f"q_scale: FP8 math (e4m3 queries) runs on Hopper (sm_90) GPUs "
                             f"only; this device is {arch}")
    q8 = q if fp8_q else _tma.ArraySpec.contiguous(q.shape, 1)
    out_type, fields = check_fp8(FP8_E4M3, out.dtype if fp8_q and out is not None else None,
                                  (q_descale, None, None), num_seqs, info.num_kv_heads,
                                  q.device.id, (q8,) + tuple(caches))
    if not fp8_q:
        out_type = dtype
    if not _tma.encodable("e4m3", (q if fp8_q else None,) + tuple(caches)):
        raise ValueError("k_cache: FP8 math loads the caches by TMA, and the driver takes no "
                         "tensor map of these arrays")
    quant = None if fp8_q else QuantizeQ(dtype, scale.factor,
                                         _Q_SCALE if scale.on_device else None, scale.stride)
    return Fp8Math(out_type, quant, q8, fields)


@dataclass(frozen=True)
class PagedFlashCall:
    """A checked call of the flash kernel over a paged cache, as flash_form_plan takes it
    (paged_prefill, paged_attention's NHD calls, flash_with_kvcache): the arrays, the
    caches' CacheInfo and layout, and the checked options; flash_form_plan says what the
    optional fields change."""
    q: object
    k_cache: object
    v_cache: object
    block_tables: object
    info: object                # layout.CacheInfo
    kv_layout: str
    dtype: object               # cuattn._dtypes entry of q
    features: int               # FEAT_* bits
    softcap: float
    softmax_scale: float
    left: int                   # the checked window
    right: int
    num_splits: int
    k_scale: object             # scales.Scale
    v_scale: object
    out: object                 # the out= argument or None
    return_lse: bool
    num_args: int               # array arguments of the call, out= last
    max_seqlen_q: int = 1
    decode: bool = False
    capacity: int | None = None
    new_keys: int = 0
    hopper_ok: bool = True
    alibi_stride: int = 0
    fp8_math: Fp8Math | None = None


def flash_form_plan(c: PagedFlashCall) -> Plan:
    """The flash form of a checked call (PagedFlashCall): flash's _plan over a paged Call.
    paged_prefill's (arguments q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
    alibi_slopes, sinks, k_scale, v_scale, out): the packed rows of cu_seqlens_q, max_seqlen_q
    the longest. decode (paged_attention's NHD calls the tensor-core form cannot take;
    arguments q .. seq_lens, alibi_slopes, sinks, k_scale, v_scale, out): one query per
    sequence, q (num_seqs, nheads, head_size) read as num_seqs batches of one row, no
    cu_seqlens_q, on the mma.sync kernel (the Hopper kernel's paged producer takes packed
    rows). capacity: the most keys a sequence has (None: its table's); new_keys: keys each
    sequence has past its seq_lens entry (FlashFwdParams.new_keys); hopper_ok: False keeps the
    call on the mma.sync kernel. k_scale / v_scale: scales.Scale (NONE for 16-bit caches);
    alibi_slopes (num_seqs, nheads) are read with the row stride alibi_stride. fp8_math:
    paged_prefill's FP8 form (its checks passed: _check_fp8_math), whose kernel reads the
    scales as descales."""
    total_q, nheads, _ = c.q.shape
    num_seqs = c.block_tables.shape[0]
    capacity = c.block_tables.shape[1] * c.info.block_size if c.capacity is None else c.capacity
    head_size = c.info.head_size
    fp8 = c.info.cache == "e4m3"
    # fp8: the kernel widens K and V exactly (every e4m3 value is a 16-bit float); k_scale
    # joins the softmax scale, through which every hook and the lse see the scores, and the
    # kernel multiplies the output by v_scale. (Widened times the scales, every element
    # rounded to 16 bits first: lse errors up to ~1e-2, found by the fuzz's NHD fp8 cases.)
    softmax_scale = c.softmax_scale
    if fp8:
        softmax_scale *= c.k_scale.factor
    if c.fp8_math is not None and c.fp8_math.quantize is not None:
        softmax_scale *= c.fp8_math.quantize.factor
    os_ = A.element_strides_or_contiguous(c.out, c.q.shape)
    qs = A.element_strides(c.q)
    lse_shape = (nheads, total_q)
    ls = A.element_strides_or_contiguous(None, lse_shape) if c.return_lse else (0, 0)
    if c.decode:    # batch b = sequence b, its row 0
        rows = dict(q_stride_batch=qs[0], q_stride_row=qs[0], o_stride_batch=os_[0],
                    o_stride_row=os_[0], lse_stride_batch=ls[1], lse_stride_row=0, seqlen_q=1)
        args = dict(q=0, k=1, v=2, block_tables=3, seqused_k=4, alibi_slopes=5, sinks=6)
    else:
        rows = dict(q_stride_batch=0, q_stride_row=qs[0], o_stride_batch=0, o_stride_row=os_[0],
                    lse_stride_batch=0, lse_stride_row=ls[1], seqlen_q=max(total_q, 1))
        args = dict(q=0, k=1, v=2, block_tables=3, seqused_k=4, cu_seqlens_q=5, alibi_slopes=6,
                    sinks=7)
    # (the FP8 form reads the cache scales as its k / v descales, q_scale as q's)
    descales = {}
    for i, (name, scale) in enumerate((("k", c.k_scale), ("v", c.v_scale))):
        if scale.on_device:       # the arguments after sinks
            field = f"{name}_descale" if c.fp8_math is not None else f"{name}_scales"
            args[field] = args["sinks"] + 1 + i
        if c.fp8_math is not None:
            descales.update({f"{name}_descale_stride_batch": 0,
                             f"{name}_descale_stride_head": scale.stride})
    if c.fp8_math is not None:
        quant = c.fp8_math.quantize
        if quant is None:
            args["q_descale"] = _Q_DESCALE
            descales.update(c.fp8_math.fields)
        elif quant.arg is not None:
            args["q_descale"] = quant.arg
            descales.update(q_descale_stride_batch=0, q_descale_stride_head=quant.stride)
    # The caches' strides (layout.CacheInfo.strides) under FlashFwdParams' names: a token's
    # slot is its K / V "row", a 16-byte vector of K its "chunk".
    s = c.info.strides(c.k_cache, c.v_cache)
    cache = dict(k_stride_block=s["k_stride_block"], k_stride_head=s["k_stride_head"],
                 k_stride_row=s["k_stride_token"], k_stride_chunk=s["k_stride_x"],
                 v_stride_block=s["v_stride_block"], v_stride_head=s["v_stride_head"],
                 v_stride_row=s["v_stride_token"], v_stride_dim=s["v_stride_dim"])
    kv = KV_PAGED_NHD if c.kv_layout == "nhd" else KV_PAGED_VLLM
    max_blocks = c.block_tables.shape[1]
    fields = dict(
        **rows, q_stride_head=qs[1], k_stride_batch=0, v_stride_batch=0, o_stride_head=os_[1],
        lse_stride_head=ls[0], bt_stride_seq=c.block_tables.strides[0] // 4,
        block_shift=c.info.block_size.bit_length() - 1, max_blocks_per_seq=max_blocks,
        seqlen_k=capacity, new_keys=c.new_keys, v_scale=c.v_scale.factor,
        **scales.fields(c.k_scale, c.v_scale), alibi_stride_batch=c.alibi_stride, **cache,
        **descales)
    group = nheads // c.info.num_kv_heads
    device_id = c.q.device.id
    arch = device_info(device_id).arch
    hopper = c.hopper_ok and not c.decode and \
        tuning.paged_prefill_path(arch, head_size, c.kv_layout, c.info.block_size,
                                  c.info.cache) == "wgmma" and \
        _tma.encodable(c.dtype.short, (c.q, c.k_cache, c.v_cache), c.kv_layout)

    def variant_for(split: bool, mask: int):
        if c.fp8_math is not None:
            return tuning.flash_sm90_variant("e4m3", head_size, mask=mask, split=split,
                                             features=c.features, tma=True,
                                             seqlen_q=c.max_seqlen_q, kv=kv,
                                             out=c.fp8_math.out_type.short)
        if hopper:
            return tuning.flash_sm90_variant(c.dtype.short, head_size, mask=mask, split=split,
                                             features=c.features, tma=True,
                                             seqlen_q=c.max_seqlen_q, kv=kv)
        return tuning.paged_prefill_variant(c.dtype.short, head_size, mask=mask, split=split,
                                            arch=arch, kv=kv, features=c.features,
                                            rows=c.max_seqlen_q * group, fp8=fp8)
    if c.fp8_math is not None:
        kernel = dict(dtype=FP8_E4M3, pack=1, qkv=(c.fp8_math.q8, c.k_cache, c.v_cache),
                      out_dtype=c.fp8_math.out_type, quantize_q=c.fp8_math.quantize)
    else:
        kernel = dict(dtype=c.dtype, pack=1 if hopper else group,
                      qkv=(c.q, c.k_cache, c.v_cache) if hopper else None)
    return flash_plan(Call(
        device_id=device_id, q=c.q, nheads_kv=c.info.num_kv_heads, out=c.out,
        lse_shape=lse_shape if c.return_lse else None, num_args=c.num_args,
        out_arg=c.num_args - 1,
        args=args, softmax_scale=softmax_scale, left=c.left, right=c.right,
        num_splits=c.num_splits, features=c.features, softcap=c.softcap, batch=num_seqs,
        max_sq=c.max_seqlen_q, max_sk=capacity, total_q=total_q,
        fields=fields, variant_for=variant_for, **kernel))


def _decode_plan(q, info, block_tables, num_seqs, max_seqlen_q, dtype, features, softcap,
                 softmax_scale, left, right, num_splits, *, cache_strides, lse_shape, out,
                 num_args, kv_layout, alibi_stride_seq) -> Plan:
    """The few-token form (tuning.paged_prefill_form): multi-token decode on the tensor-core
    paged form. num_splits: 0 the decode rule (v1, or v2 partitions that fill the SMs), 1 v1,
    n > 1 v2 with the shortest partition that gives at most n per sequence (1024 tokens
    when none does)."""
    total_q, nheads, head_size = q.shape
    device_id = q.device.id
    if num_seqs > MAX_GRID_YZ:
        raise ValueError(f"q: batch {num_seqs} must be <= {MAX_GRID_YZ} (grid dimensions)")
    gqa = nheads // info.num_kv_heads
    tokens, group = tuning.paged_multi_token(head_size, gqa, max_seqlen_q)
    max_context = block_tables.shape[1] * info.block_size
    slots, outputs, returned_slots, result = returns(
        num_args, [(num_args - 1 if out is not None else None, q.shape, q.dtype)] +
        ([(None, lse_shape, np.float32)] if lse_shape is not None else []))
    out_slot, lse_slot = (returned_slots + (NULL,))[:2]
    align = ((0, 16), (1, 16), (2, 16), (3, 4), (4, 4), (5, 4), (6, 4), (7, 4)) + \
        ((num_args - 1, 16),) * (out is not None)
    common = dict(device_id=device_id, align=align, outputs=outputs, result=result)
    if total_q == 0 or num_seqs == 0:
        return Plan(**common)

    hooks = dict(alibi=bool(features & FEAT_ALIBI), softcap=bool(features & FEAT_SOFTCAP),
                 sinks=bool(features & FEAT_SINKS), nhd=kv_layout == "nhd")
    form = FORMS["mma"]

    def key_for(partition_size):
        return tuning.paged_mma_variant(dtype.short, head_size, info.block_size, group,
                                        partition_size, tokens=tokens, **hooks)
    grid = (nheads // group, num_seqs)
    if num_splits == 0:
        version, partition_size = form.choose("auto", None, grid[0] * num_seqs, max_context,
                                              device_id, key_for(0))
    elif num_splits == 1:
        version, partition_size = "v1", 0
    else:
        version, partition_size = "v2", tuning.paged_split_partition(max_context, num_splits)
    o_row, o_head, _ = A.element_strides_or_contiguous(out, q.shape)
    l_head, l_row = A.element_strides_or_contiguous(None, lse_shape) if lse_shape else (0, 0)
    qs = A.element_strides(q)
    fields = dict(
        q_stride_seq=qs[0], q_stride_head=qs[1], **cache_strides,
        bt_stride_seq=block_tables.strides[0] // 4, scale_log2=softmax_scale * A.LOG2E,
        v_scale=1.0, **scales.fields(scales.NONE, scales.NONE), alibi_stride_seq=alibi_stride_seq,
        **hook_fields(softcap, 1 / A.LOG2E),
        window_left=window_bound(left), window_right=window_bound(right),
        num_seqs=num_seqs, num_heads=nheads, gqa_ratio=gqa,
        max_blocks_per_seq=block_tables.shape[1], out_stride_seq=o_row, out_stride_head=o_head,
        lse_stride_head=l_head, lse_stride_seq=l_row)
    inputs = tuple(slots.arg(i) for i in (0, 1, 2, 3, 4, 6, 7, 5)) + (NULL, NULL)  # (16-bit caches)
    with on_device(device_id):
        v1 = form.v1_launch(key_for(0), max_context, device_id) if version == "v1" else None
        return Plan(**common, **decode_launches(
            form, key_for, version, partition_size, v1, grid=grid, rows=total_q,
            max_context=max_context, sinks=hooks["sinks"],
            slots=(out_slot, lse_slot, slots.scratch(0), slots.scratch(1)) + inputs,
            fields=fields, device_id=device_id))
