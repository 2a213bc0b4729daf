"""Stress (GPU): CUDA-graph replay with new data, and bit-for-bit determinism.

Every case is a pair (make, call): ``make(rng)`` builds the device inputs of one call,
``call(inputs)`` runs it and returns the arrays to compare. A graph captured on one set of
inputs, replayed after new data is written into the same buffers, must give the same bits
as an eager call on the new data; three identical eager calls must give the same bits.
Raw bytes are compared (16-bit floats as uint16), so NaN payloads count too.
Kernels used are the shipped ones (split-KV flash and paged v2 at every partition among them).
"""
from __future__ import annotations

import contextlib

import cupy as cp
import numpy as np
import pytest

import cuattn
from tests.test_paged import BF16, _to_device, make_case

F16 = np.dtype(np.float16)
INF = np.inf


def _randn(rng, shape, dtype):
    return cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def _raw(x):
    """The bytes of x as unsigned integers of its item size (NaN payloads compare too)."""
    return x.view(np.dtype(f"u{x.itemsize}"))


# -- the cases ----------------------------------------------------------------------------------

def _flash(dtype, b, sq, sk, h, hkv, hd):
    def make(rng):
        return dict(q=_randn(rng, (b, sq, h, hd), dtype), k=_randn(rng, (b, sk, hkv, hd), dtype),
                    v=_randn(rng, (b, sk, hkv, hd), dtype))
    return make


def _varlen_make(rng):
    """New lengths every call (same totals and maxima): cu_seqlens are read on the device."""
    def cu(lens):
        return cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    lens_q, lens_k = rng.permutation([0, 1, 77, 130, 33]), rng.permutation([130, 0, 1, 300, 64])
    return dict(q=_randn(rng, (241, 4, 64), BF16), k=_randn(rng, (495, 2, 64), BF16),
                v=_randn(rng, (495, 2, 64), BF16), cu_q=cu(lens_q), cu_k=cu(lens_k))


def _paged(caps, nkv, gqa, hs, dtype):
    """A NaN-poisoned paged cache sized for ``caps`` tokens per sequence; seq_lens drawn at
    or up to 16 below each cap (only written slots are read)."""
    def make(rng):
        case = make_case(rng, lengths=caps, nkv=nkv, gqa=gqa, head_size=hs, block_size=16,
                         dtype=dtype)
        d = _to_device(case)
        del d["alibi_slopes"]
        lens = np.maximum(np.array(caps) - rng.integers(0, 17, len(caps)), 0)
        d["seq_lens"] = cp.asarray(lens.astype(np.int32))
        return d
    return make


def _merge(k, t, h, hs, dtype):
    def make(rng):
        lses = (rng.standard_normal((k, h, t)) * 3).astype(np.float32)
        lses[0, :, ::5] = -INF                    # empty sides, both kinds of infinity
        lses[1, :, ::7] = INF
        return dict(outs=_randn(rng, (k, t, h, hs), dtype), lses=cp.asarray(lses))
    return make


def _reshape_make(rng):
    nkv, hs, num_blocks, n = 2, 128, 20, 70
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, nkv, hs, 16, F16)
    slots = rng.permutation(num_blocks * 16)[:n].astype(np.int32)
    slots[::9] = -1                                       # skipped
    return dict(key=_randn(rng, (n, nkv, hs), F16), value=_randn(rng, (n, nkv, hs), F16),
                k_cache=_randn(rng, kshape, F16), v_cache=_randn(rng, vshape, F16),
                slots=cp.asarray(slots))


def _reshape_call(d):
    k_cache, v_cache = d["k_cache"].copy(), d["v_cache"].copy()     # same start every call
    cuattn.reshape_and_cache(d["key"], d["value"], k_cache, v_cache, d["slots"])
    return k_cache, v_cache


def _decode_make(rng):
    """One cascade decode step: append a token to each sequence's paged cache, attend to it
    (paged v2) and to a prefix (flash), merge the two by their lse."""
    caps = [300, 17, 1000, 0]
    case = make_case(rng, lengths=caps, nkv=2, gqa=4, head_size=128, block_size=16,
                     dtype="bf16")
    lens = np.maximum(np.array(caps) - rng.integers(0, 17, len(caps)), 0)
    last = np.maximum(lens - 1, 0)
    slots = case["block_tables"][np.arange(len(caps)), last // 16] * 16 + last % 16
    d = _to_device(case)
    del d["alibi_slopes"]
    n = len(caps)
    d.update(seq_lens=cp.asarray(lens.astype(np.int32)),
             slots=cp.asarray(np.where(lens > 0, slots, -1).astype(np.int64)),
             key=_randn(rng, (n, 2, 128), BF16), value=_randn(rng, (n, 2, 128), BF16),
             pk=_randn(rng, (n, 200, 2, 128), BF16), pv=_randn(rng, (n, 200, 2, 128), BF16))
    return d


def _decode_call(d):
    cuattn.reshape_and_cache(d["key"], d["value"], d["k_cache"], d["v_cache"], d["slots"])
    suffix, suffix_lse = cuattn.paged_attention(d["q"], d["k_cache"], d["v_cache"],
                                                d["block_tables"], d["seq_lens"],
                                                version="v2", return_lse=True)
    prefix, prefix_lse = cuattn.flash_forward(d["q"][:, None], d["pk"], d["pv"],
                                              return_lse=True)
    out, lse = cuattn.merge_attn_states(prefix[:, 0], prefix_lse[:, :, 0].T, suffix,
                                        suffix_lse)
    return out, lse, d["k_cache"], d["v_cache"]


def _paged_call(version, **kw):
    def call(d):
        return cuattn.paged_attention(d["q"], d["k_cache"], d["v_cache"], d["block_tables"],
                                      d["seq_lens"], version=version, return_lse=True, **kw)
    return call


CASES = {
    "flash-causal-lse": (_flash(BF16, 2, 77, 203, 4, 2, 64), lambda d: cuattn.flash_forward(
        d["q"], d["k"], d["v"], causal=True, return_lse=True, num_splits=1)),
    "flash-causal-split4": (_flash(F16, 1, 5, 3001, 8, 2, 128), lambda d: cuattn.flash_forward(
        d["q"], d["k"], d["v"], causal=True, return_lse=True, num_splits=4)),
    "flash-varlen-split3": (_varlen_make, lambda d: cuattn.flash_varlen_forward(
        d["q"], d["k"], d["v"], d["cu_q"], d["cu_k"], 130, 300, causal=True, return_lse=True,
        num_splits=3)),
    "paged-v1": (_paged([700, 3, 1500, 16, 0, 513], 2, 4, 128, "bf16"), _paged_call("v1")),
    "paged-v2-p128": (_paged([2048, 1500, 513, 128, 1, 0], 1, 8, 64, "f16"),
                      _paged_call("v2", partition_size=128)),
    "merge-pair": (_merge(2, 33, 4, 128, BF16), lambda d: cuattn.merge_attn_states(
        d["outs"][0], d["lses"][0], d["outs"][1], d["lses"][1])),
    "merge-stacked": (_merge(3, 50, 4, 64, F16),
                      lambda d: cuattn.merge_states(d["outs"], d["lses"])),
    "reshape-and-cache": (_reshape_make, _reshape_call),
    "decode-step": (_decode_make, _decode_call),
}


@contextlib.contextmanager
def _stream_with_own_pool(reserve=64 << 20):
    """A fresh non-blocking stream and memory pool holding one free chunk of ``reserve``
    bytes: what a call allocates under capture is carved from it (no cudaMalloc while
    capturing), and a large allocation after the capture starts where the chunk's free tail
    starts, i.e. at any scratch a captured call freed (which its graph still writes)."""
    pool = cp.cuda.MemoryPool()
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.using_allocator(pool.malloc), stream:
        cp.cuda.alloc(reserve)        # returned to the pool at once
        yield stream
        stream.synchronize()


def _capture(stream, call, d):
    call(d)                                       # compile and load outside the capture
    stream.synchronize()
    stream.begin_capture()
    got = call(d)
    return stream.end_capture(), got


def _assert_bits_equal(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert bool(cp.array_equal(_raw(a), _raw(b))), f"{what}: the bits differ"


def _assert_written(arrays, inputs):
    """Outputs (not the inputs a call updates in place) hold no NaN."""
    for i, x in enumerate(arrays):
        if id(x) not in {id(v) for v in inputs.values()} and x.dtype in (F16, BF16, np.float32):
            assert not bool(cp.isnan(x.astype(np.float32)).any()), f"output {i} has NaN"


# -- GPU: graphs ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_graph_replay_with_new_data_equals_eager(rng, name):
    make, call = CASES[name]
    with _stream_with_own_pool() as stream:
        bufs, new = make(rng), make(rng)
        graph, got = _capture(stream, call, bufs)
        inputs = {id(x) for x in bufs.values()}
        for x in got:                             # poison what the replay must write
            if id(x) not in inputs:
                _raw(x).fill(np.iinfo(_raw(x).dtype).max)
        for key, x in new.items():
            bufs[key][...] = x
        graph.launch(stream)
        want = call(new)
        _assert_written(want, new)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_bits_equal(g, w, f"{name} output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash-causal-split4", "paged-v2-p128"])
def test_graph_scratch_is_not_handed_to_later_arrays(rng, name):
    """Scratch a captured call allocates (flash split-KV partials, paged v2 partitions) is
    still written by every replay: the pool must never give it to another array."""
    make, call = CASES[name]
    with _stream_with_own_pool() as stream:
        d = make(rng)                             # the inputs stay alive: the graph reads them
        graph, _ = _capture(stream, call, d)
        victim = cp.full(4 << 20, 0x5A, dtype=np.uint8)   # where freed scratch would be
        graph.launch(stream)
        assert int((victim != 0x5A).sum()) == 0, "a graph replay wrote into a later array"


# -- GPU: determinism -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_identical_calls_are_bit_identical(rng, name):
    make, call = CASES[name]
    d = make(rng)
    runs = []
    for _ in range(3):
        res = call(d)
        _assert_written(res, d)
        runs.append([x.copy() for x in res])       # snapshots: decode-step updates its caches
    for r, run in enumerate(runs[1:], 2):
        for i, (a, b) in enumerate(zip(runs[0], run)):
            _assert_bits_equal(a, b, f"{name} run {r} output {i}")
