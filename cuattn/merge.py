"""merge_attn_states / merge_states: combine partial attentions by their log-sum-exp.

Kernel: cuda_src/merge_attn_states.cuh. The formula is in its header; empty partial
results (lse = +/-inf) contribute nothing, and all-empty rows give zeros with lse = -inf.
Calls go through cuattn._launch: the checks below run once per call signature.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import tuning
from ._dtypes import activation_dtype
from ._launch import NULL, Launch, Plan, execute, on_device, plan_cache, plan_for, returns
from .jit import get_kernel
from .param_structs import MERGE_PARAMS

MAX_HEAD_SIZE = 512
_pair_plans = plan_cache()
_stack_plans = plan_cache()
_PAIR_NAMES = ("prefix_out", "prefix_lse", "suffix_out", "suffix_lse", "out", "out_lse")
_STACK_NAMES = ("outs", "lses", "out", "out_lse")


def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, *, out=None,
                      out_lse=None, stream=None):
    """Combine two partial attentions over disjoint key sets by their log-sum-exp.

    prefix_out, suffix_out: (num_tokens, nheads, head_size) float16 / bfloat16.
    prefix_lse, suffix_lse: float32 (nheads, num_tokens), natural log; +/-inf = empty.
    Returns (out, lse) shaped like prefix_out and prefix_lse.
    """
    plan, arrays, stream, ptrs = plan_for(
        _pair_plans, (prefix_out, prefix_lse, suffix_out, suffix_lse, out, out_lse), _PAIR_NAMES,
        (), _pair_plan, stream, 4)
    return execute(plan, arrays, stream, ptrs)


def merge_states(outs, lses, *, out=None, out_lse=None, stream=None):
    """Combine k >= 2 partial attentions stacked on a leading axis.

    outs: (k, num_tokens, nheads, head_size) float16 / bfloat16.
    lses: float32 (k, nheads, num_tokens), natural log; +/-inf = empty.
    Returns (out, lse): (num_tokens, nheads, head_size) and (nheads, num_tokens).
    """
    plan, arrays, stream, ptrs = plan_for(
        _stack_plans, (outs, lses, out, out_lse), _STACK_NAMES, (), _stack_plan, stream, 2)
    return execute(plan, arrays, stream, ptrs)


# ---- checks and plans -------------------------------------------------------------------------

def _check_head_size(head_size: int, name: str) -> None:
    if head_size % 8 or not 8 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"{name}: head_size {head_size} is not supported; expected a "
                         f"multiple of 8 from 8 to {MAX_HEAD_SIZE}")


def _check_outputs(out, out_lse, like, num_tokens, num_heads, head_size, device_id):
    if out is not None:
        A.check_output(out, (num_tokens, num_heads, head_size), like.dtype, "out",
                       "(num_tokens, nheads, head_size)", device_id, align=16)
    if out_lse is not None:         # any strides: the kernel reads both
        A.check_output(out_lse, (num_heads, num_tokens), np.float32, "out_lse",
                       "(nheads, num_tokens)", device_id, align=4, last_dim_contiguous=False)


def _plan(variant, device_id, arrays, out_arg, rows, inputs, **fields) -> Plan:
    """The plan of a checked merge: ``inputs`` are the argument indices of (a_out, a_lse,
    b_out, b_lse) (None: null), ``out_arg`` that of out (out_lse follows it)."""
    out, out_lse = arrays[out_arg], arrays[out_arg + 1]
    num_tokens, num_heads, head_size = fields["num_tokens"], fields["num_heads"], variant.head_size
    out_shape, lse_shape = (num_tokens, num_heads, head_size), (num_heads, num_tokens)
    slots, outputs, (out_slot, lse_slot), result = returns(len(arrays), [
        (out_arg if out is not None else None, out_shape, arrays[0].dtype),
        (out_arg + 1 if out_lse is not None else None, lse_shape, np.float32)])
    o_tok, o_head, _ = A.element_strides_or_contiguous(out, out_shape)
    l_head, l_tok = A.element_strides_or_contiguous(out_lse, lse_shape)
    align = tuple((i, a) for i, a in zip(inputs, (16, 4, 16, 4)) if i is not None) + \
        ((out_arg, 16),) * (out is not None) + ((out_arg + 1, 4),) * (out_lse is not None)
    vecs = rows * head_size // 8
    if vecs >= 2**31:
        raise ValueError(f"out: {rows} rows of {head_size} is too large for one merge "
                         "(at most 2^31 16-byte vectors); split the tokens")
    common = dict(device_id=device_id, align=align, outputs=outputs, result=result)
    if vecs == 0:
        return Plan(**common)
    tail = MERGE_PARAMS.tail(out_stride_token=o_tok, out_stride_head=o_head,
                             lse_stride_head=l_head, lse_stride_token=l_tok, **fields)
    ptr_slots = (out_slot, lse_slot) + tuple(NULL if i is None else slots.arg(i) for i in inputs)
    with on_device(device_id):
        kernel = get_kernel(variant, device_id)
    launch = Launch(kernel, (-(-vecs // variant.num_threads),), (variant.num_threads,), 0,
                    MERGE_PARAMS.dtype, ptr_slots, tail)
    return Plan(**common, launches=(launch,))


def _pair_plan(arrays) -> Plan:
    a, la, b, lb, out, out_lse = arrays
    doc = "(num_tokens, nheads, head_size)"
    A.check_ndim(a, 3, "prefix_out", doc)
    A.check_ndim(b, 3, "suffix_out", doc)
    dtype = activation_dtype(a.dtype, "prefix_out")
    A.check_dtype(b, a.dtype, "suffix_out")
    num_tokens, num_heads, head_size = a.shape
    _check_head_size(head_size, "prefix_out")
    A.check_shape(b, a.shape, "suffix_out", doc)
    for name, lse in (("prefix_lse", la), ("suffix_lse", lb)):
        A.check_dtype(lse, np.float32, name)
        A.check_shape(lse, (num_heads, num_tokens), name, "(nheads, num_tokens)")
        A.check_aligned(lse, 4, name)
    for name, x in (("prefix_out", a), ("suffix_out", b)):
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)
    device_id = a.device.id
    A.check_same_device({"suffix_out": b, "prefix_lse": la, "suffix_lse": lb}, device_id)
    _check_outputs(out, out_lse, a, num_tokens, num_heads, head_size, device_id)
    a_tok, a_head, _ = A.element_strides(a)
    b_tok, b_head, _ = A.element_strides(b)
    la_head, la_tok = A.element_strides(la)
    lb_head, lb_tok = A.element_strides(lb)
    return _plan(tuning.merge_variant(dtype.short, head_size, False), device_id, arrays, 4,
                 num_tokens * num_heads, (0, 1, 2, 3),
                 a_stride_token=a_tok, a_stride_head=a_head,
                 a_lse_stride_head=la_head, a_lse_stride_token=la_tok,
                 b_stride_token=b_tok, b_stride_head=b_head,
                 b_lse_stride_head=lb_head, b_lse_stride_token=lb_tok,
                 state_stride=0, lse_state_stride=0,
                 num_states=2, num_tokens=num_tokens, num_heads=num_heads)


def _stack_plan(arrays) -> Plan:
    outs, lses, out, out_lse = arrays
    if outs.ndim != 4:
        raise ValueError(f"outs: expected 4 dimensions (k, num_tokens, nheads, head_size), "
                         f"got shape {tuple(outs.shape)}")
    dtype = activation_dtype(outs.dtype, "outs")
    k, num_tokens, num_heads, head_size = outs.shape
    if k < 1:
        raise ValueError("outs: expected at least one partial result on the leading axis")
    _check_head_size(head_size, "outs")
    A.check_dtype(lses, np.float32, "lses")
    A.check_shape(lses, (k, num_heads, num_tokens), "lses", "(k, nheads, num_tokens)")
    A.check_aligned(lses, 4, "lses")
    A.check_last_dim_contiguous(outs, "outs")
    A.check_aligned(outs, 16, "outs")
    device_id = outs.device.id
    A.check_same_device({"lses": lses}, device_id)
    _check_outputs(out, out_lse, outs, num_tokens, num_heads, head_size, device_id)
    s_state, s_tok, s_head, _ = A.element_strides(outs)
    l_state, l_head, l_tok = A.element_strides(lses)
    return _plan(tuning.merge_variant(dtype.short, head_size, True), device_id, arrays, 2,
                 num_tokens * num_heads, (0, 1, None, None),
                 a_stride_token=s_tok, a_stride_head=s_head,
                 a_lse_stride_head=l_head, a_lse_stride_token=l_tok,
                 b_stride_token=0, b_stride_head=0, b_lse_stride_head=0, b_lse_stride_token=0,
                 state_stride=s_state, lse_state_stride=l_state,
                 num_states=k, num_tokens=num_tokens, num_heads=num_heads)
