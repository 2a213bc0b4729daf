"""Scales in device memory and ALiBi slopes per sequence, as engines pass them.

- k_scale / v_scale as float32 device arrays of shape (), (1,) or (nheads_kv,)
  (cuattn.paged.scales): paged_attention (the CUDA-core form and the flash form),
  paged_prefill (the flash form, split and not, every hook) and reshape_and_cache, against
  the float64 reference over what the fp8 cache means with those scales; a captured graph
  replays with new scales.
- alibi_slopes of shape (batch, nheads) (FlashAttention-2's second shape; a view with a row
  stride) in every function that takes slopes, each sequence against the reference with its
  own row. (The backward's: tests/test_flash_bwd.py test_bwd_alibi_per_batch.)
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import tuning
from tests import test_kvcache as kvc
from tests import test_paged as tp
from tests import test_prefill as tpf
from tests.paths import FLASH_PATHS, forced_flash_path
from tests.reference import attention_reference, check_attention

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SHAPES = [(), (1,), (2,)]     # nheads_kv = 2 in every case below


def _scales(rng, shape, nkv=2):
    """(k, v) scales of ``shape`` as host float32 arrays, and the (nkv,) values each KV
    head sees (one value for () and (1,))."""
    k = rng.uniform(0.02, 0.08, shape).astype(np.float32)
    v = rng.uniform(0.01, 0.05, shape).astype(np.float32)
    per_head = [np.broadcast_to(x.reshape(-1), (nkv,)).copy() for x in (k, v)]
    return (k, v), per_head


def _slope_rows(rng, rows: int, nheads: int):
    """(batch, nheads) slopes on the device as a view whose rows are nheads + 3 apart, and
    the host rows."""
    import cupy as cp
    host = rng.uniform(0.02, 0.3, (rows, nheads + 3)).astype(np.float32)
    return cp.asarray(host)[:, 1:nheads + 1], host[:, 1:nheads + 1]


# -- k_scale / v_scale in device memory --------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
@pytest.mark.parametrize("shape", SCALE_SHAPES, ids=["scalar", "one", "per-head"])
@pytest.mark.parametrize("which,num_splits", [("", 0), ("softcap+alibi+sinks", 3)])
def test_prefill_device_scales(rng, layout, shape, which, num_splits):
    """paged_prefill over an fp8 cache whose scales are device arrays: each KV head's values
    mean e4m3 x its scale, through every hook (the K scale joins the softmax scale, the
    softcap and the ALiBi / sink units on the device)."""
    import cupy as cp
    (k_s, v_s), (k_h, v_h) = _scales(rng, shape)
    b = tpf.make_batch(rng, contexts=[900, 20, 400], q_lens=[3, 20, 130], nkv=2, group=4,
                       head_size=128, block_size=16, dtype="bf16", layout=layout,
                       fp8_scales=(k_h[:, None], v_h[:, None]))
    kw = tpf.hook_values(rng, 8, which)
    out, lse = tpf.run_prefill(b, kv_layout=layout, num_splits=num_splits, causal=True,
                               k_scale=cp.asarray(k_s), v_scale=cp.asarray(v_s), **kw)
    ref = tpf.batch_reference(b, 1 / math.sqrt(128), causal=True, **tpf._ref_kw(kw))
    tpf.check(out, lse, *ref, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("shape", SCALE_SHAPES, ids=["scalar", "one", "per-head"])
def test_decode_device_scales(rng, version, shape):
    """paged_attention's CUDA-core form over an fp8 vLLM cache with device scales."""
    import cupy as cp
    (k_s, v_s), (k_h, v_h) = _scales(rng, shape)
    case = tp.make_case(rng, lengths=tp.LENGTHS(16), nkv=2, gqa=4, head_size=128,
                        block_size=16, dtype="bf16", cache_kind="e4m3",
                        k_scale=k_h[:, None], v_scale=v_h[:, None], alibi=True)
    scale = 1 / math.sqrt(128)
    ref = tp.paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                             case["seq_lens"], scale, k_h[:, None, None], v_h[:, None],
                             case["alibi_slopes"])
    tp._run(case, tp._to_device(case), "bf16", version, ref=ref,
            k_scale=cp.asarray(k_s), v_scale=cp.asarray(v_s))


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_decode_nhd_fp8_device_scales(rng, version):
    """paged_attention over an fp8 NHD cache (the flash form) with per-head device scales."""
    import cupy as cp
    (k_s, v_s), (k_h, v_h) = _scales(rng, (2,))
    contexts = [1, 700, 0, 2049, 17]
    b = tpf.make_batch(rng, contexts=contexts, q_lens=[1] * len(contexts), nkv=2, group=4,
                       head_size=128, block_size=16, dtype="bf16", layout="nhd",
                       fp8_scales=(k_h[:, None], v_h[:, None]))
    kw = tpf.hook_values(rng, 8, "softcap+alibi+sinks")
    out, lse = tpf.run_decode(b, kv_layout="nhd", version=version, k_scale=cp.asarray(k_s),
                              v_scale=cp.asarray(v_s), **kw)
    refs = [attention_reference(b["q"][s:s + 1], b["ks"][s], b["vs"][s], 1 / math.sqrt(128),
                                causal=True, **tpf._ref_kw(kw)) for s in range(len(contexts))]
    check_attention(out, lse, np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs], axis=1), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_graph_replays_with_new_scales(rng, op):
    """A graph captured once reads the scales at each replay: new values in the same arrays
    change what the cache means (e4m3 x the new scale), as vLLM's calibrated scales do."""
    import cupy as cp
    (k_s, v_s), (k_h, v_h) = _scales(rng, (2,))
    b = tpf.make_batch(rng, contexts=[300, 1000], q_lens=[1, 1] if op == "decode" else [30, 200],
                       nkv=2, group=4, head_size=128, block_size=16, dtype="bf16",
                       layout="vllm", fp8_scales=(k_h[:, None], v_h[:, None]))
    d = tpf.on_device(b, {})
    k_dev, v_dev = cp.asarray(k_s), cp.asarray(v_s)
    out = cp.empty(b["q"].shape, b["q"].dtype)
    if op == "decode":
        def call():
            cuattn.paged_attention(d["q"], d["k_cache"], d["v_cache"], d["block_tables"],
                                   d["seq_lens"], k_scale=k_dev, v_scale=v_dev, out=out)
    else:
        def call():
            cuattn.paged_prefill(d["q"], d["k_cache"], d["v_cache"], d["block_tables"],
                                 d["seq_lens"], d["cu_seqlens_q"], b["max_seqlen_q"],
                                 k_scale=k_dev, v_scale=v_dev, out=out)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call()                                   # compile outside the capture
        stream.begin_capture()
        call()
        graph = stream.end_capture()
    new_k, new_v = k_h * np.float32(1.5), v_h * np.float32(0.5)
    k_dev.set(new_k)
    v_dev.set(new_v)
    out.fill(np.nan)
    cp.cuda.Device().synchronize()   # (the replay's stream does not wait for the legacy one)
    graph.launch(stream)
    stream.synchronize()
    ratio_k, ratio_v = (new_k / k_h)[None, :, None], (new_v / v_h)[None, :, None]
    b["ks"] = [k * ratio_k for k in b["ks"]]       # what the cache means now
    b["vs"] = [v * ratio_v for v in b["vs"]]
    ref, _ = tpf.batch_reference(b, 1 / math.sqrt(128), causal=True)
    check_attention(out, None, ref, None, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
@pytest.mark.parametrize("shape", [(), (3,)], ids=["scalar", "per-head"])
def test_reshape_and_cache_device_scales(rng, layout, shape):
    """reshape_and_cache into an fp8 cache stores round-to-nearest(key / k_scale[head])."""
    import cupy as cp
    nkv, hs, bs, num_blocks, n = 3, 128, 16, 12, 50
    (k_s, v_s), (k_h, v_h) = _scales(rng, shape, nkv)
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, nkv, hs, bs, E4M3,
                                                  kv_layout=layout)
    kc, vc = cp.zeros(kshape, np.uint8), cp.zeros(vshape, np.uint8)
    key = rng.standard_normal((n, nkv, hs)).astype(BF16)
    value = rng.standard_normal((n, nkv, hs)).astype(BF16)
    slots = rng.permutation(num_blocks * bs)[:n].astype(np.int32)
    cuattn.reshape_and_cache(cp.asarray(key), cp.asarray(value), kc, vc, cp.asarray(slots),
                             k_scale=cp.asarray(k_s), v_scale=cp.asarray(v_s),
                             kv_layout=layout)
    k_want = np.zeros(kshape, np.uint8)
    v_want = np.zeros(vshape, np.uint8)
    kq = (key.astype(np.float32) / k_h[:, None]).astype(E4M3).view(np.uint8)
    vq = (value.astype(np.float32) / v_h[:, None]).astype(E4M3).view(np.uint8)
    blk, off = slots // bs, slots % bs
    tpf.write_tokens(k_want, v_want, layout, blk, off, kq, vq)
    assert np.array_equal(kc.get(), k_want)
    assert np.array_equal(vc.get(), v_want)


# -- ALiBi slopes (batch, nheads) ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_flash_forward_alibi_per_batch(rng, path):
    import cupy as cp
    b, sq, sk, h, hkv, d = 3, 150, 333, 4, 2, 128
    q = rng.standard_normal((b, sq, h, d)).astype(BF16)
    k = rng.standard_normal((b, sk, hkv, d)).astype(BF16)
    v = rng.standard_normal((b, sk, hkv, d)).astype(BF16)
    slopes, host = _slope_rows(rng, b, h)
    with forced_flash_path(path):
        out, lse = cuattn.flash_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                        causal=True, alibi_slopes=slopes, return_lse=True)
    scale = 1 / math.sqrt(d)
    refs = [attention_reference(q[i], k[i], v[i], scale, causal=True, alibi=host[i])
            for i in range(b)]
    check_attention(out.reshape(b * sq, h, d), lse.transpose(1, 0, 2).reshape(h, b * sq),
                    np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs], axis=1), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_flash_varlen_forward_alibi_per_batch(rng, path):
    import cupy as cp
    lens_q, lens_k, h, hkv, d = [37, 0, 1, 200], [50, 9, 1, 260], 6, 2, 64
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], h, d)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float16)
    slopes, host = _slope_rows(rng, len(lens_q), h)
    with forced_flash_path(path):
        out, lse = cuattn.flash_varlen_forward(
            cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu_q), cp.asarray(cu_k),
            max(lens_q), max(lens_k), causal=True, softcap=8.0, alibi_slopes=slopes,
            return_lse=True, num_splits=0)
    refs = [attention_reference(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]],
                                v[cu_k[i]:cu_k[i + 1]], 1 / math.sqrt(d), causal=True,
                                softcap=8.0, alibi=host[i]) for i in range(len(lens_q))]
    check_attention(out, lse, np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs], axis=1), np.dtype(np.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_flash_with_kvcache_alibi_per_batch(rng, path):
    case = kvc.make_case(rng, batch=3, seqlen_q=70, seqlen_new=6, seqlen_cache=600,
                         cache_lens=[500, 0, 80], nkv=2, group=3, head_size=128, dtype="bf16")
    slopes, host = _slope_rows(rng, 3, 6)
    scale = 1 / math.sqrt(128)
    refs = []
    for i in range(3):      # each row alone, with its own slopes (before the append below)
        one = {n: (x[i:i + 1] if isinstance(x, np.ndarray) and n not in ("k_cache", "v_cache")
                   else x) for n, x in case.items()}
        refs.append(kvc.reference(one, scale, causal=True, alibi=host[i])[:2])
    with forced_flash_path(path):
        (out, lse), _ = kvc.run(case, causal=True, alibi_slopes=slopes, return_lse=True)
    ref = np.concatenate([r[0] for r in refs])
    ref_lse = np.concatenate([r[1] for r in refs])
    check_attention(out.reshape(-1, *out.shape[2:]),
                    lse.transpose(1, 0, 2).reshape(lse.shape[1], -1),
                    ref.reshape(-1, *ref.shape[2:]),
                    ref_lse.transpose(1, 0, 2).reshape(ref_lse.shape[1], -1), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["simt", "mma"])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_paged_attention_alibi_per_sequence(rng, form, version):
    case = tp.make_case(rng, lengths=tp.LENGTHS(16), nkv=2, gqa=4, head_size=128,
                        block_size=16, dtype="bf16")
    slopes, host = _slope_rows(rng, len(tp.LENGTHS(16)), 8)
    scale = 1 / math.sqrt(128)
    outs, lses = [], []
    for s in range(len(host)):
        o, l_ = tp.paged_reference(case["q"][s:s + 1], case["k_cache"], case["v_cache"],
                                   case["block_tables"][s:s + 1], case["seq_lens"][s:s + 1],
                                   scale, alibi=host[s])
        outs.append(o)
        lses.append(l_)
    dcase = tp._to_device(case)
    dcase["alibi_slopes"] = slopes
    with tuning.override(paged_form=form):
        tp._run(case, dcase, "bf16", version,
                ref=(np.concatenate(outs), np.concatenate(lses, axis=1)))


@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
@pytest.mark.parametrize("q_lens", [[1, 2, 16, 0, 5], [1, 2, 160, 0, 5]], ids=["few", "chunk"])
def test_paged_prefill_alibi_per_sequence(rng, path, layout, q_lens):
    """Both forms of paged_prefill (few tokens: multi-token decode; a chunk: the flash form,
    on each flash kernel)."""
    contexts = [40, 3000, 200, 7, 1030]
    b = tpf.make_batch(rng, contexts=contexts, q_lens=q_lens, nkv=2, group=4, head_size=128,
                       block_size=16, dtype="bf16", layout=layout)
    slopes, host = _slope_rows(rng, len(contexts), 8)
    with forced_flash_path(path):
        out, lse = tpf.run_prefill(b, kv_layout=layout, causal=True, alibi_slopes=slopes)
    scale = 1 / math.sqrt(128)
    cu = b["cu_seqlens_q"]
    refs = [attention_reference(b["q"][cu[s]:cu[s + 1]], b["ks"][s], b["vs"][s], scale,
                                causal=True, alibi=host[s]) for s in range(len(contexts))]
    check_attention(out, lse, np.concatenate([r[0] for r in refs]),
                    np.concatenate([r[1] for r in refs], axis=1), BF16)
