"""flash_with_kvcache: new tokens against a dense KV cache, appended first.

CPU: the append kernel compiles without spills. GPU (marker ``gpu``; both flash kernels,
tests/paths.py): a float64 NumPy reference (tests/reference.py attention_reference) per
batch entry over the cache row's first cache_seqlens[b] keys plus the new ones, sliced by
plain indexing; every cache slot a sequence must not read holds NaN, and after the call
every slot but the appended ones is unchanged (NaN where it was NaN).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import tuning
from tests.compiled import compile_reports, unclean
from tests.paths import FLASH_PATHS, forced_flash_path
from tests.reference import attention_reference, check_attention

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f16": np.dtype(np.float16), "bf16": BF16}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_append_kernel_compiles_without_spills(arch):
    reports = compile_reports([tuning.kvcache_append_variant(d) for d in DTYPES], arch)
    assert not unclean(reports)


def make_case(rng, *, batch, seqlen_q, seqlen_new, seqlen_cache, cache_lens, nkv, group,
              head_size, dtype, permute=True, extra_rows=1):
    """Host arrays of one call: the cache (NaN past each used row's length, and in the rows
    no entry uses), the new keys, the rows each entry reads."""
    dt = DTYPES[dtype]
    batch_cache = batch + extra_rows
    rows = rng.permutation(batch_cache)[:batch] if permute else np.arange(batch)
    kc = np.full((batch_cache, seqlen_cache, nkv, head_size), np.nan, np.float32)
    vc = kc.copy()
    for b, row in enumerate(rows):
        n = cache_lens[b]
        kc[row, :n] = rng.standard_normal((n, nkv, head_size))
        vc[row, :n] = rng.standard_normal((n, nkv, head_size))
    return dict(
        q=rng.standard_normal((batch, seqlen_q, nkv * group, head_size)).astype(dt),
        k_cache=kc.astype(dt), v_cache=vc.astype(dt),
        k=rng.standard_normal((batch, seqlen_new, nkv, head_size)).astype(dt)
        if seqlen_new else None,
        v=rng.standard_normal((batch, seqlen_new, nkv, head_size)).astype(dt)
        if seqlen_new else None,
        cache_seqlens=np.asarray(cache_lens, np.int32), rows=rows.astype(np.int32))


def reference(case, scale, **opts):
    """(out (batch, sq, H, D), lse (batch, H, sq), the caches after the append)."""
    kc, vc = case["k_cache"].copy(), case["v_cache"].copy()
    seqlen_cache = kc.shape[1]
    outs, lses = [], []
    for b, row in enumerate(case["rows"]):
        n = int(case["cache_seqlens"][b])
        if case["k"] is not None:
            new = case["k"].shape[1]
            fit = max(0, min(new, seqlen_cache - n))
            kc[row, n:n + fit] = case["k"][b, :fit]
            vc[row, n:n + fit] = case["v"][b, :fit]
            n = min(n + new, seqlen_cache)
        out, lse = attention_reference(case["q"][b], kc[row, :n], vc[row, :n], scale, **opts)
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses), kc, vc


def run(case, *, with_rows=True, **kw):
    import cupy as cp
    d = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.items()}
    cp.cuda.Device().synchronize()
    result = cuattn.flash_with_kvcache(
        d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"], cache_seqlens=d["cache_seqlens"],
        cache_batch_idx=d["rows"] if with_rows else None, **kw)
    cp.cuda.Device().synchronize()
    return result, d


def check_case(case, result, d, dtype, scale, **opts):
    out, lse = result
    ref, ref_lse, kc, vc = reference(case, scale, **opts)
    assert out.shape == case["q"].shape and lse.shape == ref_lse.shape
    check_attention(out.reshape(-1, *out.shape[2:]), lse.transpose(1, 0, 2).reshape(
        lse.shape[1], -1), ref.reshape(-1, *ref.shape[2:]),
        ref_lse.transpose(1, 0, 2).reshape(ref_lse.shape[1], -1), DTYPES[dtype])
    for name, want in (("k_cache", kc), ("v_cache", vc)):
        got = d[name].get().astype(np.float32)
        assert np.array_equal(got, want.astype(np.float32), equal_nan=True), name


# Lengths: an empty row, one that ends inside a tile, one the new keys fill to the end, one
# whose new keys run past the cache's end (dropped, as documented).
CASES = {
    "decode": dict(seqlen_q=1, seqlen_new=1, cache_lens=[0, 77, 299, 250]),
    "spec": dict(seqlen_q=5, seqlen_new=5, cache_lens=[3, 130, 295, 1]),
    "prefill": dict(seqlen_q=200, seqlen_new=200, cache_lens=[0, 37, 100, 64]),
    "no-append": dict(seqlen_q=7, seqlen_new=0, cache_lens=[7, 120, 300, 9]),
    "more-q-than-keys": dict(seqlen_q=40, seqlen_new=4, cache_lens=[0, 3, 30, 300]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_size,group,dtype", [(128, 4, "bf16"), (64, 1, "f16"),
                                                   (256, 2, "bf16"), (40, 3, "f16")])
def test_against_reference(rng, path, name, head_size, group, dtype):
    case = make_case(rng, batch=4, seqlen_cache=300, nkv=2, group=group, head_size=head_size,
                     dtype=dtype, **CASES[name])
    scale = 1 / math.sqrt(head_size)
    with forced_flash_path(path):
        for causal in (True, False):
            c = {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in case.items()}
            result, d = run(c, causal=causal, return_lse=True)
            check_case(c, result, d, dtype, scale, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("hooks", ["softcap+alibi+sinks", "window"])
def test_hooks_windows_splits(rng, path, num_splits, hooks):
    import cupy as cp
    case = make_case(rng, batch=3, seqlen_q=80, seqlen_new=16, seqlen_cache=1500,
                     cache_lens=[1000, 0, 1484], nkv=2, group=4, head_size=128, dtype="bf16")
    scale = 1 / math.sqrt(128)
    nheads = 8
    opts, ref_opts = {}, {}
    if hooks == "window":
        opts, ref_opts = dict(window_size=(300, 0)), dict(window=(300, 0))
    else:
        alibi = rng.uniform(0.01, 0.2, nheads).astype(np.float32)
        sinks = rng.standard_normal(nheads).astype(np.float32)
        opts = dict(softcap=20.0, alibi_slopes=cp.asarray(alibi), sinks=cp.asarray(sinks),
                    causal=True)
        ref_opts = dict(softcap=20.0, alibi=alibi, sinks=sinks, causal=True)
    with forced_flash_path(path):
        result, d = run(case, num_splits=num_splits, return_lse=True, **opts)
    check_case(case, result, d, "bf16", scale, **ref_opts)


@pytest.mark.gpu
def test_long_decode_splits_and_no_batch_idx(rng):
    """Decode over long rows (split-KV's rule), the rows in order without cache_batch_idx,
    GQA 8, the lse against the reference."""
    case = make_case(rng, batch=2, seqlen_q=1, seqlen_new=1, seqlen_cache=20000,
                     cache_lens=[19999, 8191], nkv=1, group=8, head_size=128, dtype="bf16",
                     permute=False, extra_rows=0)
    result, d = run(case, with_rows=False, causal=True, return_lse=True)
    check_case(case, result, d, "bf16", 1 / math.sqrt(128), causal=True)


@pytest.mark.gpu
def test_int_cache_seqlens_and_out(rng):
    import cupy as cp
    case = make_case(rng, batch=2, seqlen_q=3, seqlen_new=3, seqlen_cache=64,
                     cache_lens=[10, 10], nkv=2, group=2, head_size=64, dtype="bf16")
    d = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.items()}
    out = cp.full(case["q"].shape, np.nan, case["q"].dtype)
    cp.cuda.Device().synchronize()
    got = cuattn.flash_with_kvcache(d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"],
                                    cache_seqlens=10, cache_batch_idx=d["rows"], causal=True,
                                    out=out)
    assert got is out
    ref, _, kc, _ = reference(case, 1 / math.sqrt(64), causal=True)
    check_attention(out.reshape(6, 4, 64), None, ref.reshape(6, 4, 64), None, BF16)
    assert np.array_equal(d["k_cache"].get().astype(np.float32), kc.astype(np.float32),
                          equal_nan=True)


@pytest.mark.gpu
def test_captured_graph_replays_with_new_lengths_and_tokens(rng):
    """A graph captured once appends and attends at each replay's cache_seqlens: three
    decode steps, each with new q / k / v and lengths written into the same buffers."""
    import cupy as cp
    case = make_case(rng, batch=3, seqlen_q=1, seqlen_new=1, seqlen_cache=512,
                     cache_lens=[100, 0, 400], nkv=2, group=4, head_size=128, dtype="bf16")
    d = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case.items()}
    out = cp.zeros(case["q"].shape, case["q"].dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    args = (d["q"], d["k_cache"], d["v_cache"], d["k"], d["v"])
    kw = dict(cache_seqlens=d["cache_seqlens"], cache_batch_idx=d["rows"], causal=True,
              out=out)
    host_kc, host_vc = case["k_cache"], case["v_cache"]
    with stream:
        # the warm-up call (compile, plan) appends too: the reference starts after it
        cuattn.flash_with_kvcache(*args, **kw)
        stream.begin_capture()
        cuattn.flash_with_kvcache(*args, **kw)
        graph = stream.end_capture()
    stream.synchronize()
    host_kc, host_vc = d["k_cache"].get(), d["v_cache"].get()
    for step in range(3):
        lens = case["cache_seqlens"] + 1 + step
        new = make_case(rng, batch=3, seqlen_q=1, seqlen_new=1, seqlen_cache=512,
                        cache_lens=[0, 0, 0], nkv=2, group=4, head_size=128, dtype="bf16")
        for n in ("q", "k", "v"):
            d[n][...] = cp.asarray(new[n])
        d["cache_seqlens"][...] = cp.asarray(lens)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        step_case = dict(case, q=new["q"], k=new["k"], v=new["v"], cache_seqlens=lens,
                         k_cache=host_kc, v_cache=host_vc)
        ref, _, host_kc, host_vc = reference(step_case, 1 / math.sqrt(128), causal=True)
        check_attention(out.reshape(3, 8, 128), None, ref.reshape(3, 8, 128), None, BF16)
        assert np.array_equal(d["k_cache"].get().astype(np.float32),
                              host_kc.astype(np.float32), equal_nan=True)


@pytest.mark.gpu
def test_strided_q_and_caches_views(rng):
    """q a slice of a fused qkv buffer, caches views of wider buffers (row strides that
    are not the packed ones)."""
    import cupy as cp
    case = make_case(rng, batch=2, seqlen_q=70, seqlen_new=70, seqlen_cache=400,
                     cache_lens=[50, 200], nkv=2, group=2, head_size=64, dtype="bf16")
    qkv = cp.zeros((2, 70, 3 * 4, 64), BF16)
    qkv[:, :, :4] = cp.asarray(case["q"])
    wide_k = cp.full((3, 400, 3, 64), np.nan, BF16)
    wide_v = cp.full((3, 400, 3, 64), np.nan, BF16)
    wide_k[:, :, :2] = cp.asarray(case["k_cache"])
    wide_v[:, :, :2] = cp.asarray(case["v_cache"])
    cp.cuda.Device().synchronize()
    for path in FLASH_PATHS:
        kc, vc = wide_k[:, :, :2].copy(), wide_v[:, :, :2].copy()
        wk, wv = cp.full_like(wide_k, np.nan), cp.full_like(wide_v, np.nan)
        wk[:, :, :2], wv[:, :, :2] = kc, vc
        with forced_flash_path(path):
            out, lse = cuattn.flash_with_kvcache(
                qkv[:, :, :4], wk[:, :, :2], wv[:, :, :2], cp.asarray(case["k"]),
                cp.asarray(case["v"]), cache_seqlens=cp.asarray(case["cache_seqlens"]),
                cache_batch_idx=cp.asarray(case["rows"]), causal=True, return_lse=True)
        cp.cuda.Device().synchronize()
        check_case(case, (out, lse), dict(k_cache=wk[:, :, :2], v_cache=wv[:, :, :2]),
                   "bf16", 1 / math.sqrt(64), causal=True)
