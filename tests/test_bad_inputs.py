"""Bad inputs: every public function, every argument (issue 5).

One table. A row: (function, builder of the function's small valid kwargs, id, mutation,
exception, argument): the mutated call must raise the exception with a message that starts
with "<argument>:". test_bad_input (GPU) runs each row on real CuPy arrays and then proves
the device still works: a small valid call of the same function and a device synchronise.

The checks read only shapes, strides, dtypes, addresses and devices, so without a GPU
test_bad_input_without_a_device runs the same rows on shape-only CuPy arrays: arrays over
an address that nothing reads (there is no device to read it). Rows whose check needs the
device itself (its shared memory, a loaded kernel) are GPU-only (flag DEVICE).
"""
from __future__ import annotations

import contextlib
import inspect
import math
import re
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np
import pytest

import cuattn

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
DEVICE = "device"          # the check needs the GPU: not run on shape-only arrays
TWO_GPUS = "two GPUs"      # real arrays need a second GPU (shape-only ones claim device 1)
_FAKE_ADDRESS = 0x7F00_0000_0000   # 256-byte aligned; shape-only arrays point here


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class Arrays:
    """A row's arrays: real CuPy arrays (GPU) or shape-only ones (no GPU)."""

    def __init__(self, real: bool):
        self.real = real

    def zeros(self, shape, dtype, *, offset=0, device=0, strided=False, broadcast=False):
        """Zeros ``offset`` bytes past an aligned address, on ``device``. ``strided``: the
        last dimension has a stride of 2 elements; ``broadcast``: every other dimension has
        stride 0 (a huge shape over a small buffer)."""
        import cupy
        dtype = np.dtype(dtype)
        full = tuple(shape[:-1]) + (2 * shape[-1],) if strided else tuple(shape)
        nbytes = (full[-1] if broadcast else math.prod(full)) * dtype.itemsize + offset
        if self.real:
            with cupy.cuda.Device(device):
                ptr = cupy.zeros(max(nbytes, 1), np.uint8).data + offset
        else:
            mem = cupy.cuda.UnownedMemory(_FAKE_ADDRESS, max(nbytes, 1), None, device_id=device)
            ptr = cupy.cuda.MemoryPointer(mem, offset)
        strides = (0,) * (len(full) - 1) + (dtype.itemsize,) if broadcast else None
        x = cupy.ndarray(full, dtype, memptr=ptr, strides=strides)
        return x[..., ::2] if strided else x

    def array(self, host: np.ndarray):
        """``host`` on the device (a shape-only array has its shape and dtype only)."""
        import cupy
        return cupy.asarray(host) if self.real else self.zeros(host.shape, host.dtype)


class _HostDLPack:
    """A DLPack exporter whose data lives on the host (kDLCPU)."""

    def __dlpack__(self, stream=None):
        raise AssertionError("a host DLPack array must be refused before it is exported")

    def __dlpack_device__(self):
        return (1, 0)


# -- valid calls: small shapes, so that every kernel is compiled once --------------------------

_RNG = np.random.default_rng(0)
KSHAPE, VSHAPE = cuattn.paged_kv_cache_shapes(4, 2, 128, 16, BF16)   # (4, 2, 16, 16, 8)


def _randn(mk, shape, dtype):
    return mk.array(_RNG.standard_normal(shape).astype(dtype))


def flash_kwargs(mk):
    return dict(q=_randn(mk, (1, 16, 2, 64), F16), k=_randn(mk, (1, 16, 2, 64), F16),
                v=_randn(mk, (1, 16, 2, 64), F16))


def varlen_kwargs(mk):
    cu = np.array([0, 7, 16], np.int32)
    return dict(q=_randn(mk, (16, 2, 64), F16), k=_randn(mk, (16, 2, 64), F16),
                v=_randn(mk, (16, 2, 64), F16), cu_seqlens_q=mk.array(cu),
                cu_seqlens_k=mk.array(cu), max_seqlen_q=9, max_seqlen_k=9)


def bwd_kwargs(mk):
    """flash_backward's small valid call: the forward's arrays, out, dout and lse."""
    kw = flash_kwargs(mk)
    return dict(dout=_randn(mk, (1, 16, 2, 64), F16), **kw,
                out=_randn(mk, (1, 16, 2, 64), F16), lse=_randn(mk, (1, 2, 16), np.float32))


def bwd_varlen_kwargs(mk):
    kw = varlen_kwargs(mk)
    return dict(dout=_randn(mk, (16, 2, 64), F16), q=kw.pop("q"), k=kw.pop("k"), v=kw.pop("v"),
                out=_randn(mk, (16, 2, 64), F16), lse=_randn(mk, (2, 16), np.float32), **kw)


def merge_kwargs(mk):
    return dict(prefix_out=_randn(mk, (16, 2, 64), BF16),
                prefix_lse=_randn(mk, (2, 16), np.float32),
                suffix_out=_randn(mk, (16, 2, 64), BF16),
                suffix_lse=_randn(mk, (2, 16), np.float32))


def merge_states_kwargs(mk):
    return dict(outs=_randn(mk, (3, 16, 2, 64), BF16), lses=_randn(mk, (3, 2, 16), np.float32))


def with_outputs(valid):
    """``valid`` with out= and out_lse= given (merge allocates a missing one before it
    checks the devices of both)."""
    return lambda mk: {**valid(mk), "out": mk.zeros((16, 2, 64), BF16),
                       "out_lse": mk.zeros((2, 16), np.float32)}


def paged_kwargs(mk):
    return dict(q=_randn(mk, (2, 4, 128), BF16), k_cache=_randn(mk, KSHAPE, BF16),
                v_cache=_randn(mk, VSHAPE, BF16),
                block_tables=mk.array(np.array([[0, 1], [2, 3]], np.int32)),
                seq_lens=mk.array(np.array([20, 5], np.int32)))


def reshape_kwargs(mk):
    return dict(key=_randn(mk, (3, 2, 128), BF16), value=_randn(mk, (3, 2, 128), BF16),
                k_cache=_randn(mk, KSHAPE, BF16), v_cache=_randn(mk, VSHAPE, BF16),
                slot_mapping=mk.array(np.array([0, 17, 40], np.int32)))


def prefill_kwargs(mk):
    return dict(q=_randn(mk, (6, 4, 128), BF16), k_cache=_randn(mk, KSHAPE, BF16),
                v_cache=_randn(mk, VSHAPE, BF16),
                block_tables=mk.array(np.array([[0, 1], [2, 3]], np.int32)),
                seq_lens=mk.array(np.array([20, 5], np.int32)),
                cu_seqlens_q=mk.array(np.array([0, 4, 6], np.int32)), max_seqlen_q=4)


NHD_SHAPE = cuattn.paged_kv_cache_shapes(4, 2, 128, 16, BF16, kv_layout="nhd")[0]


def nhd(**more):
    """prefill_kwargs with NHD caches (and ``more``)."""
    return lambda kw, mk: {**kw, "kv_layout": "nhd", "k_cache": mk.zeros(NHD_SHAPE, BF16),
                           "v_cache": mk.zeros(NHD_SHAPE, BF16),
                           **{n: (b(mk) if callable(b) else b) for n, b in more.items()}}


def nhd_sized(head_size, block_size=16, cache=BF16, act=("q",), tokens=2):
    """NHD caches of ``cache`` elements, ``block_size`` tokens a block and ``head_size``, and
    the activations ``act`` (each (tokens, 4 or 2 heads, head_size)) to match."""
    def row(kw, mk):
        shape = (4, block_size, 2, head_size)
        acts = {n: mk.zeros((tokens, 4 if n == "q" else 2, head_size), BF16) for n in act}
        return {**kw, "kv_layout": "nhd", "k_cache": mk.zeros(shape, cache),
                "v_cache": mk.zeros(shape, cache), **acts}
    return row


def _fp8_nhd(block_size, fp8_q=False, **more):
    """prefill_kwargs over NHD fp8 caches of ``block_size`` tokens a block (q e4m3 with
    fp8_q), and ``more``."""
    def row(kw, mk):
        shape = (4, block_size, 2, 128)
        q = {"q": mk.zeros((6, 4, 128), FP8)} if fp8_q else {}
        return {**kw, **q, "kv_layout": "nhd", "k_cache": mk.zeros(shape, FP8),
                "v_cache": mk.zeros(shape, FP8),
                **{n: (b(mk) if callable(b) else b) for n, b in more.items()}}
    return row


def hook_rows(nheads, vectors=("alibi_slopes", "sinks")):
    """Rows of softcap and ``vectors`` for a function with ``nheads`` query heads."""
    rows = [("softcap-negative", put(softcap=-1.0), ValueError, "softcap"),
            ("softcap-nan", put(softcap=NAN), ValueError, "softcap"),
            ("softcap-inf", put(softcap=INF), ValueError, "softcap"),
            ("softcap-str", put(softcap="30"), TypeError, "softcap"),
            ("softcap-bool", put(softcap=True), TypeError, "softcap"),
            ("softcap-None", put(softcap=None), TypeError, "softcap")]
    for name in vectors:
        rows += [(f"{name}-numpy", put(**{name: np.zeros(nheads, np.float32)}), TypeError, name),
                 (f"{name}-list", put(**{name: [0.0] * nheads}), TypeError, name),
                 (f"{name}-f16", new(name, shape=(nheads,), dtype=F16), TypeError, name),
                 (f"{name}-float64", new(name, shape=(nheads,), dtype=np.float64), TypeError,
                  name),
                 (f"{name}-length", new(name, shape=(nheads + 1,), dtype=np.float32),
                  ValueError, name),
                 (f"{name}-rank2", new(name, shape=(nheads, 1), dtype=np.float32), ValueError,
                  name),
                 (f"{name}-strided", new(name, shape=(nheads,), dtype=np.float32,
                                         strided=True), ValueError, name),
                 (f"{name}-misaligned", new(name, shape=(nheads,), dtype=np.float32, offset=2),
                  ValueError, name),
                 (f"{name}-other-device", new(name, shape=(nheads,), dtype=np.float32,
                                              device=1), ValueError, name, TWO_GPUS)]
    if "alibi_slopes" in vectors:     # (nheads,) or (batch, nheads)
        rows.append(("alibi_slopes-rank3", new("alibi_slopes", shape=(1, 1, nheads),
                                               dtype=np.float32), ValueError, "alibi_slopes"))
    return rows


def slope_rows(batch, nheads):
    """Rows of (batch, nheads) ALiBi slopes for a call of ``batch`` sequences."""
    return [("alibi_slopes-batch-rows", new("alibi_slopes", shape=(batch + 1, nheads),
                                            dtype=np.float32), ValueError, "alibi_slopes"),
            ("alibi_slopes-batch-strided", new("alibi_slopes", shape=(batch, nheads),
                                               dtype=np.float32, strided=True), ValueError,
             "alibi_slopes"),
            ("alibi_slopes-batch-f16", new("alibi_slopes", shape=(batch, nheads), dtype=F16),
             TypeError, "alibi_slopes")]


def scale_rows(nheads_kv=2):
    """Rows of k_scale / v_scale given as device arrays (cuattn.paged.scales), for a call
    with ``nheads_kv`` KV heads (checked for 16-bit caches too)."""
    return [("k_scale-device-f16", new("k_scale", shape=(), dtype=F16), TypeError, "k_scale"),
            ("k_scale-device-float64", new("k_scale", shape=(nheads_kv,), dtype=np.float64),
             TypeError, "k_scale"),
            ("k_scale-device-length", new("k_scale", shape=(nheads_kv + 1,), dtype=np.float32),
             ValueError, "k_scale"),
            ("k_scale-device-rank2", new("k_scale", shape=(nheads_kv, 1), dtype=np.float32),
             ValueError, "k_scale"),
            ("v_scale-device-strided", new("v_scale", shape=(nheads_kv,), dtype=np.float32,
                                           strided=True), ValueError, "v_scale"),
            ("v_scale-device-misaligned", new("v_scale", shape=(nheads_kv,), dtype=np.float32,
                                              offset=2), ValueError, "v_scale"),
            ("k_scale-numpy-array", put(k_scale=np.ones(nheads_kv, np.float32)), TypeError,
             "k_scale"),
            ("v_scale-list", put(v_scale=[1.0] * nheads_kv), TypeError, "v_scale"),
            ("v_scale-other-device", new("v_scale", shape=(), dtype=np.float32, device=1),
             ValueError, "v_scale", TWO_GPUS)]


def flashinfer_kwargs(mk):
    return dict(kv_indptr=mk.array(np.array([0, 2, 3], np.int32)),
                kv_indices=mk.array(np.array([3, 0, 1], np.int32)),
                kv_last_page_len=mk.array(np.array([5, 16], np.int32)),
                page_size=16, max_blocks_per_seq=4)


def shapes_kwargs(mk):
    return dict(num_blocks=4, nheads_kv=2, head_size=128, block_size=16, dtype=BF16)


# -- mutations: (kwargs, Arrays) -> bad kwargs ---------------------------------------------------

def put(**values):
    """These arguments take these values."""
    return lambda kw, mk: {**kw, **values}


def make(**builders):
    """These arguments take ``builder(mk)``."""
    return lambda kw, mk: {**kw, **{n: b(mk) for n, b in builders.items()}}


def new(*names, like=None, shape=None, dtype=None, **layout):
    """Each named argument becomes zeros like itself (or like argument ``like``) but with
    this shape, dtype or layout (Arrays.zeros' offset / device / strided / broadcast)."""
    def mutate(kw, mk):
        out = dict(kw)
        for n in names:
            ref = kw.get(like or n)
            out[n] = mk.zeros(ref.shape if shape is None else shape,
                              ref.dtype if dtype is None else dtype, **layout)
        return out
    return mutate


def types(*names, like=None, required=True):
    """A NumPy array (same shape and dtype), a list, and None where the argument is required,
    in place of each named device array."""
    def host(n):
        return lambda kw, mk: {**kw, n: np.zeros(kw[like or n].shape, kw[like or n].dtype)}

    def as_list(n):
        return lambda kw, mk: {**kw, n: np.zeros(kw[like or n].shape).tolist()}
    rows = []
    for n in names:
        rows += [(f"{n}-numpy", host(n), TypeError, n), (f"{n}-list", as_list(n), TypeError, n)]
        if required:
            rows.append((f"{n}-None", put(**{n: None}), TypeError, n))
    return rows


def elsewhere(*names, like=None):
    """Each named argument on device 1, the others on device 0."""
    return [(f"{n}-other-device", new(n, like=like, device=1), ValueError, n, TWO_GPUS)
            for n in names]


# -- the table -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    fn: Callable
    valid: Callable          # Arrays -> kwargs of a small valid call
    id: str
    mutate: Callable         # (kwargs, Arrays) -> the bad kwargs
    exc: type
    arg: str                 # the message starts with "<arg>:"
    flags: tuple = ()        # DEVICE, TWO_GPUS


def table(fn, valid, *entries):
    return [Row(fn, valid, *e[:4], flags=e[4:]) for e in entries]


def padded(shape, dtype, pad):
    """A view whose outer strides are ``pad`` elements longer than its rows."""
    return lambda mk: mk.zeros(shape[:-1] + (shape[-1] + pad,), dtype)[..., :shape[-1]]


def fp8_option_rows():
    """The descales and out_dtype of a 16-bit call: FP8 options, refused by name."""
    return [(f"{name}-16-bit-inputs", make(**{name: lambda mk: mk.zeros((1, 2), np.float32)}),
             ValueError, name) for name in ("q_descale", "k_descale", "v_descale")] + \
        [("out_dtype-float32", put(out_dtype=np.float32), ValueError, "out_dtype"),
         ("out_dtype-other-16-bit", put(out_dtype=BF16), ValueError, "out_dtype")]


NAN, INF = float("nan"), float("inf")
ROWS: list[Row] = []

ROWS += table(
    cuattn.flash_forward, flash_kwargs,
    # wrong types
    *types("q", "k", "v"),
    # hooks: softcap >= 0, alibi_slopes / sinks float32 (nheads,)
    *hook_rows(2), *slope_rows(1, 2),
    ("q-scalar", put(q=1.0), TypeError, "q"),
    ("q-host-dlpack", put(q=_HostDLPack()), TypeError, "q"),
    # dtypes: q float16 / bfloat16, k and v like q
    ("q-float32", new("q", "k", "v", dtype=np.float32), TypeError, "q"),
    ("q-float64", new("q", dtype=np.float64), TypeError, "q"),
    ("q-int16", new("q", dtype=np.int16), TypeError, "q"),
    ("k-bf16", new("k", dtype=BF16), TypeError, "k"),
    ("v-float32", new("v", dtype=np.float32), TypeError, "v"),
    # ranks and shapes: head dim a multiple of 8 up to 256; batch, heads, head dim agree
    ("q-rank3", new("q", shape=(16, 2, 64)), ValueError, "q"),
    ("k-rank5", new("k", shape=(1, 1, 16, 2, 64)), ValueError, "k"),
    ("v-rank3", new("v", shape=(16, 2, 64)), ValueError, "v"),
    ("headdim-12", new("q", "k", "v", shape=(1, 16, 2, 12)), ValueError, "q"),
    ("headdim-264", new("q", "k", "v", shape=(1, 16, 2, 264)), ValueError, "q"),
    ("k-headdim-differs", new("k", "v", shape=(1, 16, 2, 32)), ValueError, "k"),
    ("k-batch-differs", new("k", "v", shape=(2, 16, 2, 64)), ValueError, "k"),
    ("k-heads-not-a-divisor", new("k", "v", shape=(1, 16, 3, 64)), ValueError, "k"),
    ("k-no-heads", new("k", "v", shape=(1, 16, 0, 64)), ValueError, "k"),
    ("q-no-heads", new("q", shape=(1, 16, 0, 64)), ValueError, "q"),
    ("v-seqlen-differs", new("v", shape=(1, 8, 2, 64)), ValueError, "v"),
    ("v-heads-differ", new("v", shape=(1, 16, 1, 64)), ValueError, "v"),
    ("q-seqlen-2**29", new("q", shape=(1, 2**29, 2, 64), broadcast=True), ValueError, "q"),
    ("q-batch-65536", new("q", "k", "v", shape=(65536, 1, 2, 64), broadcast=True),
     ValueError, "q", DEVICE),
    # layouts: contiguous last dimension, 16-byte aligned base and outer strides
    ("q-strided", new("q", strided=True), ValueError, "q"),
    ("k-strided", new("k", strided=True), ValueError, "k"),
    ("v-strided", new("v", strided=True), ValueError, "v"),
    ("q-misaligned", new("q", offset=2), ValueError, "q"),
    ("k-misaligned", new("k", offset=8), ValueError, "k"),
    ("v-misaligned", new("v", offset=2), ValueError, "v"),
    ("q-row-stride-misaligned", make(q=padded((1, 16, 2, 64), F16, 4)), ValueError, "q"),
    # scalars
    ("causal-str", put(causal="yes"), TypeError, "causal"),
    ("causal-None", put(causal=None), TypeError, "causal"),
    ("softmax_scale-nan", put(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("softmax_scale-inf", put(softmax_scale=INF), ValueError, "softmax_scale"),
    ("softmax_scale-0", put(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("softmax_scale-negative", put(softmax_scale=-0.125), ValueError, "softmax_scale"),
    ("softmax_scale-inf-in-float32", put(softmax_scale=1e39), ValueError, "softmax_scale"),
    ("softmax_scale-str", put(softmax_scale="big"), TypeError, "softmax_scale"),
    ("window_size-left-below-minus-1", put(window_size=(-2, 0)), ValueError, "window_size"),
    ("window_size-right-below-minus-1", put(window_size=(0, -5)), ValueError, "window_size"),
    ("window_size-int", put(window_size=3), TypeError, "window_size"),
    ("window_size-triple", put(window_size=(1, 2, 3)), TypeError, "window_size"),
    ("window_size-None", put(window_size=None), TypeError, "window_size"),
    ("window_size-float", put(window_size=(1.5, 0)), TypeError, "window_size"),
    ("window_size-str", put(window_size="12"), TypeError, "window_size"),
    ("num_splits-negative", put(num_splits=-1), ValueError, "num_splits"),
    ("num_splits-float", put(num_splits=1.5), TypeError, "num_splits"),
    ("num_splits-bool", put(num_splits=True), TypeError, "num_splits"),
    ("num_splits-None", put(num_splits=None), TypeError, "num_splits"),
    ("stream-str", put(stream="default"), TypeError, "stream"),
    ("stream-float", put(stream=1.5), TypeError, "stream"),
    # out=: q's shape and dtype, contiguous last dimension, 16-byte aligned
    *types("out", like="q", required=False),
    ("out-shape", new("out", like="q", shape=(1, 16, 2, 32)), ValueError, "out"),
    ("out-rank", new("out", like="q", shape=(16, 2, 64)), ValueError, "out"),
    ("out-bf16", new("out", like="q", dtype=BF16), TypeError, "out"),
    ("out-float32", new("out", like="q", dtype=np.float32), TypeError, "out"),
    ("out-strided", new("out", like="q", strided=True), ValueError, "out"),
    ("out-misaligned", new("out", like="q", offset=2), ValueError, "out"),
    # FP8 options on 16-bit inputs (FP8 calls' own: tests/test_flash_fp8.py)
    *fp8_option_rows(),
    # devices
    *elsewhere("k", "v"), *elsewhere("out", like="q"),
)

ROWS += table(
    cuattn.flash_varlen_forward, varlen_kwargs,
    # wrong types
    *types("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
    *hook_rows(2), *slope_rows(2, 2),
    # q, k, v: as flash_forward, one rank less
    ("q-float32", new("q", dtype=np.float32), TypeError, "q"),
    ("v-bf16", new("v", dtype=BF16), TypeError, "v"),
    ("q-rank4", new("q", shape=(1, 16, 2, 64)), ValueError, "q"),
    ("k-rank2", new("k", shape=(16, 128)), ValueError, "k"),
    ("headdim-12", new("q", "k", "v", shape=(16, 2, 12)), ValueError, "q"),
    ("k-heads-not-a-divisor", new("k", "v", shape=(16, 3, 64)), ValueError, "k"),
    ("v-total_k-differs", new("v", shape=(15, 2, 64)), ValueError, "v"),
    ("q-strided", new("q", strided=True), ValueError, "q"),
    ("k-misaligned", new("k", offset=2), ValueError, "k"),
    # cu_seqlens: int32 (batch + 1,), contiguous, 4-byte aligned, the same length
    ("cu_seqlens_q-int64", new("cu_seqlens_q", dtype=np.int64), TypeError, "cu_seqlens_q"),
    ("cu_seqlens_k-int64", new("cu_seqlens_k", dtype=np.int64), TypeError, "cu_seqlens_k"),
    ("cu_seqlens_q-float32", new("cu_seqlens_q", dtype=np.float32), TypeError, "cu_seqlens_q"),
    ("cu_seqlens_q-rank2", new("cu_seqlens_q", shape=(3, 1)), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q-empty", new("cu_seqlens_q", shape=(0,)), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k-length-differs", new("cu_seqlens_k", shape=(4,)), ValueError, "cu_seqlens_k"),
    ("cu_seqlens_q-strided", new("cu_seqlens_q", strided=True), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k-strided", new("cu_seqlens_k", strided=True), ValueError, "cu_seqlens_k"),
    ("cu_seqlens_q-misaligned", new("cu_seqlens_q", offset=2), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k-misaligned", new("cu_seqlens_k", offset=1), ValueError, "cu_seqlens_k"),
    # max_seqlen: ints, 0 <= n < 2**29
    ("max_seqlen_q-float", put(max_seqlen_q=9.0), TypeError, "max_seqlen_q"),
    ("max_seqlen_q-None", put(max_seqlen_q=None), TypeError, "max_seqlen_q"),
    ("max_seqlen_q-bool", put(max_seqlen_q=True), TypeError, "max_seqlen_q"),
    ("max_seqlen_q-negative", put(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("max_seqlen_k-2**29", put(max_seqlen_k=2**29), ValueError, "max_seqlen_k"),
    ("max_seqlen_k-str", put(max_seqlen_k="9"), TypeError, "max_seqlen_k"),
    # options and out= (the checks of flash_forward)
    ("causal-int", put(causal=1), TypeError, "causal"),
    ("softmax_scale-nan", put(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("window_size-malformed", put(window_size=(0,)), TypeError, "window_size"),
    ("num_splits-negative", put(num_splits=-3), ValueError, "num_splits"),
    ("stream-str", put(stream="default"), TypeError, "stream"),
    *types("out", like="q", required=False),
    ("out-shape", new("out", like="q", shape=(15, 2, 64)), ValueError, "out"),
    ("out-bf16", new("out", like="q", dtype=BF16), TypeError, "out"),
    ("out-strided", new("out", like="q", strided=True), ValueError, "out"),
    ("out-misaligned", new("out", like="q", offset=4), ValueError, "out"),
    *fp8_option_rows(),
    # devices
    *elsewhere("k", "v", "cu_seqlens_q", "cu_seqlens_k"), *elsewhere("out", like="q"),
)

ROWS += table(
    cuattn.merge_attn_states, merge_kwargs,
    # wrong types
    *types("prefix_out", "prefix_lse", "suffix_out", "suffix_lse"),
    # dtypes: 16-bit outputs of one dtype, float32 lse
    ("prefix_out-float32", new("prefix_out", "suffix_out", dtype=np.float32), TypeError,
     "prefix_out"),
    ("prefix_out-int16", new("prefix_out", dtype=np.int16), TypeError, "prefix_out"),
    ("suffix_out-f16", new("suffix_out", dtype=F16), TypeError, "suffix_out"),
    ("prefix_lse-float16", new("prefix_lse", dtype=F16), TypeError, "prefix_lse"),
    ("prefix_lse-float64", new("prefix_lse", dtype=np.float64), TypeError, "prefix_lse"),
    ("suffix_lse-bf16", new("suffix_lse", dtype=BF16), TypeError, "suffix_lse"),
    # ranks and shapes: (num_tokens, nheads, head_size) alike, lse (nheads, num_tokens)
    ("prefix_out-rank2", new("prefix_out", shape=(16, 128)), ValueError, "prefix_out"),
    ("prefix_out-rank4", new("prefix_out", shape=(1, 16, 2, 64)), ValueError, "prefix_out"),
    ("suffix_out-rank4", new("suffix_out", shape=(1, 16, 2, 64)), ValueError, "suffix_out"),
    ("head_size-12", new("prefix_out", "suffix_out", shape=(16, 2, 12)), ValueError,
     "prefix_out"),
    ("head_size-520", new("prefix_out", "suffix_out", shape=(16, 2, 520)), ValueError,
     "prefix_out"),
    ("suffix_out-tokens-differ", new("suffix_out", shape=(15, 2, 64)), ValueError, "suffix_out"),
    ("suffix_out-heads-differ", new("suffix_out", shape=(16, 1, 64)), ValueError, "suffix_out"),
    ("suffix_out-head_size-differs", new("suffix_out", shape=(16, 2, 32)), ValueError,
     "suffix_out"),
    ("prefix_lse-transposed", new("prefix_lse", shape=(16, 2)), ValueError, "prefix_lse"),
    ("prefix_lse-heads-differ", new("prefix_lse", shape=(3, 16)), ValueError, "prefix_lse"),
    ("suffix_lse-rank1", new("suffix_lse", shape=(32,)), ValueError, "suffix_lse"),
    # layouts: outputs 16-byte aligned with a contiguous last dimension; lse 4-byte aligned
    ("prefix_out-strided", new("prefix_out", strided=True), ValueError, "prefix_out"),
    ("suffix_out-strided", new("suffix_out", strided=True), ValueError, "suffix_out"),
    ("prefix_out-misaligned", new("prefix_out", offset=2), ValueError, "prefix_out"),
    ("suffix_out-misaligned", new("suffix_out", offset=8), ValueError, "suffix_out"),
    ("prefix_out-row-stride-misaligned", make(prefix_out=padded((16, 2, 64), BF16, 4)),
     ValueError, "prefix_out"),
    ("prefix_lse-misaligned", new("prefix_lse", offset=2), ValueError, "prefix_lse"),
    ("suffix_lse-misaligned", new("suffix_lse", offset=1), ValueError, "suffix_lse"),
    ("stream-str", put(stream="default"), TypeError, "stream"),
    # out= and out_lse=
    *types("out", like="prefix_out", required=False),
    ("out-shape", new("out", like="prefix_out", shape=(16, 2, 32)), ValueError, "out"),
    ("out-rank", new("out", like="prefix_out", shape=(16, 128)), ValueError, "out"),
    ("out-f16", new("out", like="prefix_out", dtype=F16), TypeError, "out"),
    ("out-strided", new("out", like="prefix_out", strided=True), ValueError, "out"),
    ("out-misaligned", new("out", like="prefix_out", offset=2), ValueError, "out"),
    # devices
    *elsewhere("suffix_out", "prefix_lse", "suffix_lse"),
)

ROWS += table(
    cuattn.merge_attn_states, with_outputs(merge_kwargs),
    # out_lse=: float32 (nheads, num_tokens), 4-byte aligned; the outputs' devices
    *types("out_lse", like="prefix_lse", required=False),
    ("out_lse-transposed", new("out_lse", like="prefix_lse", shape=(16, 2)), ValueError,
     "out_lse"),
    ("out_lse-float64", new("out_lse", like="prefix_lse", dtype=np.float64), TypeError,
     "out_lse"),
    ("out_lse-misaligned", new("out_lse", like="prefix_lse", offset=2), ValueError, "out_lse"),
    *elsewhere("out", "out_lse"),
)

_OUT, _OUT_LSE = dict(shape=(16, 2, 64), dtype=BF16), dict(shape=(2, 16), dtype=np.float32)
ROWS += table(
    cuattn.merge_states, merge_states_kwargs,
    # wrong types
    *types("outs", "lses"),
    ("out-numpy", put(out=np.zeros((16, 2, 64), BF16)), TypeError, "out"),
    ("out-list", put(out=np.zeros((16, 2, 64)).tolist()), TypeError, "out"),
    # outs (k, num_tokens, nheads, head_size) 16-bit; lses float32 (k, nheads, num_tokens)
    ("outs-float32", new("outs", dtype=np.float32), TypeError, "outs"),
    ("outs-int16", new("outs", dtype=np.int16), TypeError, "outs"),
    ("lses-float16", new("lses", dtype=F16), TypeError, "lses"),
    ("lses-float64", new("lses", dtype=np.float64), TypeError, "lses"),
    ("outs-rank3", new("outs", shape=(16, 2, 64)), ValueError, "outs"),
    ("outs-rank5", new("outs", shape=(1, 3, 16, 2, 64)), ValueError, "outs"),
    ("outs-no-states", new("outs", shape=(0, 16, 2, 64)), ValueError, "outs"),
    ("outs-head_size-12", new("outs", shape=(3, 16, 2, 12)), ValueError, "outs"),
    ("lses-states-differ", new("lses", shape=(2, 2, 16)), ValueError, "lses"),
    ("lses-heads-differ", new("lses", shape=(3, 1, 16)), ValueError, "lses"),
    ("lses-rank2", new("lses", shape=(2, 16)), ValueError, "lses"),
    # layouts
    ("outs-strided", new("outs", strided=True), ValueError, "outs"),
    ("outs-misaligned", new("outs", offset=2), ValueError, "outs"),
    ("outs-row-stride-misaligned", make(outs=padded((3, 16, 2, 64), BF16, 4)), ValueError,
     "outs"),
    ("lses-misaligned", new("lses", offset=2), ValueError, "lses"),
    ("stream-str", put(stream="default"), TypeError, "stream"),
    # out= and out_lse=
    ("out-shape", new("out", shape=(15, 2, 64), dtype=BF16), ValueError, "out"),
    ("out-f16", new("out", shape=(16, 2, 64), dtype=F16), TypeError, "out"),
    ("out-strided", new("out", **_OUT, strided=True), ValueError, "out"),
    ("out-misaligned", new("out", **_OUT, offset=2), ValueError, "out"),
    # devices
    *elsewhere("lses"),
)

ROWS += table(
    cuattn.merge_states, with_outputs(merge_states_kwargs),
    # out_lse=: float32 (nheads, num_tokens), 4-byte aligned; the outputs' devices
    ("out_lse-numpy", put(out_lse=np.zeros((2, 16), np.float32)), TypeError, "out_lse"),
    ("out_lse-shape", new("out_lse", shape=(16, 2), dtype=np.float32), ValueError, "out_lse"),
    ("out_lse-float16", new("out_lse", shape=(2, 16), dtype=F16), TypeError, "out_lse"),
    ("out_lse-misaligned", new("out_lse", **_OUT_LSE, offset=2), ValueError, "out_lse"),
    *elsewhere("out", "out_lse"),
)

_ALIBI = dict(shape=(4,), dtype=np.float32)
_FP8_KSHAPE, _FP8_VSHAPE = cuattn.paged_kv_cache_shapes(4, 2, 128, 16, np.uint8)
ROWS += table(
    cuattn.paged_attention, paged_kwargs,
    # wrong types
    *types("q", "k_cache", "v_cache", "block_tables", "seq_lens"),
    # hooks, windows, layouts
    *hook_rows(4, vectors=("sinks",)),
    ("window_size-one", put(window_size=(3,)), TypeError, "window_size"),
    ("window_size-float", put(window_size=(3.0, 0)), TypeError, "window_size"),
    ("window_size--2", put(window_size=(-2, 0)), ValueError, "window_size"),
    ("kv_layout-hnd", put(kv_layout="hnd"), ValueError, "kv_layout"),
    ("nhd-with-vllm-caches", put(kv_layout="nhd"), ValueError, "k_cache"),
    # NHD fp8 caches run on the flash form, which loads q and stores out in 16-byte vectors
    ("nhd-fp8-q-misaligned", lambda kw, mk: {**kw, "kv_layout": "nhd",
                                             "q": mk.zeros((2, 4, 128), BF16, offset=2),
                                             "k_cache": mk.zeros((4, 16, 2, 128), np.uint8),
                                             "v_cache": mk.zeros((4, 16, 2, 128), np.uint8)},
     ValueError, "q"),
    ("nhd-fp8-out-misaligned", lambda kw, mk: {**kw, "kv_layout": "nhd",
                                               "out": mk.zeros((2, 4, 128), BF16, offset=2),
                                               "k_cache": mk.zeros((4, 16, 2, 128), np.uint8),
                                               "v_cache": mk.zeros((4, 16, 2, 128), np.uint8)},
     ValueError, "out"),
    ("nhd-fp8-block_tables-huge", lambda kw, mk: {
        **kw, "kv_layout": "nhd", "k_cache": mk.zeros((4, 16, 2, 128), np.uint8),
        "v_cache": mk.zeros((4, 16, 2, 128), np.uint8),
        "block_tables": mk.zeros((2, 2**25), np.int32, broadcast=True)},
     ValueError, "block_tables"),
    ("nhd-block_size-48", lambda kw, mk: {**kw, "kv_layout": "nhd",
                                          "k_cache": mk.zeros((4, 48, 2, 128), BF16),
                                          "v_cache": mk.zeros((4, 48, 2, 128), BF16)},
     ValueError, "k_cache"),
    # an fp8 token row of head size 120 is not whole 16-byte vectors
    ("nhd-fp8-head_size-120", lambda kw, mk: {**kw, "kv_layout": "nhd",
                                              "q": mk.zeros((2, 4, 120), BF16),
                                              "k_cache": mk.zeros((4, 16, 2, 120), np.uint8),
                                              "v_cache": mk.zeros((4, 16, 2, 120), np.uint8)},
     ValueError, "k_cache"),
    *types("out", like="q", required=False),
    ("alibi_slopes-numpy", put(alibi_slopes=np.zeros(4, np.float32)), TypeError, "alibi_slopes"),
    ("alibi_slopes-list", put(alibi_slopes=[0.0] * 4), TypeError, "alibi_slopes"),
    # q: float16 / bfloat16 (num_seqs, nheads, head_size), a supported head size,
    # nheads a multiple of the caches' nheads_kv, last dimension contiguous
    ("q-float32", new("q", dtype=np.float32), TypeError, "q"),
    ("q-float64", new("q", dtype=np.float64), TypeError, "q"),
    ("q-int16", new("q", dtype=np.int16), TypeError, "q"),
    ("q-rank2", new("q", shape=(2, 512)), ValueError, "q"),
    ("q-rank4", new("q", shape=(1, 2, 4, 128)), ValueError, "q"),
    ("q-head_size-100", new("q", shape=(2, 4, 100)), ValueError, "q"),
    ("q-head_size-136", new("q", shape=(2, 4, 136)), ValueError, "q"),
    # decode keeps its head sizes (paged_prefill's others: docs/api.md, Cache layouts)
    ("q-head_size-8", new("q", shape=(2, 4, 8)), ValueError, "q"),
    ("q-head_size-40", new("q", shape=(2, 4, 40)), ValueError, "q"),
    ("nhd-q-head_size-32", nhd_sized(32), ValueError, "q"),
    ("nhd-block_size-1024", nhd_sized(128, 1024), ValueError, "k_cache"),
    ("q-heads-not-a-multiple", new("q", shape=(2, 3, 128)), ValueError, "q"),
    ("q-num_seqs-65536", new("q", shape=(65536, 4, 128), broadcast=True), ValueError, "q"),
    ("q-strided", new("q", strided=True), ValueError, "q"),
    # caches: q's dtype or fp8 (uint8), vLLM layouts, head and block sizes supported
    ("k_cache-float32", new("k_cache", "v_cache", dtype=np.float32), TypeError, "k_cache"),
    ("k_cache-f16", new("k_cache", "v_cache", dtype=F16), TypeError, "k_cache"),
    ("k_cache-int16", new("k_cache", "v_cache", dtype=np.int16), TypeError, "k_cache"),
    ("v_cache-f16", new("v_cache", dtype=F16), TypeError, "v_cache"),
    ("v_cache-uint8", new("v_cache", dtype=np.uint8), TypeError, "v_cache"),
    ("k_cache-rank4", new("k_cache", shape=(4, 2, 128, 16)), ValueError, "k_cache"),
    ("v_cache-rank5", new("v_cache", shape=KSHAPE), ValueError, "v_cache"),
    ("k_cache-x-4", new("k_cache", shape=(4, 2, 32, 16, 4)), ValueError, "k_cache"),
    ("k_cache-uint8-x-8", new("k_cache", "v_cache", dtype=np.uint8), ValueError, "k_cache"),
    ("k_cache-head_size-differs", new("k_cache", shape=(4, 2, 8, 16, 8)), ValueError, "k_cache"),
    ("block_size-64", new("k_cache", shape=(4, 2, 16, 64, 8)), ValueError, "k_cache"),
    ("block_size-4", new("k_cache", shape=(4, 2, 16, 4, 8)), ValueError, "k_cache"),
    ("v_cache-heads-differ", new("v_cache", shape=(4, 1, 128, 16)), ValueError, "v_cache"),
    ("v_cache-block_size-differs", new("v_cache", shape=(4, 2, 128, 8)), ValueError, "v_cache"),
    ("v_cache-blocks-differ", new("v_cache", shape=(3, 2, 128, 16)), ValueError, "v_cache"),
    ("k_cache-strided", new("k_cache", strided=True), ValueError, "k_cache"),
    ("v_cache-strided", new("v_cache", strided=True), ValueError, "v_cache"),
    ("k_cache-misaligned", new("k_cache", offset=2), ValueError, "k_cache"),
    ("v_cache-misaligned", new("v_cache", offset=2), ValueError, "v_cache"),
    # block_tables: int32 (num_seqs, max_blocks_per_seq); v1 needs its logits in shared memory
    ("block_tables-int64", new("block_tables", dtype=np.int64), TypeError, "block_tables"),
    ("block_tables-float32", new("block_tables", dtype=np.float32), TypeError, "block_tables"),
    ("block_tables-uint32", new("block_tables", dtype=np.uint32), TypeError, "block_tables"),
    ("block_tables-rank1", new("block_tables", shape=(2,)), ValueError, "block_tables"),
    ("block_tables-rows", new("block_tables", shape=(3, 2)), ValueError, "block_tables"),
    ("block_tables-strided", new("block_tables", strided=True), ValueError, "block_tables"),
    ("v1-too-long-for-shared-memory",       # (fp8: the CUDA-core kernel, which keeps logits)
     lambda kw, mk: {**new("block_tables", shape=(2, 20000))(kw, mk), "version": "v1",
                     "k_cache": mk.zeros(_FP8_KSHAPE, np.uint8),
                     "v_cache": mk.zeros(_FP8_VSHAPE, np.uint8)},
     ValueError, "block_tables", DEVICE),
    # seq_lens: int32 (num_seqs,)
    ("seq_lens-int64", new("seq_lens", dtype=np.int64), TypeError, "seq_lens"),
    ("seq_lens-float32", new("seq_lens", dtype=np.float32), TypeError, "seq_lens"),
    ("seq_lens-length", new("seq_lens", shape=(3,)), ValueError, "seq_lens"),
    ("seq_lens-rank2", new("seq_lens", shape=(2, 1)), ValueError, "seq_lens"),
    ("seq_lens-strided", new("seq_lens", strided=True), ValueError, "seq_lens"),
    # alibi_slopes: float32 (nheads,)
    ("alibi_slopes-f16", new("alibi_slopes", shape=(4,), dtype=F16), TypeError, "alibi_slopes"),
    ("alibi_slopes-float64", new("alibi_slopes", shape=(4,), dtype=np.float64), TypeError,
     "alibi_slopes"),
    ("alibi_slopes-length", new("alibi_slopes", shape=(3,), dtype=np.float32), ValueError,
     "alibi_slopes"),
    ("alibi_slopes-rank2", new("alibi_slopes", shape=(4, 1), dtype=np.float32), ValueError,
     "alibi_slopes"),
    ("alibi_slopes-strided", new("alibi_slopes", **_ALIBI, strided=True), ValueError,
     "alibi_slopes"),
    ("alibi_slopes-misaligned", new("alibi_slopes", **_ALIBI, offset=2), ValueError,
     "alibi_slopes"),
    ("block_tables-misaligned", new("block_tables", offset=2), ValueError, "block_tables"),
    ("seq_lens-misaligned", new("seq_lens", offset=1), ValueError, "seq_lens"),
    ("q-no-heads", new("q", shape=(2, 0, 128)), ValueError, "q"),
    # scalars
    ("softmax_scale-inf-in-float32", put(softmax_scale=1e39), ValueError, "softmax_scale"),
    ("softmax_scale-nan", put(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("softmax_scale-minus-inf", put(softmax_scale=-INF), ValueError, "softmax_scale"),
    ("softmax_scale-str", put(softmax_scale="big"), TypeError, "softmax_scale"),
    ("k_scale-0", put(k_scale=0.0), ValueError, "k_scale"),
    ("k_scale-negative", put(k_scale=-1.0), ValueError, "k_scale"),
    ("k_scale-nan", put(k_scale=NAN), ValueError, "k_scale"),
    ("k_scale-inf", put(k_scale=INF), ValueError, "k_scale"),
    ("k_scale-str", put(k_scale="one"), TypeError, "k_scale"),
    ("v_scale-0", put(v_scale=0), ValueError, "v_scale"),
    ("v_scale-None", put(v_scale=None), TypeError, "v_scale"),
    *scale_rows(), *slope_rows(2, 4),
    ("version-v3", put(version="v3"), ValueError, "version"),
    ("version-int", put(version=2), ValueError, "version"),
    ("version-None", put(version=None), ValueError, "version"),
    ("partition_size-500", put(partition_size=500), ValueError, "partition_size"),
    ("partition_size-0", put(partition_size=0), ValueError, "partition_size"),
    ("partition_size-str", put(partition_size="512"), ValueError, "partition_size"),
    ("partition_size-bool", put(partition_size=True), ValueError, "partition_size"),
    ("stream-str", put(stream="default"), TypeError, "stream", DEVICE),  # after the kernels load
    # out=: q's shape and dtype, contiguous last dimension
    ("out-shape", new("out", like="q", shape=(1, 4, 128)), ValueError, "out"),
    ("out-f16", new("out", like="q", dtype=F16), TypeError, "out"),
    ("out-float32", new("out", like="q", dtype=np.float32), TypeError, "out"),
    ("out-strided", new("out", like="q", strided=True), ValueError, "out"),
    # devices
    *elsewhere("k_cache", "v_cache", "block_tables", "seq_lens"), *elsewhere("out", like="q"),
    ("alibi_slopes-other-device", new("alibi_slopes", **_ALIBI, device=1), ValueError,
     "alibi_slopes", TWO_GPUS),
)

ROWS += table(
    cuattn.paged_prefill, prefill_kwargs,
    # wrong types
    *types("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q"),
    *types("out", like="q", required=False),
    *hook_rows(4), *scale_rows(), *slope_rows(2, 4),
    # q: float16 / bfloat16 (total_q, nheads, head_size), a paged head size, nheads a
    # multiple of nheads_kv, last dimension contiguous, 16-byte rows
    ("q-float32", new("q", dtype=np.float32), TypeError, "q"),
    ("q-rank4", new("q", shape=(1, 6, 4, 128)), ValueError, "q"),
    ("q-head_size-100", new("q", shape=(6, 4, 100)), ValueError, "q"),
    ("q-head_size-12", new("q", shape=(6, 4, 12)), ValueError, "q"),
    ("q-head_size-264", new("q", shape=(6, 4, 264)), ValueError, "q"),
    ("q-head_size-0", new("q", shape=(6, 4, 0)), ValueError, "q"),
    ("q-heads-not-a-multiple", new("q", shape=(6, 3, 128)), ValueError, "q"),
    ("q-no-heads", new("q", shape=(6, 0, 128)), ValueError, "q"),
    ("q-strided", new("q", strided=True), ValueError, "q"),
    ("q-misaligned", new("q", offset=2), ValueError, "q"),
    ("q-row-stride-misaligned", make(q=padded((6, 4, 128), BF16, 4)), ValueError, "q"),
    # caches: the query's dtype or fp8 (both alike), in kv_layout's shapes
    ("k_cache-f16", new("k_cache", "v_cache", dtype=F16), TypeError, "k_cache"),
    ("v_cache-f16", new("v_cache", dtype=F16), TypeError, "v_cache"),
    ("v_cache-bf16-with-fp8-k", make(k_cache=lambda mk: mk.zeros(_FP8_KSHAPE, np.uint8)),
     TypeError, "v_cache"),
    ("k_scale-0-fp8", lambda kw, mk: {**kw, "k_cache": mk.zeros(_FP8_KSHAPE, np.uint8),
                                      "v_cache": mk.zeros(_FP8_VSHAPE, np.uint8),
                                      "k_scale": 0.0}, ValueError, "k_scale"),
    ("k_cache-rank4-vllm", new("k_cache", shape=NHD_SHAPE), ValueError, "k_cache"),
    ("block_size-64", new("k_cache", shape=(4, 2, 16, 64, 8)), ValueError, "k_cache"),
    ("kv_layout-hnd", put(kv_layout="hnd"), ValueError, "kv_layout"),
    ("kv_layout-int", put(kv_layout=1), ValueError, "kv_layout"),
    ("kv_layout-None", put(kv_layout=None), ValueError, "kv_layout"),
    ("nhd-k_cache-rank5", nhd(k_cache=lambda mk: mk.zeros(KSHAPE, BF16)), ValueError, "k_cache"),
    ("nhd-block_size-48", nhd(k_cache=lambda mk: mk.zeros((4, 48, 2, 128), BF16),
                              v_cache=lambda mk: mk.zeros((4, 48, 2, 128), BF16)),
     ValueError, "k_cache"),
    ("nhd-head_size-differs", nhd(k_cache=lambda mk: mk.zeros((4, 16, 2, 64), BF16),
                                  v_cache=lambda mk: mk.zeros((4, 16, 2, 64), BF16)),
     ValueError, "k_cache"),
    ("nhd-v_cache-shape", nhd(v_cache=lambda mk: mk.zeros((4, 16, 1, 128), BF16)), ValueError,
     "v_cache"),
    ("nhd-v_cache-dtype", nhd(v_cache=lambda mk: mk.zeros(NHD_SHAPE, F16)), TypeError,
     "v_cache"),
    ("nhd-k_cache-row-stride", nhd(k_cache=padded(NHD_SHAPE, BF16, 4)), ValueError, "k_cache"),
    ("nhd-v_cache-strided", nhd(v_cache=lambda mk: mk.zeros(NHD_SHAPE, BF16, strided=True)),
     ValueError, "v_cache"),
    ("nhd-k_cache-misaligned", nhd(k_cache=lambda mk: mk.zeros(NHD_SHAPE, BF16, offset=2)),
     ValueError, "k_cache"),
    # NHD: blocks of up to 512 tokens; fp8 rows of whole 16-byte vectors (head sizes 16 x n)
    ("nhd-block_size-1024", nhd_sized(40, 1024, tokens=6), ValueError, "k_cache"),
    ("nhd-fp8-head_size-40", nhd_sized(40, cache=np.uint8, tokens=6), ValueError, "k_cache"),
    ("nhd-fp8-head_size-8", nhd_sized(8, cache=np.uint8, tokens=6), ValueError, "k_cache"),
    # vLLM's fp8 K: chunks of x = 16 elements
    ("fp8-k_cache-head_size-40", lambda kw, mk: {
        **kw, "q": mk.zeros((6, 4, 40), BF16), "k_cache": mk.zeros((4, 2, 2, 16, 16), np.uint8),
        "v_cache": mk.zeros((4, 2, 32, 16), np.uint8)}, ValueError, "k_cache"),
    # FP8 math: q_scale (a scale like k_scale, checked for 16-bit caches too) quantizes a
    # 16-bit q, q_descale ((num_seqs, nheads_kv) float32) goes with an e4m3 q, over NHD fp8
    # caches of blocks of >= 8 tokens
    ("q_scale-0", put(q_scale=0.0), ValueError, "q_scale"),
    ("q_scale-list", put(q_scale=[1.0]), TypeError, "q_scale"),
    ("q_scale-device-length", new("q_scale", shape=(3,), dtype=np.float32), ValueError,
     "q_scale"),
    ("q_scale-device-float64", new("q_scale", shape=(), dtype=np.float64), TypeError,
     "q_scale"),
    ("q_descale-16-bit-q", new("q_descale", shape=(2, 2), dtype=np.float32), ValueError,
     "q_descale"),
    ("q_scale-vllm-fp8", lambda kw, mk: {**kw, "k_cache": mk.zeros(_FP8_KSHAPE, np.uint8),
                                         "v_cache": mk.zeros(_FP8_VSHAPE, np.uint8),
                                         "q_scale": 1.0}, ValueError, "q_scale"),
    ("q_scale-nhd-fp8-block-4", _fp8_nhd(4, q_scale=1.0), ValueError, "q_scale"),
    ("q-e4m3-with-q_scale", _fp8_nhd(16, fp8_q=True, q_scale=1.0), ValueError, "q_scale"),
    ("q-e4m3-bf16-caches", make(q=lambda mk: mk.zeros((6, 4, 128), FP8)), TypeError,
     "k_cache"),
    ("q_descale-shape", _fp8_nhd(16, fp8_q=True, q_descale=lambda mk: mk.zeros(
        (2, 4), np.float32)), ValueError, "q_descale"),
    ("q_descale-float16", _fp8_nhd(16, fp8_q=True, q_descale=lambda mk: mk.zeros(
        (2, 2), F16)), TypeError, "q_descale"),
    ("out-e4m3-q-float32", _fp8_nhd(16, fp8_q=True, out=lambda mk: mk.zeros(
        (6, 4, 128), np.float32)), ValueError, "out"),
    # the tables: int32, one row / entry per sequence (cu_seqlens_q has num_seqs + 1)
    ("block_tables-int64", new("block_tables", dtype=np.int64), TypeError, "block_tables"),
    ("block_tables-rows", new("block_tables", shape=(3, 2)), ValueError, "block_tables"),
    ("block_tables-rank1", new("block_tables", shape=(2,)), ValueError, "block_tables"),
    ("block_tables-strided", new("block_tables", strided=True), ValueError, "block_tables"),
    ("block_tables-huge", new("block_tables", shape=(2, 2**25), broadcast=True), ValueError,
     "block_tables"),
    ("seq_lens-int64", new("seq_lens", dtype=np.int64), TypeError, "seq_lens"),
    ("seq_lens-length", new("seq_lens", shape=(3,)), ValueError, "seq_lens"),
    ("seq_lens-misaligned", new("seq_lens", offset=1), ValueError, "seq_lens"),
    ("cu_seqlens_q-int64", new("cu_seqlens_q", dtype=np.int64), TypeError, "cu_seqlens_q"),
    ("cu_seqlens_q-rank2", new("cu_seqlens_q", shape=(3, 1)), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q-empty", new("cu_seqlens_q", shape=(0,)), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_q-strided", new("cu_seqlens_q", strided=True), ValueError, "cu_seqlens_q"),
    # scalars
    ("max_seqlen_q-float", put(max_seqlen_q=4.0), TypeError, "max_seqlen_q"),
    ("max_seqlen_q-bool", put(max_seqlen_q=True), TypeError, "max_seqlen_q"),
    ("max_seqlen_q-negative", put(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("max_seqlen_q-2**29", put(max_seqlen_q=2**29), ValueError, "max_seqlen_q"),
    ("causal-str", put(causal="yes"), TypeError, "causal"),
    ("window_size-one", put(window_size=(3,)), TypeError, "window_size"),
    ("window_size--2", put(window_size=(-2, 0)), ValueError, "window_size"),
    ("softmax_scale-nan", put(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("k_scale-0", put(k_scale=0.0), ValueError, "k_scale"),
    ("v_scale-None", put(v_scale=None), TypeError, "v_scale"),
    ("num_splits-negative", put(num_splits=-1), ValueError, "num_splits"),
    ("num_splits-str", put(num_splits="2"), TypeError, "num_splits"),
    ("stream-str", put(stream="default"), TypeError, "stream", DEVICE),
    # out=: q's shape and dtype, 16-byte rows
    ("out-shape", new("out", like="q", shape=(5, 4, 128)), ValueError, "out"),
    ("out-f16", new("out", like="q", dtype=F16), TypeError, "out"),
    ("out-misaligned", new("out", like="q", offset=2), ValueError, "out"),
    # devices
    *elsewhere("k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q"),
    *elsewhere("out", like="q"),
)

ROWS += table(
    cuattn.reshape_and_cache, reshape_kwargs,
    # wrong types
    *types("key", "value", "k_cache", "v_cache", "slot_mapping"),
    ("kv_layout-hnd", put(kv_layout="hnd"), ValueError, "kv_layout"),
    ("nhd-with-vllm-caches", put(kv_layout="nhd"), ValueError, "k_cache"),
    ("nhd-fp8-head_size-120", lambda kw, mk: {
        **kw, "kv_layout": "nhd", "key": mk.zeros((3, 2, 120), BF16),
        "value": mk.zeros((3, 2, 120), BF16), "k_cache": mk.zeros((4, 16, 2, 120), np.uint8),
        "v_cache": mk.zeros((4, 16, 2, 120), np.uint8)}, ValueError, "k_cache"),
    # key, value: float16 / bfloat16 (num_tokens, nheads_kv, head_size) alike, as the caches
    ("key-float32", new("key", "value", dtype=np.float32), TypeError, "key"),
    ("key-int16", new("key", dtype=np.int16), TypeError, "key"),
    ("value-f16", new("value", dtype=F16), TypeError, "value"),
    ("key-rank2", new("key", shape=(3, 256)), ValueError, "key"),
    ("value-rank4", new("value", shape=(1, 3, 2, 128)), ValueError, "value"),
    ("value-tokens-differ", new("value", shape=(2, 2, 128)), ValueError, "value"),
    ("key-head_size-100", new("key", "value", shape=(3, 2, 100)), ValueError, "key"),
    ("key-head_size-264", new("key", "value", shape=(3, 2, 264)), ValueError, "key"),
    ("nhd-block_size-1024", nhd_sized(40, 1024, act=("key", "value"), tokens=3), ValueError,
     "k_cache"),
    ("nhd-fp8-head_size-24", nhd_sized(24, cache=np.uint8, act=("key", "value"), tokens=3),
     ValueError, "k_cache"),
    ("key-heads-differ-from-caches", new("key", "value", shape=(3, 3, 128)), ValueError, "key"),
    ("key-strided", new("key", strided=True), ValueError, "key"),
    ("value-strided", new("value", strided=True), ValueError, "value"),
    ("key-misaligned", new("key", offset=2), ValueError, "key"),
    ("value-misaligned", new("value", offset=4), ValueError, "value"),
    ("key-row-stride-misaligned", make(key=padded((3, 2, 128), BF16, 4)), ValueError, "key"),
    # caches
    ("k_cache-f16", new("k_cache", "v_cache", dtype=F16), TypeError, "k_cache"),
    ("v_cache-f16", new("v_cache", dtype=F16), TypeError, "v_cache"),
    ("k_cache-rank4", new("k_cache", shape=(4, 2, 128, 16)), ValueError, "k_cache"),
    ("k_cache-uint8-x-8", new("k_cache", "v_cache", dtype=np.uint8), ValueError, "k_cache"),
    ("k_cache-head_size-differs", new("k_cache", shape=(4, 2, 8, 16, 8)), ValueError, "k_cache"),
    ("block_size-64", new("k_cache", shape=(4, 2, 16, 64, 8)), ValueError, "k_cache"),
    ("v_cache-shape", new("v_cache", shape=(4, 2, 128, 8)), ValueError, "v_cache"),
    ("k_cache-strided", new("k_cache", strided=True), ValueError, "k_cache"),
    ("v_cache-misaligned", new("v_cache", offset=2), ValueError, "v_cache"),
    # slot_mapping: int32 / int64 (num_tokens,), contiguous
    ("slot_mapping-float32", new("slot_mapping", dtype=np.float32), TypeError, "slot_mapping"),
    ("slot_mapping-int16", new("slot_mapping", dtype=np.int16), TypeError, "slot_mapping"),
    ("slot_mapping-uint32", new("slot_mapping", dtype=np.uint32), TypeError, "slot_mapping"),
    ("slot_mapping-length", new("slot_mapping", shape=(2,)), ValueError, "slot_mapping"),
    ("slot_mapping-rank2", new("slot_mapping", shape=(3, 1)), ValueError, "slot_mapping"),
    ("slot_mapping-strided", new("slot_mapping", strided=True), ValueError, "slot_mapping"),
    ("slot_mapping-misaligned", new("slot_mapping", offset=2), ValueError, "slot_mapping"),
    # scalars
    ("k_scale-0", put(k_scale=0.0), ValueError, "k_scale"),
    ("k_scale-negative", put(k_scale=-2.0), ValueError, "k_scale"),
    ("k_scale-nan", put(k_scale=NAN), ValueError, "k_scale"),
    ("k_scale-str", put(k_scale="one"), TypeError, "k_scale"),
    ("v_scale-inf", put(v_scale=INF), ValueError, "v_scale"),
    ("v_scale-None", put(v_scale=None), TypeError, "v_scale"),
    *scale_rows(),
    ("stream-str", put(stream="default"), TypeError, "stream", DEVICE),  # after the kernel loads
    # devices
    *elsewhere("value", "k_cache", "v_cache", "slot_mapping"),
)

ROWS += table(
    cuattn.flash_backward, bwd_kwargs,
    *types("dout", "q", "k", "v", "out", "lse"),
    *hook_rows(2), *slope_rows(1, 2),
    # q, k, v: the forward's checks
    ("q-float32", new("q", "k", "v", dtype=np.float32), TypeError, "q"),
    ("k-bf16", new("k", dtype=BF16), TypeError, "k"),
    ("headdim-12", new("q", "k", "v", "dout", "out", shape=(1, 16, 2, 12)), ValueError, "q"),
    ("k-heads-not-a-divisor", new("k", "v", shape=(1, 16, 3, 64)), ValueError, "k"),
    ("q-strided", new("q", strided=True), ValueError, "q"),
    # dout and out: like q
    ("dout-shape", new("dout", shape=(1, 16, 2, 32)), ValueError, "dout"),
    ("dout-bf16", new("dout", dtype=BF16), TypeError, "dout"),
    ("dout-strided", new("dout", strided=True), ValueError, "dout"),
    ("dout-misaligned", new("dout", offset=2), ValueError, "dout"),
    ("out-shape", new("out", shape=(1, 15, 2, 64)), ValueError, "out"),
    ("out-float32", new("out", dtype=np.float32), TypeError, "out"),
    ("out-misaligned", new("out", offset=4), ValueError, "out"),
    # lse: float32 (batch, nheads, seqlen_q), as flash_forward returned it
    ("lse-float16", new("lse", dtype=F16), TypeError, "lse"),
    ("lse-float64", new("lse", dtype=np.float64), TypeError, "lse"),
    ("lse-transposed-shape", new("lse", shape=(1, 16, 2)), ValueError, "lse"),
    ("lse-rank2", new("lse", shape=(2, 16)), ValueError, "lse"),
    ("lse-misaligned", new("lse", offset=2), ValueError, "lse"),
    # options that cannot be a forward's
    ("causal-str", put(causal="yes"), TypeError, "causal"),
    ("softmax_scale-nan", put(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("softmax_scale-0", put(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("window_size-left-below-minus-1", put(window_size=(-2, 0)), ValueError, "window_size"),
    ("window_size-int", put(window_size=3), TypeError, "window_size"),
    ("deterministic-int", put(deterministic=1), TypeError, "deterministic"),
    ("deterministic-str", put(deterministic="yes"), TypeError, "deterministic"),
    ("stream-str", put(stream="default"), TypeError, "stream"),
    # dq=, dk=, dv=: like q, k, v
    *types("dq", like="q", required=False), *types("dk", like="k", required=False),
    *types("dv", like="v", required=False),
    ("dq-shape", new("dq", like="q", shape=(1, 16, 2, 32)), ValueError, "dq"),
    ("dq-bf16", new("dq", like="q", dtype=BF16), TypeError, "dq"),
    ("dk-shape", new("dk", like="k", shape=(1, 16, 1, 64)), ValueError, "dk"),
    ("dk-strided", new("dk", like="k", strided=True), ValueError, "dk"),
    ("dv-float32", new("dv", like="v", dtype=np.float32), TypeError, "dv"),
    ("dv-misaligned", new("dv", like="v", offset=2), ValueError, "dv"),
    # devices
    *elsewhere("k", "v", "dout", "out", "lse"), *elsewhere("dq", like="q"),
    *elsewhere("dk", "dv", like="k"),
)

ROWS += table(
    cuattn.flash_varlen_backward, bwd_varlen_kwargs,
    *types("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"),
    *hook_rows(2), *slope_rows(2, 2),
    ("q-rank4", new("q", shape=(1, 16, 2, 64)), ValueError, "q"),
    ("dout-shape", new("dout", shape=(15, 2, 64)), ValueError, "dout"),
    ("out-bf16", new("out", dtype=BF16), TypeError, "out"),
    ("lse-batch-layout", new("lse", shape=(1, 2, 16)), ValueError, "lse"),
    ("lse-shape", new("lse", shape=(16, 2)), ValueError, "lse"),
    ("cu_seqlens_q-int64", new("cu_seqlens_q", dtype=np.int64), TypeError, "cu_seqlens_q"),
    ("cu_seqlens_k-length-differs", new("cu_seqlens_k", shape=(4,)), ValueError, "cu_seqlens_k"),
    ("max_seqlen_q-float", put(max_seqlen_q=9.0), TypeError, "max_seqlen_q"),
    ("max_seqlen_k-negative", put(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
    ("causal-int", put(causal=1), TypeError, "causal"),
    ("softmax_scale-inf", put(softmax_scale=INF), ValueError, "softmax_scale"),
    ("window_size-malformed", put(window_size=(0,)), TypeError, "window_size"),
    ("deterministic-None", put(deterministic=None), TypeError, "deterministic"),
    ("stream-float", put(stream=1.5), TypeError, "stream"),
    *types("dq", like="q", required=False), *types("dk", like="k", required=False),
    *types("dv", like="v", required=False),
    ("dq-shape", new("dq", like="q", shape=(15, 2, 64)), ValueError, "dq"),
    ("dk-f32", new("dk", like="k", dtype=np.float32), TypeError, "dk"),
    ("dv-strided", new("dv", like="v", strided=True), ValueError, "dv"),
    *elsewhere("k", "v", "dout", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"),
    *elsewhere("dq", like="q"), *elsewhere("dk", "dv", like="k"),
)

ROWS += table(
    cuattn.paged_kv_cache_shapes, shapes_kwargs,
    ("kv_layout-hnd", put(kv_layout="hnd"), ValueError, "kv_layout"),
    ("nhd-block_size-3", put(kv_layout="nhd", block_size=3), ValueError, "block_size"),
    ("nhd-fp8-head_size-120", put(kv_layout="nhd", head_size=120, dtype=np.uint8), ValueError,
     "head_size"),
    # the dtype of the cache; non-negative counts; supported head and block sizes
    ("dtype-float32", put(dtype=np.float32), TypeError, "dtype"),
    ("dtype-int32", put(dtype=np.int32), TypeError, "dtype"),
    ("dtype-None", put(dtype=None), TypeError, "dtype"),
    ("num_blocks-negative", put(num_blocks=-1), ValueError, "num_blocks"),
    ("num_blocks-float", put(num_blocks=2.5), ValueError, "num_blocks"),
    ("num_blocks-str", put(num_blocks="4"), ValueError, "num_blocks"),
    ("nheads_kv-negative", put(nheads_kv=-2), ValueError, "nheads_kv"),
    ("nheads_kv-None", put(nheads_kv=None), ValueError, "nheads_kv"),
    ("head_size-100", put(head_size=100), ValueError, "head_size"),
    ("head_size-None", put(head_size=None), ValueError, "head_size"),
    ("head_size-120-fp8", put(head_size=120, dtype=np.uint8), ValueError, "head_size"),
    ("head_size-8-fp8", put(head_size=8, dtype=np.uint8), ValueError, "head_size"),
    ("head_size-12", put(head_size=12), ValueError, "head_size"),
    ("head_size-0", put(head_size=0), ValueError, "head_size"),
    ("head_size-264", put(head_size=264), ValueError, "head_size"),
    ("nhd-block_size-1024", put(kv_layout="nhd", block_size=1024), ValueError, "block_size"),
    ("block_size-64", put(block_size=64), ValueError, "block_size"),
    ("block_size-0", put(block_size=0), ValueError, "block_size"),
    ("dtype-unknown-name", put(dtype="float17"), TypeError, "dtype"),
    ("head_size-float", put(head_size=128.0), ValueError, "head_size"),
    ("block_size-float", put(block_size=16.0), ValueError, "block_size"),
    ("num_blocks-bool", put(num_blocks=True), ValueError, "num_blocks"),
)

_TABLE = dict(shape=(2, 4), dtype=np.int32)      # flashinfer_kwargs' block_tables
_LENS = dict(shape=(2,), dtype=np.int32)
ROWS += table(
    cuattn.block_tables_from_flashinfer, flashinfer_kwargs,
    # wrong types
    *types("kv_indptr", "kv_indices", "kv_last_page_len"),
    ("out-numpy", put(out=np.zeros((2, 4), np.int32)), TypeError, "out"),
    ("out-list", put(out=[[0] * 4] * 2), TypeError, "out"),
    ("out_seq_lens-numpy", put(out_seq_lens=np.zeros(2, np.int32)), TypeError, "out_seq_lens"),
    # the three tables: int32 vectors, contiguous, 4-byte aligned, batch + 1 / batch long
    ("kv_indptr-int64", new("kv_indptr", dtype=np.int64), TypeError, "kv_indptr"),
    ("kv_indptr-float32", new("kv_indptr", dtype=np.float32), TypeError, "kv_indptr"),
    ("kv_indptr-rank2", new("kv_indptr", shape=(3, 1)), ValueError, "kv_indptr"),
    ("kv_indptr-empty", new("kv_indptr", shape=(0,)), ValueError, "kv_indptr"),
    ("kv_indptr-strided", new("kv_indptr", strided=True), ValueError, "kv_indptr"),
    ("kv_indptr-misaligned", new("kv_indptr", offset=2), ValueError, "kv_indptr"),
    ("kv_indices-int64", new("kv_indices", dtype=np.int64), TypeError, "kv_indices"),
    ("kv_indices-rank2", new("kv_indices", shape=(3, 1)), ValueError, "kv_indices"),
    ("kv_indices-strided", new("kv_indices", strided=True), ValueError, "kv_indices"),
    ("kv_indices-misaligned", new("kv_indices", offset=2), ValueError, "kv_indices"),
    ("kv_last_page_len-int64", new("kv_last_page_len", dtype=np.int64), TypeError,
     "kv_last_page_len"),
    ("kv_last_page_len-length", new("kv_last_page_len", shape=(3,)), ValueError,
     "kv_last_page_len"),
    ("kv_last_page_len-rank2", new("kv_last_page_len", shape=(2, 1)), ValueError,
     "kv_last_page_len"),
    ("kv_last_page_len-strided", new("kv_last_page_len", strided=True), ValueError,
     "kv_last_page_len"),
    ("kv_last_page_len-misaligned", new("kv_last_page_len", offset=2), ValueError,
     "kv_last_page_len"),
    # page_size: a block size of cuattn's caches; max_blocks_per_seq: 0 <= n, n * page < 2**29
    ("page_size-3", put(page_size=3), ValueError, "page_size"),
    ("page_size-0", put(page_size=0), ValueError, "page_size"),
    ("page_size-1024", put(page_size=1024), ValueError, "page_size"),
    ("page_size-float", put(page_size=16.0), TypeError, "page_size"),
    ("page_size-bool", put(page_size=True), TypeError, "page_size"),
    ("page_size-None", put(page_size=None), TypeError, "page_size"),
    ("max_blocks_per_seq-negative", put(max_blocks_per_seq=-1), ValueError,
     "max_blocks_per_seq"),
    ("max_blocks_per_seq-2**25-of-16", put(max_blocks_per_seq=2**25), ValueError,
     "max_blocks_per_seq"),
    ("max_blocks_per_seq-float", put(max_blocks_per_seq=4.0), TypeError, "max_blocks_per_seq"),
    ("max_blocks_per_seq-str", put(max_blocks_per_seq="4"), TypeError, "max_blocks_per_seq"),
    # out= (batch, max_blocks_per_seq) and out_seq_lens= (batch,): int32, contiguous rows
    ("out-shape", new("out", shape=(2, 5), dtype=np.int32), ValueError, "out"),
    ("out-rank", new("out", shape=(8,), dtype=np.int32), ValueError, "out"),
    ("out-int64", new("out", shape=(2, 4), dtype=np.int64), TypeError, "out"),
    ("out-strided", new("out", **_TABLE, strided=True), ValueError, "out"),
    ("out-misaligned", new("out", **_TABLE, offset=2), ValueError, "out"),
    ("out_seq_lens-shape", new("out_seq_lens", shape=(3,), dtype=np.int32), ValueError,
     "out_seq_lens"),
    ("out_seq_lens-float32", new("out_seq_lens", shape=(2,), dtype=np.float32), TypeError,
     "out_seq_lens"),
    ("out_seq_lens-strided", new("out_seq_lens", **_LENS, strided=True), ValueError,
     "out_seq_lens"),
    ("out_seq_lens-misaligned", new("out_seq_lens", **_LENS, offset=2), ValueError,
     "out_seq_lens"),
    ("stream-str", put(stream="default"), TypeError, "stream"),
    # devices
    *elsewhere("kv_indices", "kv_last_page_len"),
    ("out-other-device", new("out", **_TABLE, device=1), ValueError, "out", TWO_GPUS),
    ("out_seq_lens-other-device", new("out_seq_lens", **_LENS, device=1), ValueError,
     "out_seq_lens", TWO_GPUS),
)


def kvcache_kwargs(mk):
    """flash_with_kvcache: 2 sequences of 3 new tokens, 4 query / 2 KV heads, a cache of 3
    rows of 40 slots, the new keys appended."""
    return dict(q=_randn(mk, (2, 3, 4, 64), BF16), k_cache=_randn(mk, (3, 40, 2, 64), BF16),
                v_cache=_randn(mk, (3, 40, 2, 64), BF16), k=_randn(mk, (2, 3, 2, 64), BF16),
                v=_randn(mk, (2, 3, 2, 64), BF16),
                cache_seqlens=mk.array(np.array([5, 30], np.int32)),
                cache_batch_idx=mk.array(np.array([2, 0], np.int32)))


_KV_ROWS = dict(shape=(2,), dtype=np.int32)

ROWS += table(
    cuattn.flash_with_kvcache, kvcache_kwargs,
    *types("q", "k_cache", "v_cache", "cache_seqlens"),
    *types("k", "v", "cache_batch_idx", required=False),
    *types("out", like="q", required=False),
    *hook_rows(4), *slope_rows(2, 4),
    # q: (batch, seqlen_q, nheads, head_size), float16 / bfloat16, rows that pack
    ("q-float32", new("q", dtype=np.float32), TypeError, "q"),
    ("q-rank3", new("q", shape=(6, 4, 64)), ValueError, "q"),
    ("q-head_size-100", new("q", shape=(2, 3, 4, 100)), ValueError, "q"),
    ("q-heads-not-a-multiple", new("q", shape=(2, 3, 3, 64)), ValueError, "k_cache"),
    ("q-no-heads", new("q", shape=(2, 3, 0, 64)), ValueError, "q"),
    ("q-strided", new("q", strided=True), ValueError, "q"),
    ("q-misaligned", new("q", offset=2), ValueError, "q"),
    ("q-rows-do-not-pack", make(q=lambda mk: mk.zeros((2, 4, 4, 64), BF16)[:, :3]),
     ValueError, "q"),
    # the caches: q's dtype, (batch_cache, seqlen_cache, nheads_kv, head_size), one buffer each
    ("k_cache-f16", new("k_cache", "v_cache", dtype=F16), TypeError, "k_cache"),
    ("k_cache-fp8", new("k_cache", "v_cache", dtype=np.uint8), TypeError, "k_cache"),
    ("v_cache-f16", new("v_cache", dtype=F16), TypeError, "v_cache"),
    ("k_cache-rank5", new("k_cache", shape=(3, 40, 2, 8, 8)), ValueError, "k_cache"),
    ("v_cache-shape", new("v_cache", shape=(3, 41, 2, 64)), ValueError, "v_cache"),
    ("k_cache-head_size", new("k_cache", "v_cache", shape=(3, 40, 2, 128)), ValueError,
     "k_cache"),
    ("k_cache-no-slots", new("k_cache", "v_cache", shape=(3, 0, 2, 64)), ValueError,
     "k_cache"),
    ("k_cache-no-rows", new("k_cache", "v_cache", shape=(0, 40, 2, 64)), ValueError,
     "k_cache"),
    ("k_cache-fewer-rows-than-batch-without-cache_batch_idx",
     lambda kw, mk: new("k_cache", "v_cache", shape=(1, 40, 2, 64))(
         {**kw, "cache_batch_idx": None}, mk), ValueError, "k_cache"),
    ("k_cache-row-stride", make(k_cache=padded((3, 40, 2, 64), BF16, 4)), ValueError,
     "k_cache"),
    ("v_cache-strided", new("v_cache", strided=True), ValueError, "v_cache"),
    # cache_seqlens / cache_batch_idx: int32 (batch,), or an int for cache_seqlens
    ("cache_seqlens-int64", new("cache_seqlens", dtype=np.int64), TypeError, "cache_seqlens"),
    ("cache_seqlens-float", put(cache_seqlens=3.0), TypeError, "cache_seqlens"),
    ("cache_seqlens-bool", put(cache_seqlens=True), TypeError, "cache_seqlens"),
    ("cache_seqlens-huge-int", put(cache_seqlens=2**40), ValueError, "cache_seqlens"),
    ("cache_seqlens-negative-int", put(cache_seqlens=-1), ValueError, "cache_seqlens"),
    ("cache_seqlens-int-past-the-rows", put(cache_seqlens=41), ValueError, "cache_seqlens"),
    ("k-longer-than-the-rows", new("k", "v", shape=(2, 41, 2, 64)), ValueError, "k"),
    ("cache_seqlens-length", new("cache_seqlens", shape=(3,)), ValueError, "cache_seqlens"),
    ("cache_seqlens-rank2", new("cache_seqlens", shape=(2, 1)), ValueError, "cache_seqlens"),
    ("cache_seqlens-strided", new("cache_seqlens", **_KV_ROWS, strided=True), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-misaligned", new("cache_seqlens", **_KV_ROWS, offset=2), ValueError,
     "cache_seqlens"),
    ("cache_batch_idx-int64", new("cache_batch_idx", dtype=np.int64), TypeError,
     "cache_batch_idx"),
    ("cache_batch_idx-length", new("cache_batch_idx", shape=(1,)), ValueError,
     "cache_batch_idx"),
    # k, v: together, (batch, seqlen_new, nheads_kv, head_size) of q's dtype
    ("k-without-v", put(v=None), ValueError, "v"),
    ("v-without-k", put(k=None), ValueError, "k"),
    ("k-f16", new("k", "v", dtype=F16), TypeError, "k"),
    ("k-heads", new("k", "v", shape=(2, 3, 4, 64)), ValueError, "k"),
    ("k-batch", new("k", "v", shape=(1, 3, 2, 64)), ValueError, "k"),
    ("v-length", new("v", shape=(2, 2, 2, 64)), ValueError, "v"),
    ("k-strided", new("k", strided=True), ValueError, "k"),
    ("v-misaligned", new("v", offset=2), ValueError, "v"),
    # options
    ("causal-int", put(causal=1), TypeError, "causal"),
    ("window_size-3", put(window_size=(1, 2, 3)), TypeError, "window_size"),
    ("num_splits-negative", put(num_splits=-1), ValueError, "num_splits"),
    ("softmax_scale-nan", put(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("out-shape", new("out", like="q", shape=(2, 3, 4, 32)), ValueError, "out"),
    ("out-f16", new("out", like="q", dtype=F16), TypeError, "out"),
    ("out-rows-do-not-pack", make(out=lambda mk: mk.zeros((2, 4, 4, 64), BF16)[:, :3]),
     ValueError, "out"),
    ("stream-str", put(stream="default"), TypeError, "stream", DEVICE),
    # devices
    *elsewhere("k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_batch_idx"),
    *elsewhere("out", like="q"),
)


def _params(rows):
    return [pytest.param(r, id=f"{r.fn.__name__}-{r.id}") for r in rows]


def _bad_call(row: Row, mk: Arrays):
    """The row's bad kwargs (built first) and a call that must raise naming the argument."""
    kwargs = row.mutate(row.valid(mk), mk)

    def call():
        with pytest.raises(row.exc, match=rf"^{re.escape(row.arg)}:"):
            row.fn(**kwargs)
    return call


def test_the_table_covers_every_argument_of_every_public_function():
    ids = [p.id for p in _params(ROWS)]
    assert len(ids) == len(set(ids))
    public = set(cuattn.__all__) - {"__version__"}
    assert {r.fn.__name__ for r in ROWS} == public
    for name in public:
        fn = getattr(cuattn, name)
        args = set(inspect.signature(fn).parameters) - {"return_lse"}   # any truthy value
        assert args <= {r.arg for r in ROWS if r.fn is fn}, name


@pytest.mark.gpu
@pytest.mark.parametrize("row", _params(ROWS))
def test_bad_input(row):
    import cupy
    if TWO_GPUS in row.flags and cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs a second GPU")
    mk = Arrays(real=True)
    _bad_call(row, mk)()
    row.fn(**row.valid(mk))              # nothing was launched: the device still works
    cupy.cuda.runtime.deviceSynchronize()


@pytest.mark.skipif(_has_gpu(), reason="test_bad_input runs these rows on real arrays")
@pytest.mark.parametrize("row", _params([r for r in ROWS if DEVICE not in r.flags]))
def test_bad_input_without_a_device(row, monkeypatch):
    import cupy
    call = _bad_call(row, Arrays(real=False))
    # Every check runs before the device is entered or a stream is looked up: stand-ins that
    # touch nothing make sure of it (anything past the checks still fails loudly)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: contextlib.nullcontext())
    call()


# -- a valid call on a machine without a usable device ----------------------------------------

def _nhd_paged(dtype, head_size):
    """paged_kwargs over NHD caches of ``dtype`` at ``head_size``: fp8 and head size 120 run
    on the flash form (docs/api.md, paged_attention's kv_layout)."""
    def kwargs(mk):
        shape = cuattn.paged_kv_cache_shapes(4, 2, head_size, 16, dtype, kv_layout="nhd")[0]
        return {**paged_kwargs(mk), "kv_layout": "nhd", "q": mk.zeros((2, 4, head_size), BF16),
                "k_cache": mk.zeros(shape, dtype), "v_cache": mk.zeros(shape, dtype)}
    return kwargs


def _no_tokens(mk):
    return {**reshape_kwargs(mk), "key": mk.zeros((0, 2, 128), BF16),
            "value": mk.zeros((0, 2, 128), BF16), "slot_mapping": mk.zeros((0,), np.int32)}


VALID_CALLS = [
    (cuattn.flash_forward, flash_kwargs, "plain"),
    (cuattn.flash_varlen_forward, varlen_kwargs, "plain"),
    (cuattn.flash_backward, bwd_kwargs, "plain"),
    (cuattn.flash_varlen_backward, bwd_varlen_kwargs, "plain"),
    (cuattn.merge_attn_states, merge_kwargs, "plain"),
    (cuattn.merge_states, merge_states_kwargs, "plain"),
    (cuattn.paged_attention, paged_kwargs, "plain"),
    (cuattn.paged_attention, _nhd_paged(np.uint8, 128), "nhd-fp8"),
    (cuattn.paged_attention, _nhd_paged(BF16, 120), "nhd-head_size-120"),
    (cuattn.paged_attention, lambda mk: nhd_sized(128, 512)(paged_kwargs(mk), mk),
     "nhd-block_size-512"),
    (cuattn.paged_prefill, prefill_kwargs, "plain"),
    (cuattn.flash_with_kvcache, kvcache_kwargs, "plain"),
    (cuattn.flash_with_kvcache,
     lambda mk: {**kvcache_kwargs(mk), "k": None, "v": None, "cache_seqlens": 7,
                 "cache_batch_idx": None, "causal": True}, "int-lengths"),
    # head sizes and NHD blocks only paged_prefill / reshape_and_cache take
    (cuattn.paged_prefill, lambda mk: nhd_sized(40, 512, tokens=6)(prefill_kwargs(mk), mk),
     "nhd-head_size-40-block_size-512"),
    (cuattn.paged_prefill, lambda mk: {**prefill_kwargs(mk), "q": mk.zeros((6, 4, 24), BF16),
                                       "k_cache": mk.zeros((4, 2, 3, 16, 8), BF16),
                                       "v_cache": mk.zeros((4, 2, 24, 16), BF16)},
     "head_size-24"),
    (cuattn.paged_prefill, lambda mk: nhd_sized(48, cache=np.uint8, tokens=6)(
        prefill_kwargs(mk), mk), "nhd-fp8-head_size-48"),
    (cuattn.reshape_and_cache, reshape_kwargs, "plain"),
    (cuattn.reshape_and_cache, lambda mk: nhd_sized(232, 512, act=("key", "value"), tokens=3)(
        reshape_kwargs(mk), mk), "nhd-head_size-232-block_size-512"),
    (cuattn.reshape_and_cache, _no_tokens, "no-tokens"),   # a plan that launches nothing
    (cuattn.block_tables_from_flashinfer, flashinfer_kwargs, "plain"),
    (cuattn.block_tables_from_flashinfer,
     lambda mk: {**flashinfer_kwargs(mk), "out": mk.zeros((2, 4), np.int32),
                 "out_seq_lens": mk.zeros((2,), np.int32)}, "out"),
]


def test_every_public_function_has_a_valid_call():
    touching = set(cuattn.__all__) - {"__version__", "paged_kv_cache_shapes"}  # (no device)
    assert {fn.__name__ for fn, _, _ in VALID_CALLS} == touching


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
@pytest.mark.parametrize("fn,valid", [pytest.param(fn, valid, id=f"{fn.__name__}-{name}")
                                      for fn, valid, name in VALID_CALLS])
def test_valid_call_without_a_device_is_one_device_error(fn, valid):
    """Past its checks, a call's first touch of the device raises cuattn's DeviceError, one
    line with no CUDA error chained, not CUDA's own (cudaErrorInsufficientDriver)."""
    from cuattn.jit import DeviceError
    with pytest.raises(DeviceError, match=r"^cuattn: no usable CUDA device 0: ") as caught:
        fn(**valid(Arrays(real=False)))
    assert "\n" not in str(caught.value) and caught.value.__suppress_context__
