"""merge_attn_states / merge_states: combine partial attentions by their log-sum-exp.

Kernel: cuda_src/merge_attn_states.cuh. The formula is in its header; empty partial
results (lse = +/-inf) contribute nothing, and all-empty rows give zeros with lse = -inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cupy
import numpy as np

from . import _arrays as A
from ._dtypes import activation_dtype
from .jit import ParamsStruct, Variant, get_kernel
from .tuning import MERGE_NUM_THREADS

PARAMS = ParamsStruct("MergeParams", [
    ("out", "ptr"), ("out_lse", "ptr"),
    ("a_out", "ptr"), ("a_lse", "ptr"), ("b_out", "ptr"), ("b_lse", "ptr"),
    ("out_stride_token", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_token", "i64"),
    ("a_stride_token", "i64"), ("a_stride_head", "i64"),
    ("a_lse_stride_head", "i64"), ("a_lse_stride_token", "i64"),
    ("b_stride_token", "i64"), ("b_stride_head", "i64"),
    ("b_lse_stride_head", "i64"), ("b_lse_stride_token", "i64"),
    ("state_stride", "i64"), ("lse_state_stride", "i64"),
    ("num_states", "i32"), ("num_tokens", "i32"), ("num_heads", "i32"),
])

MAX_HEAD_SIZE = 512


@dataclass(frozen=True)
class MergeVariant(Variant):
    dtype: str          # short dtype name (f16 / bf16)
    head_size: int
    stacked: bool       # k states on a leading axis (merge_states) vs two arrays
    num_threads: int = MERGE_NUM_THREADS

    op: ClassVar[str] = "merge"
    header: ClassVar[str] = "merge_attn_states.cuh"
    kernel_template: ClassVar[str] = "merge_attn_states_kernel"
    params: ClassVar[ParamsStruct] = PARAMS

    def name_parts(self):
        return (self.dtype, f"hd{self.head_size}", "stack" if self.stacked else "pair",
                f"t{self.num_threads}")

    def template_args(self):
        from ._dtypes import BY_SHORT
        return (BY_SHORT[self.dtype].cpp, self.head_size, self.num_threads, self.stacked)


def shipped_variants() -> list[MergeVariant]:
    from .tuning import MERGE_SHIPPED_HEAD_SIZES
    return [MergeVariant(dt, hs, stacked)
            for dt in ("f16", "bf16") for hs in MERGE_SHIPPED_HEAD_SIZES
            for stacked in (False, True)]


def _check_out(x, name, shape_doc):
    x = A.as_device_array(x, name)
    if x.ndim != 3:
        raise ValueError(f"{name}: expected 3 dimensions {shape_doc}, got shape {tuple(x.shape)}")
    return x


def _check_head_size(head_size: int, name: str) -> None:
    if head_size % 8 or not 8 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"{name}: head_size {head_size} is not supported; expected a "
                         f"multiple of 8 from 8 to {MAX_HEAD_SIZE}")


def _outputs(out, out_lse, like, num_tokens, num_heads, head_size):
    shape = (num_tokens, num_heads, head_size)
    if out is None:
        out = cupy.empty(shape, dtype=like.dtype)
    else:
        out = A.as_device_array(out, "out")
        A.check_shape(out, shape, "out", "(num_tokens, nheads, head_size)")
        A.check_dtype(out, like.dtype, "out")
        A.check_last_dim_contiguous(out, "out")
        A.check_aligned(out, 16, "out")
    if out_lse is None:
        out_lse = cupy.empty((num_heads, num_tokens), dtype=np.float32)
    else:
        out_lse = A.as_device_array(out_lse, "out_lse")
        A.check_shape(out_lse, (num_heads, num_tokens), "out_lse", "(nheads, num_tokens)")
        A.check_dtype(out_lse, np.float32, "out_lse")
        A.check_aligned(out_lse, 4, "out_lse")
    return out, out_lse


def _launch(variant, device_id, stream, out, out_lse, rows, **fields):
    kernel = get_kernel(variant, device_id)
    o_tok, o_head, _ = A.element_strides(out)
    l_head, l_tok = A.element_strides(out_lse)
    params = PARAMS.pack(out=out.data.ptr, out_lse=out_lse.data.ptr,
                         out_stride_token=o_tok, out_stride_head=o_head,
                         lse_stride_head=l_head, lse_stride_token=l_tok, **fields)
    vecs = rows * variant.head_size // 8
    if vecs >= 2**31:
        raise ValueError(f"out: {rows} rows of {variant.head_size} is too large for one merge "
                         "(at most 2^31 16-byte vectors); split the tokens")
    grid = ((vecs + variant.num_threads - 1) // variant.num_threads,)
    if grid[0]:
        kernel(grid, (variant.num_threads,), (params,), stream=stream)


def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, *, out=None,
                      out_lse=None, stream=None):
    """Combine two partial attentions over disjoint key sets by their log-sum-exp.

    prefix_out, suffix_out: (num_tokens, nheads, head_size) float16 / bfloat16.
    prefix_lse, suffix_lse: float32 (nheads, num_tokens), natural log; +/-inf = empty.
    Returns (out, lse) shaped like prefix_out and prefix_lse.
    """
    doc = "(num_tokens, nheads, head_size)"
    a = _check_out(prefix_out, "prefix_out", doc)
    b = _check_out(suffix_out, "suffix_out", doc)
    la = A.as_device_array(prefix_lse, "prefix_lse")
    lb = A.as_device_array(suffix_lse, "suffix_lse")
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
    stream = A.resolve_stream(stream)
    with cupy.cuda.Device(device_id):
        out, out_lse = _outputs(out, out_lse, a, num_tokens, num_heads, head_size)
        A.check_same_device({"out": out, "out_lse": out_lse}, device_id)
        a_tok, a_head, _ = A.element_strides(a)
        b_tok, b_head, _ = A.element_strides(b)
        la_head, la_tok = A.element_strides(la)
        lb_head, lb_tok = A.element_strides(lb)
        _launch(MergeVariant(dtype.short, head_size, False), device_id, stream, out, out_lse,
                num_tokens * num_heads,
                a_out=a.data.ptr, a_lse=la.data.ptr, b_out=b.data.ptr, b_lse=lb.data.ptr,
                a_stride_token=a_tok, a_stride_head=a_head,
                a_lse_stride_head=la_head, a_lse_stride_token=la_tok,
                b_stride_token=b_tok, b_stride_head=b_head,
                b_lse_stride_head=lb_head, b_lse_stride_token=lb_tok,
                state_stride=0, lse_state_stride=0,
                num_states=2, num_tokens=num_tokens, num_heads=num_heads)
    return out, out_lse


def merge_states(outs, lses, *, out=None, out_lse=None, stream=None):
    """Combine k >= 2 partial attentions stacked on a leading axis.

    outs: (k, num_tokens, nheads, head_size) float16 / bfloat16.
    lses: float32 (k, nheads, num_tokens), natural log; +/-inf = empty.
    Returns (out, lse): (num_tokens, nheads, head_size) and (nheads, num_tokens).
    """
    outs = A.as_device_array(outs, "outs")
    lses = A.as_device_array(lses, "lses")
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
    stream = A.resolve_stream(stream)
    with cupy.cuda.Device(device_id):
        out, out_lse = _outputs(out, out_lse, outs, num_tokens, num_heads, head_size)
        A.check_same_device({"out": out, "out_lse": out_lse}, device_id)
        s_state, s_tok, s_head, _ = A.element_strides(outs)
        l_state, l_head, l_tok = A.element_strides(lses)
        _launch(MergeVariant(dtype.short, head_size, True), device_id, stream, out, out_lse,
                num_tokens * num_heads,
                a_out=outs.data.ptr, a_lse=lses.data.ptr, b_out=0, b_lse=0,
                a_stride_token=s_tok, a_stride_head=s_head,
                a_lse_stride_head=l_head, a_lse_stride_token=l_tok,
                b_stride_token=0, b_stride_head=0, b_lse_stride_head=0, b_lse_stride_token=0,
                state_stride=s_state, lse_state_stride=l_state,
                num_states=k, num_tokens=num_tokens, num_heads=num_heads)
    return out, out_lse
