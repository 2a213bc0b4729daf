"""flash_backward / flash_varlen_backward: the FlashAttention-2 backward pass.

Kernels: cuda_src/flash_bwd.cuh. Four launches per call: the pre-pass (D = rowsum(dO * O),
lse in log2 units, the dQ workspace zeroed), the main kernel (one block per KV tile: dK and
dV in registers, dQ added in fp32 into the workspace), the dQ convert and, with sinks, their
gradient. Workspace (fp32, one allocation from CuPy's pool on the launch stream):
dq_slices x total_q x nheads x headdim (dQ) + 2 x nheads x total_q (D, lse); dq_slices is 1
unless ``deterministic``. Calls go through cuattn._launch: the checks run once per signature.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import tuning_bwd
from ._hooks import alibi_stride, check_hooks, hook_fields
from ._launch import NULL, Launch, Plan, execute, on_device, plan_cache, plan_for, returns
from ._checks import (INT32_MAX, MAX_GRID_YZ, check_cu_seqlens, check_fixed_lengths,
                      check_max_seqlens, check_options, check_qkv)
from .flash import _mask_and_bounds
from .jit import device_info, get_kernel
from .constants import FEAT_SINKS, MASK_CAUSAL
from .param_structs import FLASH_BWD_PARAMS

_plans = plan_cache()
_FIXED_NAMES = ("dout", "q", "k", "v", "out", "lse", "alibi_slopes", "sinks", "dq", "dk", "dv")
_VARLEN_NAMES = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                 "alibi_slopes", "sinks", "dq", "dk", "dv")


def flash_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                   window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                   deterministic=False, dq=None, dk=None, dv=None, stream=None):
    """FlashAttention-2 backward: the gradients of flash_forward's out with respect to q, k
    and v (and the sinks), given dout = dL/dout.

    dout, out: like q (batch, seqlen_q, nheads, headdim); lse: float32 (batch, nheads,
    seqlen_q) as flash_forward(..., return_lse=True) returned them; the options must be the
    forward call's. Returns (dq, dk, dv): dq like q, dk and dv like k and v (GQA / MQA: each
    KV head's gradient sums its query heads); with sinks, (dq, dk, dv, dsinks), dsinks
    float32 (nheads,). ``dq=``, ``dk=``, ``dv=`` take preallocated outputs (any strides with
    a contiguous last dim). A query row that saw no key contributes nothing and gets dq = 0.
    ``deterministic=True``: bit-identical results from run to run (dQ is added in a fixed
    order; fewer blocks run at once, see docs/api.md).
    """
    options = (causal, softmax_scale, window_size, softcap, deterministic)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (dout, q, k, v, out, lse, alibi_slopes, sinks, dq, dk, dv), _FIXED_NAMES,
        ("fixed",) + options, lambda arrays: _fixed_plan(arrays, *options), stream, 6)
    return execute(plan, arrays, stream, ptrs)


def flash_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, *, causal=False, softmax_scale=None,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                          deterministic=False, dq=None, dk=None, dv=None, stream=None):
    """flash_backward over packed variable-length sequences (flash_varlen_forward's layout):
    dout, out like q (total_q, nheads, headdim); lse float32 (nheads, total_q). Rows past
    cu_seqlens_q[-1] get dq = 0; rows of dk / dv past cu_seqlens_k[-1] are not written."""
    options = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap,
               deterministic)
    plan, arrays, stream, ptrs = plan_for(
        _plans, (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, dq,
                 dk, dv), _VARLEN_NAMES, ("varlen",) + options,
        lambda arrays: _varlen_plan(arrays, *options), stream, 8)
    return execute(plan, arrays, stream, ptrs)


# ---- checks ---------------------------------------------------------------------------------

def _check_lse(lse, shape: tuple, doc: str) -> None:
    A.check_ndim(lse, len(shape), "lse", doc)
    A.check_dtype(lse, np.float32, "lse")
    A.check_shape(lse, shape, "lse", doc)
    A.check_aligned(lse, 4, "lse")


def _check_deterministic(deterministic) -> bool:
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    return bool(deterministic)


def _common_checks(arrays, ndim, doc_q, doc_kv, lse_shape, lse_doc, causal, softmax_scale,
                   window_size, softcap, deterministic):
    """The checks flash_backward and flash_varlen_backward share; -> what _plan needs."""
    dout, q, k, v, out, lse = arrays[:6]
    dtype = check_qkv(q, k, v, ndim, doc_q, doc_kv)
    device_id = q.device.id
    for name, x in (("out", out), ("dout", dout)):     # like q, read in 16-byte vectors
        A.check_output(x, q.shape, q.dtype, name, doc_q, device_id, align=16)
    _check_lse(lse, lse_shape, lse_doc)
    softmax_scale, left, right, _, _ = check_options(causal, softmax_scale, window_size, 0,
                                                      False, q.shape[-1])
    deterministic = _check_deterministic(deterministic)
    A.check_same_device({"lse": lse}, device_id)
    return dtype, softmax_scale, left, right, deterministic, device_id


def _check_grads(dq, dk, dv, q, k, doc_q, doc_kv, device_id) -> None:
    for name, x, ref, doc in (("dq", dq, q, doc_q), ("dk", dk, k, doc_kv), ("dv", dv, k, doc_kv)):
        if x is not None:
            A.check_output(x, ref.shape, ref.dtype, name, doc, device_id, align=16)


def _fixed_plan(arrays, causal, softmax_scale, window_size, softcap, deterministic) -> Plan:
    dout, q, k, v, out, lse, alibi_slopes, sinks, dq, dk, dv = arrays
    doc_q = "(batch, seqlen_q, nheads, headdim)"
    doc_kv = "(batch, seqlen_k, nheads_kv, headdim)"
    A.check_ndim(q, 4, "q", doc_q)
    batch, sq, nheads, _ = q.shape
    dtype, softmax_scale, left, right, deterministic, device_id = _common_checks(
        arrays, 4, doc_q, doc_kv, (batch, nheads, sq), "(batch, nheads, seqlen_q)", causal,
        softmax_scale, window_size, softcap, deterministic)
    sk = check_fixed_lengths(q, k)
    features, softcap = check_hooks(softcap, alibi_slopes, sinks, nheads, device_id, batch)
    _check_grads(dq, dk, dv, q, k, doc_q, doc_kv, device_id)
    fields = _stride_fields(arrays, (dq, dk, dv), varlen=False)
    fields.update(seqlen_q=sq, seqlen_k=sk, alibi_stride_batch=alibi_stride(alibi_slopes))
    return _plan(device_id=device_id, dtype=dtype, q=q, k=k, grads=(dq, dk, dv), batch=batch,
                 max_sq=sq, max_sk=sk, total_q=batch * sq, varlen=False,
                 softmax_scale=softmax_scale, left=left, right=right, softcap=softcap,
                 features=features, deterministic=deterministic, fields=fields,
                 names=_FIXED_NAMES)


def _varlen_plan(arrays, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
                 softcap, deterministic) -> Plan:
    dout, q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks, dq, dk, dv = arrays
    doc_q = "(total_q, nheads, headdim)"
    doc_kv = "(total_k, nheads_kv, headdim)"
    A.check_ndim(q, 3, "q", doc_q)
    total_q, nheads, _ = q.shape
    dtype, softmax_scale, left, right, deterministic, device_id = _common_checks(
        (dout, q, k, v, out, lse), 3, doc_q, doc_kv, (nheads, total_q), "(nheads, total_q)",
        causal, softmax_scale, window_size, softcap, deterministic)
    check_cu_seqlens(cu_q, "cu_seqlens_q")
    check_cu_seqlens(cu_k, "cu_seqlens_k", cu_q.shape[0])
    max_seqlen_q, max_seqlen_k = check_max_seqlens(max_seqlen_q, max_seqlen_k)
    if total_q > INT32_MAX or k.shape[0] > INT32_MAX:
        raise ValueError(f"q: total_q {total_q} must fit in int32")
    A.check_same_device({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, device_id)
    features, softcap = check_hooks(softcap, alibi_slopes, sinks, nheads, device_id,
                                    cu_q.shape[0] - 1)
    _check_grads(dq, dk, dv, q, k, doc_q, doc_kv, device_id)
    fields = _stride_fields((dout, q, k, v, out, lse), (dq, dk, dv), varlen=True)
    fields.update(seqlen_q=max(total_q, 1), seqlen_k=0,
                  alibi_stride_batch=alibi_stride(alibi_slopes))
    return _plan(device_id=device_id, dtype=dtype, q=q, k=k, grads=(dq, dk, dv),
                 batch=cu_q.shape[0] - 1, max_sq=max_seqlen_q, max_sk=max_seqlen_k,
                 total_q=total_q, varlen=True, softmax_scale=softmax_scale, left=left,
                 right=right, softcap=softcap, features=features, deterministic=deterministic,
                 fields=fields, names=_VARLEN_NAMES)


def _stride_fields(arrays, grads, varlen: bool) -> dict:
    """The params' stride fields: (batch, row, head) of every array (varlen: no batch term),
    those of the gradients the call allocates as their contiguous layout."""
    dout, q, k, v, out, lse = arrays[:6]
    fields = {}
    for name, x in dict(q=q, k=k, v=v, o=out, do=dout).items():
        fields.update(_bsh(name, A.element_strides(x), varlen))
    for name, x, ref in (("dq", grads[0], q), ("dk", grads[1], k), ("dv", grads[2], k)):
        fields.update(_bsh(name, A.element_strides_or_contiguous(x, ref.shape), varlen))
    ls = A.element_strides(lse)
    if varlen:     # (nheads, total_q)
        fields.update(lse_stride_batch=0, lse_stride_head=ls[0], lse_stride_row=ls[1])
    else:          # (batch, nheads, seqlen_q)
        fields.update(lse_stride_batch=ls[0], lse_stride_head=ls[1], lse_stride_row=ls[2])
    return fields


def _bsh(name: str, strides: tuple, varlen: bool) -> dict:
    b, r, h = (0,) + tuple(strides[:2]) if varlen else tuple(strides[:3])
    return {f"{name}_stride_batch": b, f"{name}_stride_row": r, f"{name}_stride_head": h}


# ---- the plan -------------------------------------------------------------------------------

def _plan(*, device_id, dtype, q, k, grads, batch, max_sq, max_sk, total_q, varlen,
          softmax_scale, left, right, softcap, features, deterministic, fields, names) -> Plan:
    """Kernels, grids, outputs and workspace of a checked call."""
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_kv = k.shape[-2]
    if batch > MAX_GRID_YZ or nheads_kv > MAX_GRID_YZ:
        raise ValueError(f"q: batch {batch} and nheads_kv {nheads_kv} must each be <= "
                         f"{MAX_GRID_YZ} (grid dimensions)")
    mask, window_left, window_right = _mask_and_bounds(left, right, max_sq, max_sk)
    arg = {n: i for i, n in enumerate(names)}
    sinks = bool(features & FEAT_SINKS)
    returned = [(arg["dq"] if grads[0] is not None else None, q.shape, q.dtype),
                (arg["dk"] if grads[1] is not None else None, k.shape, k.dtype),
                (arg["dv"] if grads[2] is not None else None, k.shape, k.dtype)]
    if sinks:
        returned.append((None, (nheads,), np.float32))
    slots, outputs, returned_slots, result = returns(len(names), returned)
    vectors = ("dout", "q", "k", "v", "out") + tuple(n for n, g in zip(("dq", "dk", "dv"), grads)
                                                      if g is not None)
    align = tuple((arg[n], 16) for n in vectors) + \
        tuple((arg[n], 4) for n in ("lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
                                     "sinks") if n in arg)
    common = dict(device_id=device_id, align=align, outputs=outputs, result=result)

    device = device_info(device_id)
    main = tuning_bwd.flash_bwd_variant(dtype.short, head_dim, mask=mask, arch=device.arch,
                                        features=features)
    prep, convert, dsinks = tuning_bwd.flash_bwd_row_variants(dtype.short, head_dim)
    n_key_tiles = -(-max_sk // main.block_n)
    slices = tuning_bwd.flash_bwd_dq_slices(deterministic, n_key_tiles, batch, nheads_kv,
                                            device.sm_count)
    lpt_group = tuning_bwd.flash_bwd_lpt_group(
        kernel=main, causal=mask == MASK_CAUSAL, varlen=varlen, deterministic=deterministic,
        seqlen_q=max_sq, head_group=nheads // nheads_kv, head_dim=head_dim, elem_bytes=2,
        l2_bytes=device.l2_bytes)
    rows = total_q * nheads
    # workspace: dq_accum | dsum | lse2, each part 16-byte aligned
    dq_bytes = slices * rows * head_dim * 4
    row_bytes = -(-rows * 4 // 16) * 16
    scratch = (0, dq_bytes, dq_bytes + row_bytes)
    scratch_bytes = max(dq_bytes + 2 * row_bytes, 16)

    slot_of = {n: slots.arg(i) for n, i in arg.items()}
    slot_of.update(dq=returned_slots[0], dk=returned_slots[1], dv=returned_slots[2],
                   dq_accum=slots.scratch(0), dsum=slots.scratch(1), lse2=slots.scratch(2))
    if sinks:
        slot_of["dsinks"] = returned_slots[3]
    ptr_slots = tuple(slot_of.get(n, NULL) for n in FLASH_BWD_PARAMS.pointer_names())
    tail = FLASH_BWD_PARAMS.tail(
        batch=batch, num_heads=nheads, head_group=nheads // nheads_kv, total_q=total_q,
        head_dim=head_dim, window_left=window_left, window_right=window_right,
        dq_slices=slices, deterministic=int(deterministic), lpt_group=lpt_group,
        scale_log2=softmax_scale * A.LOG2E, softmax_scale=softmax_scale,
        softmax_scale_inv=1.0 / softmax_scale, **hook_fields(softcap, softmax_scale), **fields)

    launches = []
    with on_device(device_id):
        def launch(variant, grid):
            launches.append(Launch(get_kernel(variant, device_id), grid, (variant.num_threads,),
                                   variant.dynamic_smem_bytes, FLASH_BWD_PARAMS.dtype, ptr_slots,
                                   tail))
        row_blocks = -(-rows // (prep.threads // 32))
        if rows:
            launch(prep, (row_blocks,))
        if max_sk and batch:
            launch(main, (slices if deterministic else n_key_tiles, nheads_kv, batch))
        if rows:
            launch(convert, (row_blocks,))
        if sinks:
            launch(dsinks, (nheads,))
    return Plan(**common, scratch=scratch, scratch_bytes=scratch_bytes, launches=tuple(launches))
