"""flash_forward / flash_varlen_forward: the FlashAttention-2 forward pass.

Kernel: cuda_src/flash_fwd.cuh (one template; the variant key instantiates exactly one
configuration). The head dim is compiled rounded up to a multiple of 32 and the tail
columns are zero-filled on load and never stored. Split-KV (``num_splits``) writes fp32
partial outputs into scratch and merges them with the combine kernel of the same header.
Calls go through cuattn._launch: the checks below run once per call signature.

FP8 (FlashAttention-3's conventions): q, k, v of ml_dtypes.float8_e4m3fn run the Hopper
kernel's e4m3 form (sm_90 only), with optional float32 (batch, nheads_kv) descales and a
16-bit output (bfloat16 unless ``out_dtype`` says float16).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import _arrays as A
from . import _tma, tuning
from ._checks import (DESCALES, INT32_MAX, MAX_GRID_YZ, check_cu_seqlens, check_fixed_lengths,
                      check_fp8, check_max_seqlens, check_options, check_qkv)
from ._dtypes import FP8_E4M3
from ._hooks import alibi_stride, check_hooks, hook_fields
from ._launch import (NULL, Launch, Plan, execute, on_device, plan_cache, plan_for,
                      returns)
from .constants import FEAT_SINKS, MASK_CAUSAL, MASK_NONE, MASK_WINDOW
from .jit import device_info, get_kernel
from .keys import FlashFwdSm90Variant
from .param_structs import FLASH_PARAMS, QUANTIZE_PARAMS

_plans = plan_cache()
_FIXED_NAMES = ("q", "k", "v", "alibi_slopes", "sinks") + DESCALES + ("out",)
_VARLEN_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks") + \
    DESCALES + ("out",)


def flash_forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, sinks=None, return_lse=False, num_splits=0,
                  q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                  out=None, stream=None):
    """FlashAttention-2 forward.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    float16 or bfloat16, any strides with a contiguous last dim; or all three
    ml_dtypes.float8_e4m3fn or uint8 bytes of e4m3 values (FP8, sm_90 devices: head dim a
    multiple of 16, strides a
    tensor map describes): their real values are the stored ones times ``q_descale``,
    ``k_descale``, ``v_descale`` (float32 (batch, nheads_kv), default 1; query head h takes
    its KV head's), and out is ``out_dtype`` (float16 or bfloat16, the default; 16-bit
    inputs: their own dtype only). Causal is aligned to the
    bottom-right corner; ``window_size=(left, right)`` limits query i to keys
    i + sk - sq - left <= j <= i + sk - sq + right (-1 = unbounded). ``softcap``,
    ``alibi_slopes`` (float32 (nheads,)) and ``sinks`` (float32 (nheads,)) as
    cuattn._hooks says. Returns out (like q) or (out, lse) with lse float32 (batch, nheads,
    seqlen_q), natural log; a row that sees no key gives zeros and lse = -inf (with sinks:
    zeros and the sink).
    """
    options = (causal, softmax_scale, window_size, softcap, return_lse, num_splits, out_dtype)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (q, k, v, alibi_slopes, sinks, q_descale, k_descale, v_descale, out),
        _FIXED_NAMES, ("fixed",) + options, lambda arrays: _fixed_plan(arrays, *options),
        stream, 3)
    return execute(plan, arrays, stream, ptrs)


def flash_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, sinks=None, return_lse=False, num_splits=0,
                         q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                         out=None, stream=None):
    """FlashAttention-2 forward over packed variable-length sequences.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); cu_seqlens_q/k:
    int32 (batch + 1,) prefix sums on the device (not read by the host: max_seqlen_q/k must
    bound every length); lse: float32 (nheads, total_q). Same options as flash_forward
    (FP8 too: the descales (batch, nheads_kv), batch = len(cu_seqlens_q) - 1); a sequence
    of length 0 is allowed.
    """
    options = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap,
               return_lse, num_splits, out_dtype)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, q_descale,
                 k_descale, v_descale, out), _VARLEN_NAMES,
        ("varlen",) + options, lambda arrays: _varlen_plan(arrays, *options), stream, 5)
    return execute(plan, arrays, stream, ptrs)


def _fixed_plan(arrays, causal, softmax_scale, window_size, softcap, return_lse,
                num_splits, out_dtype) -> Plan:
    q, k, v = arrays[:3]
    doc_q = "(batch, seqlen_q, nheads, headdim)"
    dtype = check_qkv(q, k, v, 4, doc_q, "(batch, seqlen_k, nheads_kv, headdim)", fp8=True)
    batch, sq, nheads, _ = q.shape
    sk = check_fixed_lengths(q, k)
    return _checked_plan(
        arrays, _FIXED_NAMES, dtype, doc_q, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, softcap=softcap, return_lse=return_lse,
        num_splits=num_splits, out_dtype=out_dtype, batch=batch, max_sq=sq, max_sk=sk,
        total_q=batch * sq, lse_shape=(batch, nheads, sq), seqlen_q=sq, seqlen_k=sk)


def _varlen_plan(arrays, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
                 softcap, return_lse, num_splits, out_dtype) -> Plan:
    q, k, v, cu_q, cu_k = arrays[:5]
    doc_q = "(total_q, nheads, headdim)"
    dtype = check_qkv(q, k, v, 3, doc_q, "(total_k, nheads_kv, headdim)", fp8=True)
    total_q, nheads, _ = q.shape
    check_cu_seqlens(cu_q, "cu_seqlens_q")
    check_cu_seqlens(cu_k, "cu_seqlens_k", cu_q.shape[0])
    max_seqlen_q, max_seqlen_k = check_max_seqlens(max_seqlen_q, max_seqlen_k)
    if total_q > INT32_MAX or k.shape[0] > INT32_MAX:
        raise ValueError(f"q: total_q {total_q} must fit in int32")
    # Rows never covered by a sequence (past cu_seqlens_q[-1]) are not written.
    return _checked_plan(
        arrays, _VARLEN_NAMES, dtype, doc_q, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, softcap=softcap, return_lse=return_lse,
        num_splits=num_splits, out_dtype=out_dtype, batch=cu_q.shape[0] - 1,
        max_sq=max_seqlen_q, max_sk=max_seqlen_k, total_q=total_q,
        lse_shape=(nheads, total_q), seqlen_q=max(total_q, 1), seqlen_k=0)


def _checked_plan(arrays, names: tuple, dtype, doc_q: str, *, causal, softmax_scale,
                  window_size, softcap, return_lse, num_splits, out_dtype, batch: int,
                  max_sq: int, max_sk: int, total_q: int, lse_shape: tuple, seqlen_q: int,
                  seqlen_k: int) -> Plan:
    """What the fixed and the varlen forward check alike once their shapes passed (options,
    the cu_seqlens' device, hooks, FP8, out), then their plan. A fixed call's arrays are
    (batch, row, head)-strided, a varlen call's (row, head): its batch strides are 0."""
    a = dict(zip(names, arrays))
    q, k, v, out = a["q"], a["k"], a["v"], a["out"]
    nheads = q.shape[-2]
    softmax_scale, left, right, num_splits, return_lse = check_options(
        causal, softmax_scale, window_size, num_splits, return_lse, q.shape[-1])
    device_id = q.device.id
    A.check_same_device({n: a[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in a},
                        device_id)
    features, softcap = check_hooks(softcap, a["alibi_slopes"], a["sinks"], nheads, device_id,
                                    batch)
    out_type, fp8_fields = check_fp8(dtype, out_dtype, tuple(a[n] for n in DESCALES), batch,
                                     k.shape[-2], device_id, (q, k, v))
    if out is not None:
        A.check_output(out, q.shape, out_type.numpy, "out", doc_q, device_id, align=16)

    def outer(s: tuple) -> tuple:   # the three outer strides, a varlen call's batch 0
        return (0,) * (3 - len(s)) + tuple(s)
    # q / k / v / out: (batch, row, head) of (.., row, head, dim); lse: (batch, head, row)
    fields = {f"{n}_stride_{d}": s for n, x in (("q", q), ("k", k), ("v", v))
              for d, s in zip(("batch", "row", "head"), outer(A.element_strides(x)[:-1]))}
    fields.update(zip(("o_stride_batch", "o_stride_row", "o_stride_head"),
                      outer(A.element_strides_or_contiguous(out, q.shape)[:-1])))
    fields.update(zip(("lse_stride_batch", "lse_stride_head", "lse_stride_row"),
                      outer(A.element_strides_or_contiguous(None, lse_shape))
                      if return_lse else (0, 0, 0)))
    fields.update(seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  alibi_stride_batch=alibi_stride(a["alibi_slopes"]), **fp8_fields)
    return _plan(Call(
        device_id=device_id, dtype=dtype, q=q, nheads_kv=k.shape[-2], out=out,
        lse_shape=lse_shape if return_lse else None, num_args=len(names),
        out_arg=len(names) - 1, args={n: i for i, n in enumerate(names[:-1])},
        out_dtype=out_type, softmax_scale=softmax_scale, left=left, right=right,
        num_splits=num_splits, features=features, softcap=softcap, batch=batch,
        max_sq=max_sq, max_sk=max_sk, total_q=total_q, fields=fields, qkv=(q, k, v)))


# ---- the plan -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """A checked call of the flash kernel (flash_forward, flash_varlen_forward, and
    paged_prefill over a paged cache), as _plan needs it."""
    device_id: int
    dtype: object               # cuattn._dtypes entry of q
    q: object                   # the query array (shape, dtype)
    nheads_kv: int
    out: object                 # the out= argument or None
    lse_shape: tuple | None     # None: no lse returned
    num_args: int               # array arguments of the call; out= is argument out_arg
    out_arg: int
    args: dict                  # params pointer field -> index of the argument holding it
    softmax_scale: float
    left: int                   # the checked window (causal: right 0)
    right: int
    num_splits: int             # 0: the tuning rule's choice
    features: int               # FEAT_* bits
    softcap: float
    batch: int
    max_sq: int
    max_sk: int                 # bounds every sequence's keys
    total_q: int
    fields: dict                # the params fields particular to the call (strides, ...)
    # paged_prefill: ((split, mask kind) -> its kernel variant) and the query heads sharing a
    # block's rows
    variant_for: Callable[[bool, int], object] | None = None
    pack: int = 1
    # (q, k, v) or (q, k_cache, v_cache), which the Hopper kernel may load by TMA
    qkv: tuple | None = None
    out_dtype: object = None    # cuattn._dtypes entry of out (None: dtype's; FP8: 16-bit)
    # FP8 calls of 16-bit queries (paged_prefill's q_scale): quantized into scratch first;
    # qkv's q then describes that e4m3 copy
    quantize_q: "QuantizeQ | None" = None


class QuantizeQ(NamedTuple):
    """16-bit queries the plan quantizes to e4m3 before the FP8 kernel reads them
    (cuda_src/quantize_e4m3.cuh): q / (factor x scales[KV head]), scales the call's argument
    ``arg`` (None: no array), ``stride`` 1 a scale per KV head, 0 one."""
    dtype: object               # cuattn._dtypes entry of q
    factor: float
    arg: int | None
    stride: int


def _mask_and_bounds(left: int, right: int, max_sq: int, max_sk: int) -> tuple[int, int, int]:
    """(mask kind, left, right) for the kernel from a checked window (-1 = unbounded; a
    causal call's is (left, 0)). A side that excludes no key is dropped first, as
    FlashAttention-2 drops it (exact: query i of a sequence sits at p = sk - sq + i, so
    every key j >= p - left once left >= max_sk - 1, and j <= p + right once right >=
    max_sq - 1). Then (-1, 0) is the causal kernel, (-1, -1) the unmasked one and any other
    a window. An unbounded side becomes a bound no row reaches (for the kernels that run
    a causal or unmasked call as a window: tuning.flash_forward_variant)."""
    left = -1 if left >= max_sk - 1 else left
    right = -1 if right >= max_sq - 1 else right
    mask = MASK_WINDOW if left >= 0 or right > 0 else MASK_CAUSAL if right == 0 else MASK_NONE
    unbounded = max_sq + max_sk + 1
    return mask, (unbounded if left < 0 else left), (unbounded if right < 0 else right)


def _plan(c: Call) -> Plan:
    """Variant, grid and split of a checked call; the outputs it allocates; its launches."""
    nheads, head_dim = c.q.shape[-2], c.q.shape[-1]
    mask, window_left, window_right = _mask_and_bounds(c.left, c.right, c.max_sq, c.max_sk)
    grid_y = nheads // c.pack
    if c.batch > MAX_GRID_YZ or grid_y > MAX_GRID_YZ:
        heads = f"nheads {nheads}" if c.pack == 1 else f"nheads_kv {grid_y}"
        raise ValueError(f"q: batch {c.batch} and {heads} must each be <= {MAX_GRID_YZ} "
                         "(grid dimensions)")
    out_type = c.out_dtype or c.dtype
    fp8 = c.dtype is FP8_E4M3
    slots, outputs, returned_slots, result = returns(
        c.num_args, [(c.out_arg if c.out is not None else None, c.q.shape, out_type.numpy)] +
        ([(None, c.lse_shape, np.float32)] if c.lse_shape is not None else []))
    out_slot, lse_slot = (returned_slots + (NULL,))[:2]
    vectors = ("q", "k", "v")
    align = tuple((c.args[n], 16) for n in vectors) + ((c.out_arg, 16),) * (c.out is not None) + \
        tuple((i, 4) for n, i in c.args.items() if n not in vectors)
    common = dict(device_id=c.device_id, align=align, outputs=outputs, result=result)

    device = device_info(c.device_id)
    arch = device.arch
    # (a call with its own variant_for, paged_prefill, made this choice itself)
    tma = c.variant_for is None and c.qkv is not None and \
        (fp8 or tuning.flash_path(arch, head_dim) == "wgmma") and \
        _tma.encodable(c.dtype.short, c.qkv)

    def variant_for(split: bool):
        if c.variant_for is not None:
            return c.variant_for(split, mask)
        return tuning.flash_kernel_variant(c.dtype.short, head_dim, mask=mask, split=split,
                                           arch=arch, features=c.features, tma=tma,
                                           seqlen_q=c.max_sq, out=out_type.short if fp8 else "")
    base = variant_for(False)
    rows = c.max_sq * c.pack
    m_blocks = -(-rows // base.block_m)
    if m_blocks == 0 or c.batch == 0:
        return Plan(**common)
    if fp8 and not tma and c.variant_for is None:
        # (check_fp8 refused bad strides; left: an empty k / v, or the driver)
        raise ValueError("k: float8_e4m3fn inputs are loaded by TMA, and the driver takes no "
                         "tensor map of these arrays (an empty k / v among them: seqlen_k = 0 "
                         "is not supported on the FP8 path)")
    n_key_tiles = -(-c.max_sk // base.block_n)
    num_splits = c.num_splits
    if num_splits == 0:
        # Resident blocks per SM: shared memory, and registers (the kernels use ~230-255
        # registers per thread, so count 255).
        per_sm = max(1, min(device.smem_per_sm // max(base.dynamic_smem_bytes, 1),
                            65536 // (255 * base.num_threads)))
        num_splits = tuning.flash_num_splits(c.batch * grid_y * m_blocks, n_key_tiles,
                                             device.sm_count, per_sm)
    num_splits = max(1, min(num_splits, max(n_key_tiles, 1), MAX_GRID_YZ // c.batch))
    split = num_splits > 1
    variant = base
    scratch, scratch_bytes = (), 0
    if split:
        # Split-KV kernels take the tiles of the masked table (see tuning.flash_tiles);
        # the grid follows their BLOCK_M.
        variant = variant_for(True)
        m_blocks = -(-rows // variant.block_m)
        oaccum_bytes = num_splits * c.total_q * nheads * head_dim * 4   # a multiple of 16
        scratch = (0, oaccum_bytes)
        scratch_bytes = oaccum_bytes + num_splits * nheads * c.total_q * 4
    varlen = "cu_seqlens_q" in c.args
    fetched = isinstance(variant, FlashFwdSm90Variant) and variant.fetches_varlen and varlen
    zeroed = ()
    counter_slot = None
    if fetched:   # the Hopper kernel's tile counter, zeroed before each launch
        counter_at = -(-scratch_bytes // 16) * 16
        scratch, scratch_bytes, zeroed = scratch + (counter_at,), counter_at + 16, (counter_at, 4)
        counter_slot = slots.scratch(len(scratch) - 1)
    slot_of = {n: slots.arg(i) for n, i in c.args.items()}
    slot_of.update(out=out_slot, lse=lse_slot)
    if split:
        slot_of.update(oaccum=slots.scratch(0), lseaccum=slots.scratch(1))
    prologue = ()
    if c.quantize_q is not None:   # the kernel reads e4m3 queries from scratch
        q8_at = -(-scratch_bytes // 256) * 256
        scratch, scratch_bytes = scratch + (q8_at,), q8_at + c.total_q * nheads * head_dim
        q8_slot = slots.scratch(len(scratch) - 1)
        prologue = (_quantize_launch(c, slot_of["q"], q8_slot),)
        slot_of["q"] = q8_slot
    ptr_slots = tuple(slot_of.get(n, NULL) for n in FLASH_PARAMS.pointer_names())
    grid, extra = (m_blocks, grid_y, c.batch * num_splits), None
    if isinstance(variant, FlashFwdSm90Variant):     # its own grid; tensor maps (zeros: cp.async)
        grid = variant.grid(m_blocks, grid_y, c.batch * num_splits, varlen=varlen,
                            sm_count=device.sm_count)
        qkv_slots = (slot_of["q"], slot_of["k"], slot_of["v"])
        extra = _tma.no_maps
        if variant.tma:
            extra = _tma.FlashMaps(c.dtype.short, *c.qkv, qkv_slots, variant.block_n,
                                   counter_slot, kv=variant.kv, head_dim=variant.head_dim)
    fields = dict(k_stride_block=0, v_stride_block=0, k_stride_chunk=8, v_stride_dim=0,
                  bt_stride_seq=0, block_shift=0, max_blocks_per_seq=0, new_keys=0, v_scale=1.0,
                  k_scales_stride=0, v_scales_stride=0, alibi_stride_batch=0,
                  **{f"{n}_stride_{d}": 0 for n in DESCALES for d in ("batch", "head")})
    fields.update(c.fields)
    tail = FLASH_PARAMS.tail(
        batch=c.batch, num_heads=nheads, head_group=nheads // c.nheads_kv, total_q=c.total_q,
        head_dim=head_dim, window_left=window_left, window_right=window_right,
        num_splits=num_splits,
        scale_log2=c.softmax_scale * A.LOG2E, softmax_scale_inv=1.0 / c.softmax_scale,
        m_blocks=m_blocks, **hook_fields(c.softcap, c.softmax_scale), **fields)
    with on_device(c.device_id):
        launches = [Launch(get_kernel(variant, c.device_id), grid,
                           (variant.num_threads,), variant.dynamic_smem_bytes,
                           FLASH_PARAMS.dtype, ptr_slots, tail, extra)]
        if split and c.total_q * nheads > 0:
            combine = tuning.flash_combine_variant(out_type.short, head_dim,
                                                   sinks=bool(c.features & FEAT_SINKS))
            rows_per_block = combine.num_threads // 32
            launches.append(Launch(get_kernel(combine, c.device_id),
                                   (-(-c.total_q * nheads // rows_per_block),),
                                   (combine.num_threads,), 0, FLASH_PARAMS.dtype, ptr_slots,
                                   tail))
    return Plan(**common, scratch=scratch, scratch_bytes=scratch_bytes, scratch_zeroed=zeroed,
                launches=prologue + tuple(launches))


def _quantize_launch(c: Call, q_slot: int, q8_slot: int) -> Launch:
    """The launch that writes c.q (16-bit, pointer slot q_slot) as e4m3 queries (rows x heads
    x head dim, contiguous) into slot q8_slot: c.quantize_q's scale."""
    quant = c.quantize_q
    variant = tuning.quantize_variant(quant.dtype.short)
    _, nheads, head_dim = c.q.shape
    qs = A.element_strides(c.q)
    tail = QUANTIZE_PARAMS.tail(
        x_stride_row=qs[0], x_stride_head=qs[1], out_stride_row=nheads * head_dim,
        out_stride_head=head_dim, scale=quant.factor, num_heads=nheads, head_dim=head_dim,
        head_group=nheads // c.nheads_kv, scales_stride=quant.stride)
    scales = NULL if quant.arg is None else 1 + quant.arg     # (Slots.arg)
    with on_device(c.device_id):
        kernel = get_kernel(variant, c.device_id)
    return Launch(kernel, (c.total_q,), (variant.num_threads,), 0, QUANTIZE_PARAMS.dtype,
                  (q_slot, q8_slot, scales), tail)
