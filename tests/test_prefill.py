"""paged_prefill, the NHD cache layout, and the hooks (softcap, ALiBi, sinks, windows) of the
attention functions.

CPU: every reachable paged_prefill form and every hooked flash form compiles without spills
(marker slow; the default run compiles the lightest and heaviest of each sweep:
tests/compiled.py); the tile rule; the NHD shapes. GPU (marker ``gpu``; the flash form's NHD calls on both flash
kernels, tests/paths.py): a float64 NumPy reference
(tests/reference.py attention_reference) over K/V gathered token by token through the block
table by plain indexing of the documented layouts, independent of the library's layout
code; every slot a sequence must not read holds NaN.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import _tma, tuning
from cuattn.constants import (FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, KV_PAGED_NHD, KV_PAGED_VLLM,
                              MASK_CAUSAL, MASK_NONE, MASK_WINDOW)
from tests.compiled import compile_reports, unclean
from tests.paths import FLASH_PATHS, forced_flash_path
from tests.reference import attention_reference, check_attention, merge_reference, tolerance

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f16": np.dtype(np.float16), "bf16": BF16}
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
ALL_HOOKS = FEAT_SOFTCAP | FEAT_ALIBI | FEAT_SINKS


# -- CPU --------------------------------------------------------------------------------------

# The lightest and the heaviest (mask, split, features) of a sweep: what the default run
# compiles of it (tests/compiled.py).
EXTREMES = ((MASK_NONE, False, 0), (MASK_CAUSAL, True, ALL_HOOKS))


# Head sizes whose compiled head dims (32 to 256) cover every mma.sync kernel paged_prefill
# reaches (tuning.compiled_head_dim): 32, 160 and 224 only the flash form takes.
PREFILL_SWEEP_HEAD_SIZES = (32, 64, 80, 128, 160, 192, 224, 256)


def _prefill_forms(head_sizes=PREFILL_SWEEP_HEAD_SIZES, extremes_only=False):
    """The two outer tile classes (few rows, long chunks) x layout x mask x split, plain and
    hooked, at PREFILL_SWEEP_HEAD_SIZES; the classes between them (32 and 64 rows) in their
    lightest and heaviest forms only (CI's compile time)."""
    every = [(mask, split, f) for mask, split in ((0, False), (1, False), (2, False), (1, True))
             for f in (0, ALL_HOOKS)]
    out = []
    for hs in head_sizes:
        for kv in (KV_PAGED_NHD, KV_PAGED_VLLM):
            for rows in (8, 32, 64, 2048):
                if extremes_only and rows not in (8, 2048):
                    continue
                for mask, split, features in (every if rows in (8, 2048) and not extremes_only
                                              else EXTREMES):
                    out.append(tuning.paged_prefill_variant(
                        "bf16", hs, mask=mask, split=split, arch="sm_90", kv=kv,
                        features=features, rows=rows))
    return list(dict.fromkeys(out))


@pytest.mark.slow
def test_prefill_forms_compile_for_sm90_without_spills():
    assert unclean(compile_reports(_prefill_forms(), "sm_90")) == []


def test_a_few_prefill_forms_compile_for_sm90_without_spills():
    forms = _prefill_forms((32, 80, 256), extremes_only=True)
    assert unclean(compile_reports(forms, "sm_90")) == []


def _hooked_flash_forms(head_dims=tuning.FLASH_HEAD_DIMS, masks=(0, 1, 2), splits=(False, True)):
    return list(dict.fromkeys(
        tuning.flash_forward_variant("bf16", hd, mask=mask, split=split, arch="sm_90",
                                     features=f)
        for hd in head_dims for mask in masks for split in splits
        for f in (FEAT_SOFTCAP, FEAT_ALIBI | FEAT_SINKS)))


@pytest.mark.slow
def test_hooked_flash_forms_compile_for_sm90_without_spills():
    assert unclean(compile_reports(_hooked_flash_forms(), "sm_90")) == []


def test_a_few_hooked_flash_forms_compile_for_sm90_without_spills():
    forms = _hooked_flash_forms((max(tuning.FLASH_HEAD_DIMS),), masks=(MASK_WINDOW,),
                                splits=(True,))
    assert unclean(compile_reports(forms, "sm_90")) == []


def test_prefill_tile_rule():
    few = tuning.paged_prefill_variant("bf16", 128, mask=1, split=False, arch="sm_90",
                                       kv=KV_PAGED_VLLM, features=0, rows=8)
    assert (few.block_m, few.num_warps) == (16, 1) and few.name.endswith("_vllm_gqa")
    long = tuning.paged_prefill_variant("bf16", 128, mask=1, split=False, arch="sm_90",
                                        kv=KV_PAGED_NHD, features=FEAT_SINKS, rows=8192)
    assert long.block_m == 64 and long.name.endswith("_nhd_sink_gqa")
    wide = tuning.paged_prefill_variant("bf16", 256, mask=1, split=False, arch="sm_90",
                                        kv=KV_PAGED_VLLM, features=0, rows=8192)
    assert wide.block_n >= 32   # vLLM's V tile: rows of >= 4 chunks


def _fp8_forms(head_sizes=(32, 64, 128, 160, 224, 256), forms=((1, False, 0), (1, False, ALL_HOOKS),
                                                  (2, True, 0), (2, True, ALL_HOOKS))):
    """fp8 caches (the flash form with its widening pass) in both layouts, few and many rows,
    plain and hooked."""
    return list(dict.fromkeys(
        tuning.paged_prefill_variant("bf16", hs, mask=mask, split=split, arch="sm_90", kv=kv,
                                     features=f, rows=rows, fp8=True)
        for hs in head_sizes for kv in (KV_PAGED_NHD, KV_PAGED_VLLM) for rows in (8, 2048)
        for mask, split, f in forms))


def _check_fp8(forms) -> None:
    """(Some spill 4-104 B, the hooked NHD forms most: bench/NOTES.md; correctness is the GPU
    tests'.)"""
    reports = compile_reports(forms, "sm_90")
    assert all(v.fp8 and "e4m3" in v.name and r.registers <= 255 for v, r in reports)


@pytest.mark.slow
def test_fp8_forms_compile_for_sm90():
    _check_fp8(_fp8_forms())


def test_a_few_fp8_forms_compile_for_sm90():
    _check_fp8(_fp8_forms((256,), forms=((2, True, ALL_HOOKS),)))


def _few_token_forms(head_sizes=(64, 80, 96, 128, 192, 256), gqas=(4, 6), max_qs=(2, 8, 16),
                     partitions=(0, 512),
                     # NHD differs in the loads only: plain vLLM, hooked vLLM, hooked NHD
                     layouts=((False, False), (False, True), (True, True))):
    """Multi-token decode (paged_prefill's few-token form) at every head size, over GQA
    ratios whose groups are odd, even and cut down to fit the tokens: v1 and v2; vLLM's
    layout plain and with every hook, NHD with every hook."""
    out = []
    for hs in head_sizes:
        for gqa in gqas:
            for max_q in max_qs:
                tokens, group = tuning.paged_multi_token(hs, gqa, max_q)
                for ps in partitions:
                    for nhd, hooks in layouts:
                        out.append(tuning.paged_mma_variant(
                            "bf16", hs, 16, group, ps, hooks, softcap=hooks, sinks=hooks,
                            nhd=nhd, tokens=tokens))
    return list(dict.fromkeys(out))


# The masks of the paged forms compiled below: every one for NHD; for vLLM's layout, whose
# forms differ from NHD's only in the producer's boxes, its edge copy and the K / V
# descriptors, the lightest and the heaviest.
_PAGED_MASKS = {KV_PAGED_NHD: ((MASK_NONE, False), (MASK_CAUSAL, False), (MASK_WINDOW, False),
                               (MASK_CAUSAL, True), (MASK_WINDOW, True)),
                KV_PAGED_VLLM: ((MASK_CAUSAL, False), (MASK_WINDOW, True))}


def _hopper_paged_forms(kv, head_dims=sorted(tuning.FLASH_SM90_TILES), forms=None):
    """The Hopper kernel's paged (TMA) forms long chunks reach, for a layout: its masks
    (_PAGED_MASKS), plain and every hook, at the head dims of its tile table, and the
    short causal tiles (``forms``: those (mask, split, features) instead)."""
    forms = forms or [(mask, split, f) for mask, split in _PAGED_MASKS[kv] for f in (0, ALL_HOOKS)]
    out = [tuning.flash_sm90_variant("bf16", hd, mask=mask, split=split, features=f, tma=True,
                                     seqlen_q=2048, kv=kv)
           for hd in head_dims for mask, split, f in forms]
    out += [tuning.flash_sm90_variant("bf16", 64, mask=MASK_CAUSAL, split=False, tma=True,
                                      seqlen_q=64, kv=kv)]     # short causal tiles
    return list(dict.fromkeys(out))


_LAYOUTS = [(KV_PAGED_NHD, "_nhd"), (KV_PAGED_VLLM, "_vllm")]


@pytest.mark.slow
@pytest.mark.parametrize("kv,name", _LAYOUTS)
def test_hopper_paged_forms_compile_for_sm90a_without_spills(kv, name):
    forms = _hopper_paged_forms(kv)
    assert all(v.kv == kv and name in v.name for v in forms)
    assert unclean(compile_reports(forms, "sm_90")) == []


@pytest.mark.parametrize("kv,name", _LAYOUTS)
def test_a_few_hopper_paged_forms_compile_for_sm90a_without_spills(kv, name):
    forms = _hopper_paged_forms(kv, (max(tuning.FLASH_SM90_TILES),), forms=EXTREMES)
    assert all(v.kv == kv and name in v.name for v in forms)
    assert unclean(compile_reports(forms, "sm_90")) == []


def test_hopper_paged_prefill_rule():
    """Long chunks over 16-bit caches of blocks of >= 8 tokens, in either layout, take the
    Hopper kernel on sm_90 (its boxes stay inside one cache block and hold whole core
    matrices or swizzle periods); fp8, smaller NHD blocks and other GPUs keep the mma.sync
    kernel."""
    assert tuning.paged_prefill_path("sm_90", 128, "nhd", 16, "bf16") == "wgmma"
    assert tuning.paged_prefill_path("sm_90", 80, "nhd", 8, "f16") == "wgmma"
    assert tuning.paged_prefill_path("sm_90", 128, "nhd", 4, "bf16") == "mma"
    for bs in (8, 16, 32):
        assert tuning.paged_prefill_path("sm_90", 112, "vllm", bs, "f16") == "wgmma"
    assert tuning.paged_prefill_path("sm_90", 128, "vllm", 16, "e4m3") == "mma"
    assert tuning.paged_prefill_path("sm_90", 128, "nhd", 16, "e4m3") == "mma"
    assert tuning.paged_prefill_path("sm_80", 128, "nhd", 16, "bf16") == "mma"
    with tuning.override(flash_path="mma"):
        assert tuning.paged_prefill_path("sm_90", 128, "nhd", 16, "bf16") == "mma"
    # a box's keys: the block size, at most the power of two dividing BLOCK_N
    assert [_tma.paged_box_rows(bn, bs) for bn, bs in
            ((128, 16), (128, 256), (80, 64), (48, 8), (64, 64))] == [16, 128, 16, 8, 64]


@pytest.mark.slow
def test_few_token_forms_compile_for_sm90_without_spills():
    assert unclean(compile_reports(_few_token_forms(), "sm_90")) == []


def test_a_few_few_token_forms_compile_for_sm90_without_spills():
    forms = _few_token_forms((80, 256), gqas=(6,), max_qs=(16,), partitions=(512,),
                             layouts=((False, False), (True, True)))
    assert unclean(compile_reports(forms, "sm_90")) == []


def test_few_token_rule():
    assert tuning.paged_multi_token(128, 4, 1) == (2, 4)      # rows of cu_seqlens_q, not decode's
    assert tuning.paged_multi_token(128, 4, 4) == (4, 4)      # 16 columns
    assert tuning.paged_multi_token(128, 4, 16) == (16, 2)    # 32 columns: half the group
    assert tuning.paged_multi_token(128, 8, 3) == (4, 8)
    assert tuning.paged_multi_token(256, 8, 8) == (8, 2)      # hd256: 16 columns
    assert tuning.paged_multi_token(96, 6, 4) == (4, 6)       # 24 columns: 3 n-tiles
    # multi-token decode rings: two stages for 4-8 tokens (verify_sweep), else decode's ring
    assert [tuning.paged_mma_variant("bf16", 128, 16, 4, 0, False, tokens=t).stages
            for t in (2, 4, 8, 16)] == [3, 2, 2, 3]
    assert tuning.paged_mma_variant("bf16", 128, 16, 4, 0, False).stages == \
        tuning.paged_mma_tiles(128).stages == 3
    form = tuning.paged_prefill_form
    assert form("bf16", 128, 16, 1000) == "decode"
    assert form("bf16", 128, 17, 1000) == "flash"             # a chunk
    assert form("bf16", 128, 0, 0) == "flash"
    assert form("bf16", 120, 4, 1000) == "flash"              # not a multiple of 16
    assert form("e4m3", 128, 4, 1000) == "flash"
    assert form("bf16", 128, 4, 70000) == "flash"             # the reduce's grid rows
    with tuning.override(prefill_form="flash"):
        assert form("bf16", 128, 4, 1000) == "flash"
    with tuning.override(prefill_form="decode"):
        assert form("bf16", 128, 32, 1000) == "decode"        # 32 columns at hd128
        assert form("bf16", 128, 33, 1000) == "flash"         # where it can run only
        assert form("bf16", 120, 4, 1000) == "flash"


def _nhd_512_forms(head_sizes=(64, 128, 256), shapes=((1, 1), (4, 1), (2, 8)),
                   partitions=(0, 512), hooks=(False, True)):
    """The tensor-core decode kernel over NHD blocks of 512 tokens (paged_attention and
    multi-token decode): (group, tokens) shapes, v1 / v2, plain and with every hook."""
    return list(dict.fromkeys(
        tuning.paged_mma_variant("bf16", hs, 512, g, ps, h, softcap=h, sinks=h, nhd=True,
                                 tokens=tok)
        for hs in head_sizes for g, tok in shapes for ps in partitions for h in hooks))


@pytest.mark.slow
def test_nhd_512_decode_forms_compile_for_sm90_without_spills():
    assert unclean(compile_reports(_nhd_512_forms(), "sm_90")) == []


def test_a_few_nhd_512_decode_forms_compile_for_sm90_without_spills():
    forms = _nhd_512_forms((256,), shapes=((2, 8),), partitions=(0,), hooks=(True,))
    assert unclean(compile_reports(forms, "sm_90")) == []


def test_prefill_head_sizes_and_forms():
    """paged_prefill takes flash_forward's head sizes; those outside paged_attention's run on
    the flash form at every query length, and on Hopper those up to 32 on mma.sync."""
    from cuattn.paged import HEAD_SIZES, PREFILL_HEAD_SIZES
    assert PREFILL_HEAD_SIZES == tuple(range(8, 257, 8)) and set(HEAD_SIZES) < set(
        PREFILL_HEAD_SIZES)
    form = tuning.paged_prefill_form
    for hs in (16, 32, 48, 144, 160, 224, 240):
        assert not tuning.tensor_core_decode_fits("bf16", hs)
        assert form("bf16", hs, 4, 100) == "flash"
        with tuning.override(prefill_form="decode"):
            assert form("bf16", hs, 4, 100) == "flash"
    assert form("bf16", 64, 4, 100) == form("bf16", 192, 4, 100) == "decode"
    assert [tuning.paged_prefill_path("sm_90", hs, "nhd", 16, "bf16")
            for hs in (8, 32, 40, 72, 160, 224)] == ["mma", "mma"] + ["wgmma"] * 4
    v = tuning.paged_prefill_variant("bf16", 40, mask=1, split=False, arch="sm_90",
                                     kv=KV_PAGED_VLLM, features=0, rows=8192)
    assert v.head_dim == 64


def test_prefill_cache_shapes_every_head_size():
    for hs in (8, 40, 72, 136, 232):
        assert cuattn.paged_kv_cache_shapes(3, 2, hs, 16, BF16) == \
            ((3, 2, hs // 8, 16, 8), (3, 2, hs, 16))
        assert cuattn.paged_kv_cache_shapes(3, 2, hs, 512, BF16, kv_layout="nhd")[0] == \
            (3, 512, 2, hs)
    assert cuattn.paged_kv_cache_shapes(3, 2, 48, 8, FP8)[0] == (3, 2, 3, 8, 16)
    for layout in ("vllm", "nhd"):
        with pytest.raises(ValueError, match="head_size"):
            cuattn.paged_kv_cache_shapes(3, 2, 40, 16, FP8, kv_layout=layout)
        with pytest.raises(ValueError, match="head_size"):
            cuattn.paged_kv_cache_shapes(3, 2, 264, 16, BF16, kv_layout=layout)
    with pytest.raises(ValueError, match="block_size"):
        cuattn.paged_kv_cache_shapes(3, 2, 64, 1024, BF16, kv_layout="nhd")


def test_nhd_cache_shapes():
    k, v = cuattn.paged_kv_cache_shapes(10, 4, 128, 1, BF16, kv_layout="nhd")
    assert k == v == (10, 1, 4, 128)
    k, v = cuattn.paged_kv_cache_shapes(3, 2, 64, 256, np.float16, kv_layout="nhd")
    assert k == (3, 256, 2, 64)
    with pytest.raises(ValueError, match="block_size"):
        cuattn.paged_kv_cache_shapes(3, 2, 64, 48, np.float16, kv_layout="nhd")
    with pytest.raises(ValueError, match="kv_layout"):
        cuattn.paged_kv_cache_shapes(3, 2, 64, 16, np.float16, kv_layout="hnd")


# -- the paged cache of a batch, by plain indexing ---------------------------------------------

def write_tokens(k_cache, v_cache, layout, blk, off, k, v):
    """Tokens (n, nkv, hs) into slots (blk, off) of the documented layouts."""
    if layout == "nhd":          # [blk, off, h, d]
        k_cache[blk, off] = k
        v_cache[blk, off] = v
    else:                        # K [blk, h, d // x, off, d % x], V [blk, h, d, off]
        x = k_cache.shape[4]
        n, nkv, hs = k.shape
        k_cache[blk, :, :, off, :] = k.reshape(n, nkv, hs // x, x)
        v_cache[blk, :, :, off] = v


def make_batch(rng, *, contexts, q_lens, nkv, group, head_size, block_size, dtype, layout,
               extra_table=2, shared_prefix=0, fp8_scales=None):
    """Host arrays of one paged_prefill batch: sequence s has contexts[s] tokens in the cache
    (its last q_lens[s] being the new ones; fewer than q_lens[s] is allowed: docs/api.md,
    paged_prefill) in shuffled physical blocks; NaN in every slot a
    sequence must not read (past its length, unreferenced blocks, table entries past its
    end). shared_prefix > 0: every sequence's first shared_prefix tokens (whole blocks) are
    the same blocks of the cache. fp8_scales = (k_scale, v_scale): an fp8 e4m3 cache holding
    K / k_scale and V / v_scale, and ks / vs (the reference's) the values it means: e4m3 x
    scale, exactly (float64)."""
    dt = DTYPES[dtype]
    cache_dt = dt if fp8_scales is None else FP8
    nheads = nkv * group
    bps = [-(-n // block_size) for n in contexts]
    shared_blocks = shared_prefix // block_size
    max_blocks = max(bps) + extra_table
    own = sum(b - shared_blocks for b in bps)
    num_blocks = shared_blocks + own + 5
    perm = rng.permutation(num_blocks)
    nan_block = int(perm[-1])
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, nkv, head_size, block_size,
                                                  cache_dt, kv_layout=layout)
    k_cache = np.full(kshape, np.nan, cache_dt)
    v_cache = np.full(vshape, np.nan, cache_dt)
    block_tables = np.full((len(contexts), max_blocks), nan_block, np.int32)
    prefix_k = rng.standard_normal((shared_prefix, nkv, head_size)).astype(dt)
    prefix_v = rng.standard_normal((shared_prefix, nkv, head_size)).astype(dt)
    nxt = shared_blocks
    ks, vs = [], []
    for s, n in enumerate(contexts):
        block_tables[s, :shared_blocks] = perm[:shared_blocks]
        block_tables[s, shared_blocks:bps[s]] = perm[nxt:nxt + bps[s] - shared_blocks]
        nxt += bps[s] - shared_blocks
        k = rng.standard_normal((n, nkv, head_size)).astype(dt)
        v = rng.standard_normal((n, nkv, head_size)).astype(dt)
        k[:shared_prefix], v[:shared_prefix] = prefix_k[:n], prefix_v[:n]
        tok = np.arange(n)
        if fp8_scales is not None:     # what the cache holds, and what it means
            kq = (k.astype(np.float32) / fp8_scales[0]).astype(FP8)
            vq = (v.astype(np.float32) / fp8_scales[1]).astype(FP8)
            write_tokens(k_cache, v_cache, layout, block_tables[s, tok // block_size],
                         tok % block_size, kq, vq)
            # the documented meaning (paged_prefill: value * k_scale / v_scale), unrounded
            k = kq.astype(np.float64) * fp8_scales[0]
            v = vq.astype(np.float64) * fp8_scales[1]
        else:
            write_tokens(k_cache, v_cache, layout, block_tables[s, tok // block_size],
                         tok % block_size, k, v)
        ks.append(k)
        vs.append(v)
    q = rng.standard_normal((sum(q_lens), nheads, head_size)).astype(dt)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=np.array(contexts, np.int32), cu_seqlens_q=cu, ks=ks, vs=vs,
                max_seqlen_q=max(q_lens, default=0))


def batch_reference(b, scale, **hooks):
    """Per sequence attention_reference of its new tokens over its whole context."""
    outs, lses = [], []
    for s in range(len(b["ks"])):
        q = b["q"][b["cu_seqlens_q"][s]:b["cu_seqlens_q"][s + 1]]
        o, lse = attention_reference(q, b["ks"][s], b["vs"][s], scale, **hooks)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


def check(out, lse, ref, ref_lse, dtype):
    check_attention(out, lse, ref, ref_lse, DTYPES[dtype])


def on_device(b, kw):
    """The batch's arrays and the hooks' arrays of ``kw`` as CuPy arrays."""
    import cupy as cp
    for name in ("alibi_slopes", "sinks"):
        if kw.get(name) is not None:
            kw[name] = cp.asarray(kw[name])
    # (fp8 caches travel as their uint8 view: CuPy has no float8 dtype)
    return {k: cp.asarray(v.view(np.uint8) if v.dtype == FP8 else v) for k, v in b.items()
            if isinstance(v, np.ndarray)}


def run_prefill(b, **kw):
    import cupy as cp
    d = on_device(b, kw)
    out = cp.full(b["q"].shape, np.nan, dtype=b["q"].dtype)
    res, lse = cuattn.paged_prefill(
        d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"],
        d["cu_seqlens_q"], b["max_seqlen_q"], return_lse=True, out=out, **kw)
    assert res is out and lse.shape == (b["q"].shape[1], b["q"].shape[0])
    return out, lse


def run_prefill_padded(b, pad, **kw):
    """run_prefill with `pad` query rows past cu_seqlens_q[-1] (rows no sequence covers),
    which must stay untouched (NaN); -> (out, lse, the covered rows)."""
    real = b["q"].shape[0]
    b["q"] = np.concatenate([b["q"], b["q"][:pad]])
    out, lse = run_prefill(b, **kw)
    assert bool(np.isnan(out[real:].get().astype(np.float32)).all())
    return out, lse, real


def hook_values(rng, nheads, which):
    """softcap / alibi_slopes / sinks values for the hooks named in ``which``."""
    kw = {}
    if "softcap" in which:
        kw["softcap"] = 4.0
    if "alibi" in which:
        kw["alibi_slopes"] = (2.0 ** -(8.0 * np.arange(1, nheads + 1) / nheads)).astype(np.float32)
    if "sinks" in which:
        kw["sinks"] = rng.uniform(-2, 3, nheads).astype(np.float32)
    return kw


def _ref_kw(kw):
    return dict(softcap=kw.get("softcap", 0.0), alibi=kw.get("alibi_slopes"),
                sinks=kw.get("sinks"))


# -- GPU: paged_prefill ------------------------------------------------------------------------

MIXED_Q = [1, 2, 16, 0, 5, 700]          # speculative, empty and chunk-sized queries in one batch
MIXED_CTX = [40, 3000, 16, 7, 1030, 2000]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size", [("vllm", 8), ("vllm", 16), ("vllm", 32),
                                               ("nhd", 1), ("nhd", 16), ("nhd", 256),
                                               ("nhd", 512)])
def test_mixed_query_lengths_both_layouts(rng, layout, block_size):
    b = make_batch(rng, contexts=MIXED_CTX, q_lens=MIXED_Q, nkv=2, group=4, head_size=128,
                   block_size=block_size, dtype="bf16", layout=layout)
    scale = 1 / math.sqrt(128)
    out, lse = run_prefill(b, kv_layout=layout)
    check(out, lse, *batch_reference(b, scale, causal=True), "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,group,dtype", [(64, 1, "f16"), (80, 8, "bf16"),
                                                   (96, 2, "f16"), (192, 4, "bf16"),
                                                   (256, 2, "bf16")])
@pytest.mark.parametrize("q_lens", [[3, 1, 8], [300, 17, 64]], ids=["spec", "chunk"])
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_head_sizes_groups_dtypes(rng, head_size, group, dtype, q_lens, layout):
    b = make_batch(rng, contexts=[500, 33, 129], q_lens=q_lens, nkv=2, group=group,
                   head_size=head_size, block_size=16, dtype=dtype, layout=layout)
    out, lse = run_prefill(b, kv_layout=layout)
    check(out, lse, *batch_reference(b, 1 / math.sqrt(head_size), causal=True), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["softcap", "alibi", "sinks", "softcap+alibi+sinks"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)),
                                           (True, (100, 0)), (False, (64, 16))])
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_prefill_hooks_windows_and_splits(rng, which, causal, window, num_splits, path):
    b = make_batch(rng, contexts=[900, 20, 400], q_lens=[2, 20, 130], nkv=2, group=4,
                   head_size=128, block_size=16, dtype="bf16", layout="nhd")
    kw = hook_values(rng, 8, which)
    scale = 0.3
    with forced_flash_path(path):
        out, lse = run_prefill(b, kv_layout="nhd", causal=causal, window_size=window,
                               softmax_scale=scale, num_splits=num_splits, **kw)
        assert runs_on_hopper() == (path == "wgmma")
    ref = batch_reference(b, scale, causal=causal, window=window, **_ref_kw(kw))
    check(out, lse, *ref, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_prefix_sharing(rng, layout):
    b = make_batch(rng, contexts=[700, 1200], q_lens=[100, 4], nkv=1, group=8, head_size=64,
                   block_size=16, dtype="f16", layout=layout, shared_prefix=512)
    assert (b["block_tables"][0, :32] == b["block_tables"][1, :32]).all()
    out, lse = run_prefill(b, kv_layout=layout)
    check(out, lse, *batch_reference(b, 1 / 8, causal=True), "f16")


@pytest.mark.gpu
def test_lse_merges_with_merge_attn_states(rng):
    """Keys split into two disjoint cached parts (two 'sequences' over the same queries):
    the two partial results merged equal attention over the union."""
    n, split_at, q_len, bs = 1500, 592, 37, 16      # split_at: a whole number of blocks
    b = make_batch(rng, contexts=[n], q_lens=[q_len], nkv=2, group=2, head_size=128,
                   block_size=bs, dtype="bf16", layout="vllm")
    ref, ref_lse = batch_reference(b, 1 / math.sqrt(128), causal=False)
    # part A: keys [0, split_at), part B: keys [split_at, n) as a sequence of its own
    table = b["block_tables"][0]
    outs, lses = [], []
    for first_block, length in ((0, split_at), (split_at // bs, n - split_at)):
        part = dict(b, block_tables=np.ascontiguousarray(table[None, first_block:]),
                    seq_lens=np.array([length], np.int32))
        o, lse = run_prefill(part, causal=False)
        outs.append(o)
        lses.append(lse)
    merged, merged_lse = cuattn.merge_attn_states(outs[0], lses[0], outs[1], lses[1])
    check(merged, merged_lse, ref, ref_lse, "bf16")
    _, m_lse = merge_reference(np.stack([o.get() for o in outs]),
                               np.stack([lse.get() for lse in lses]))
    assert np.allclose(m_lse, ref_lse, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size", [("vllm", 16), ("nhd", 64)])
def test_chunked_prefill_equals_one_flash_forward(rng, layout, block_size):
    """A 10,000-token prompt written (reshape_and_cache) and attended in chunks of 1024
    equals one causal flash_forward over the whole prompt, by FlashAttention's rule against
    a float32 reference."""
    import cupy as cp
    n, chunk, nkv, group, hs = 10_000, 1024, 2, 2, 64
    nheads = nkv * group
    q = cp.asarray(rng.standard_normal((n, nheads, hs)), dtype=cp.float16)
    k = cp.asarray(rng.standard_normal((n, nkv, hs)), dtype=cp.float16)
    v = cp.asarray(rng.standard_normal((n, nkv, hs)), dtype=cp.float16)
    num_blocks = -(-n // block_size) + 3
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, nkv, hs, block_size, np.float16,
                                                  kv_layout=layout)
    k_cache = cp.full(kshape, np.nan, cp.float16)
    v_cache = cp.full(vshape, np.nan, cp.float16)
    table = cp.asarray(rng.permutation(num_blocks)[None, :], dtype=cp.int32)
    out = cp.empty_like(q)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        tok = cp.arange(lo, hi)
        slots = (table[0, tok // block_size] * block_size + tok % block_size).astype(cp.int64)
        cuattn.reshape_and_cache(k[lo:hi], v[lo:hi], k_cache, v_cache, slots, kv_layout=layout)
        cu = cp.asarray([0, hi - lo], dtype=cp.int32)
        cuattn.paged_prefill(q[lo:hi], k_cache, v_cache, table,
                             cp.asarray([hi], dtype=cp.int32), cu, hi - lo, kv_layout=layout,
                             out=out[lo:hi])
    whole = cuattn.flash_forward(q[None], k[None], v[None], causal=True)[0]
    ref = _causal_reference_f32(q, k, v, group)
    err_flash = float(cp.abs(whole.astype(cp.float32) - ref).max())
    err_chunked = float(cp.abs(out.astype(cp.float32) - ref).max())
    assert err_chunked <= tolerance(err_flash, 1e-3), (err_chunked, err_flash)


def _causal_reference_f32(q, k, v, group):
    """Causal attention in float32 on the device, 1024 queries at a time."""
    import cupy as cp
    n, nheads, hs = q.shape
    out = cp.empty((n, nheads, hs), cp.float32)
    qf, kf, vf = (x.astype(cp.float32) for x in (q, k, v))
    for h in range(nheads):
        for lo in range(0, n, 1024):
            hi = min(n, lo + 1024)
            s = qf[lo:hi, h] @ kf[:hi, h // group].T / math.sqrt(hs)
            s = cp.where(cp.arange(hi)[None, :] <= cp.arange(lo, hi)[:, None], s, -cp.inf)
            p = cp.exp(s - s.max(axis=1, keepdims=True))
            out[lo:hi, h] = (p @ vf[:hi, h // group]) / p.sum(axis=1, keepdims=True)
    return out


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_replays_with_new_lengths(rng):
    import cupy as cp
    b = make_batch(rng, contexts=[300, 64], q_lens=[4, 4], nkv=2, group=4, head_size=128,
                   block_size=16, dtype="bf16", layout="nhd")
    d = {k: cp.asarray(v) for k, v in b.items() if isinstance(v, np.ndarray)}
    out = cp.zeros(b["q"].shape, b["q"].dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"],
            d["cu_seqlens_q"], 4)
    with stream:
        cuattn.paged_prefill(*args, kv_layout="nhd", out=out)   # compile and plan outside
        stream.begin_capture()
        cuattn.paged_prefill(*args, kv_layout="nhd", out=out)
        graph = stream.end_capture()
    b["seq_lens"] = np.array([200, 50], np.int32)
    b["ks"] = [b["ks"][0][:200], b["ks"][1][:50]]
    b["vs"] = [b["vs"][0][:200], b["vs"][1][:50]]
    d["seq_lens"][...] = cp.asarray(b["seq_lens"])
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    check(out, None, *batch_reference(b, 1 / math.sqrt(128), causal=True), "bf16")


def runs_on_hopper() -> bool:
    """Whether the last paged_prefill plan made runs the Hopper kernel (its TMA maps)."""
    from cuattn.paged import prefill
    return isinstance(list(prefill._plans.values())[-1].launches[0].extra, _tma.FlashMaps)


# Sequences for the Hopper kernel's paged producer: contexts that end inside a box, inside
# the first box, on a tile's end; a sequence with no new token, one with a single key;
# queries from one token to a few row tiles.
HOPPER_CTX = [700, 5, 128, 999, 1, 300]
HOPPER_Q = [700, 5, 0, 77, 1, 129]


def _chunks_on_both_flash_kernels(rng, layout, block_size, head_size, group, dtype, path):
    b = make_batch(rng, contexts=HOPPER_CTX, q_lens=HOPPER_Q, nkv=2, group=group,
                   head_size=head_size, block_size=block_size, dtype=dtype, layout=layout)
    scale = 1 / math.sqrt(head_size)
    with forced_flash_path(path):
        for causal, window, num_splits in ((True, (-1, -1), 0), (False, (-1, -1), 1),
                                           (True, (200, 0), 3)):
            out, lse = run_prefill(b, kv_layout=layout, causal=causal, window_size=window,
                                   num_splits=num_splits)
            assert runs_on_hopper() == (path == "wgmma")
            check(out, lse, *batch_reference(b, scale, causal=causal, window=window), dtype)


HOPPER_SHAPES = [(64, 4, "f16"), (80, 2, "bf16"), (128, 4, "bf16"), (192, 1, "bf16"),
                 (256, 2, "f16")]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 64, 256, 512])
@pytest.mark.parametrize("head_size,group,dtype", HOPPER_SHAPES)
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_nhd_chunks_on_both_flash_kernels(rng, block_size, head_size, group, dtype, path):
    """Chunked prefill over NHD caches on each flash kernel: on the Hopper kernel its TMA
    producer's box per cache block (8 to 512 tokens, BLOCK_N 48 to 128), V tiles crossing a
    sequence's end copied with zero fill (NaN in every slot past it), causal, full and a
    window, split and not."""
    _chunks_on_both_flash_kernels(rng, "nhd", block_size, head_size, group, dtype, path)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size,group,dtype", HOPPER_SHAPES)
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_vllm_chunks_on_both_flash_kernels(rng, block_size, head_size, group, dtype, path):
    """The same over vLLM's layout: on the Hopper kernel a 5-d box per cache block (K's
    16-byte chunks and V's rows of keys landing as no-swizzle core matrices; blocks of 8, 16
    and 32 tokens, boxes of 16 at BLOCK_N 80 / 48), the V edge copy zero-filling the keys of
    a chunk past the sequence's end, head sizes short of the compiled one (80, 192 of 256)."""
    _chunks_on_both_flash_kernels(rng, "vllm", block_size, head_size, group, dtype, path)


@pytest.mark.gpu
def test_vllm_cache_a_map_cannot_describe_runs_on_mma_sync(rng):
    """A vLLM K cache viewed so that its tokens are not 16 bytes apart (no 128-byte run of a
    chunk's 8 tokens for a box) takes the mma.sync kernel, and is read right."""
    import cupy as cp
    b = make_batch(rng, contexts=[300, 45], q_lens=[300, 9], nkv=2, group=2, head_size=64,
                   block_size=16, dtype="bf16", layout="vllm")
    d = on_device(b, {})
    wide = cp.full(d["k_cache"].shape[:4] + (16,), np.nan, d["k_cache"].dtype)
    wide[..., :8] = d["k_cache"]
    out = cp.full(b["q"].shape, np.nan, dtype=b["q"].dtype)
    _, lse = cuattn.paged_prefill(d["q"], wide[..., :8], d["v_cache"], d["block_tables"],
                                  d["seq_lens"], d["cu_seqlens_q"], b["max_seqlen_q"],
                                  return_lse=True, out=out)
    assert not runs_on_hopper()
    check(out, lse, *batch_reference(b, 1 / 8, causal=True), "bf16")


@pytest.mark.gpu
def test_nhd_reshape_and_cache_round_trip(rng):
    import cupy as cp
    nkv, hs, bs = 3, 128, 4
    key = cp.asarray(rng.standard_normal((9, nkv, hs)), dtype=cp.float16)
    value = cp.asarray(rng.standard_normal((9, nkv, hs)), dtype=cp.float16)
    kshape, vshape = cuattn.paged_kv_cache_shapes(6, nkv, hs, bs, np.float16, kv_layout="nhd")
    kc, vc = cp.full(kshape, np.nan, cp.float16), cp.full(vshape, np.nan, cp.float16)
    slots = cp.asarray([5, 0, 23, -1, 7, 8, 9, 12, 1], dtype=cp.int32)
    cuattn.reshape_and_cache(key, value, kc, vc, slots, kv_layout="nhd")
    kh, vh, sh = kc.get(), vc.get(), slots.get()
    for i, s in enumerate(sh):
        if s < 0:
            continue
        assert np.array_equal(kh[s // bs, s % bs], key[i].get())
        assert np.array_equal(vh[s // bs, s % bs], value[i].get())
    assert np.isnan(kh[1, 2]).all()   # slot 6 was never written


# -- GPU: the hooks on flash_forward / flash_varlen_forward ----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("which", ["softcap", "alibi", "sinks", "softcap+alibi+sinks"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (50, 30))])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_flash_hooks(rng, which, causal, window, head_dim, path):
    import cupy as cp
    batch, sq, sk, nheads, nkv = 2, 77, 300, 4, 2
    q = rng.standard_normal((batch, sq, nheads, head_dim)).astype(BF16)
    k = rng.standard_normal((batch, sk, nkv, head_dim)).astype(BF16)
    v = rng.standard_normal((batch, sk, nkv, head_dim)).astype(BF16)
    kw = hook_values(rng, nheads, which)
    dkw = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    scale = 1 / math.sqrt(head_dim)
    for num_splits in (1, 4):
        with forced_flash_path(path):
            out, lse = cuattn.flash_forward(cp.asarray(q), cp.asarray(k), cp.asarray(v),
                                            causal=causal, window_size=window,
                                            return_lse=True, num_splits=num_splits, **dkw)
        for bi in range(batch):
            ref, ref_lse = attention_reference(q[bi], k[bi], v[bi], scale, causal=causal,
                                               window=window, **_ref_kw(kw))
            check(out[bi], lse[bi], ref, ref_lse, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_flash_varlen_hooks_with_empty_sequences(rng, path):
    import cupy as cp
    lens_q, lens_k, nheads, hd = [5, 0, 40, 1], [9, 0, 100, 0], 8, 128
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], nheads, hd)).astype(np.float16)
    k = rng.standard_normal((cu_k[-1], 2, hd)).astype(np.float16)
    v = rng.standard_normal((cu_k[-1], 2, hd)).astype(np.float16)
    kw = hook_values(rng, nheads, "softcap+alibi+sinks")
    dkw = {n: (cp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    with forced_flash_path(path):
        out, lse = cuattn.flash_varlen_forward(
            cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(cu_q), cp.asarray(cu_k),
            max(lens_q), max(lens_k), causal=True, return_lse=True, **dkw)
    refs = [attention_reference(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]],
                                v[cu_k[i]:cu_k[i + 1]], 1 / math.sqrt(hd), causal=True,
                                **_ref_kw(kw)) for i in range(len(lens_q))]
    check(out, lse, np.concatenate([r[0] for r in refs]),
          np.concatenate([r[1] for r in refs], axis=1), "f16")


# -- GPU: fp8 e4m3 caches (the flash form, widened in shared memory) ---------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size", [("vllm", 8), ("vllm", 16), ("vllm", 32),
                                               ("nhd", 1), ("nhd", 16), ("nhd", 256),
                                               ("nhd", 512)])
def test_fp8_caches_both_layouts(rng, layout, block_size):
    """Speculative, empty and chunk-sized queries over an fp8 cache against the reference
    over the dequantised values (k_scale, v_scale != 1)."""
    scales = (0.05, 0.02)
    b = make_batch(rng, contexts=MIXED_CTX, q_lens=MIXED_Q, nkv=2, group=4, head_size=128,
                   block_size=block_size, dtype="bf16", layout=layout, fp8_scales=scales)
    assert tuning.paged_prefill_form("e4m3", 128, b["max_seqlen_q"], 1) == "flash"
    ref = batch_reference(b, 1 / math.sqrt(128), causal=True)
    out, lse = run_prefill(b, kv_layout=layout, k_scale=scales[0], v_scale=scales[1])
    check(out, lse, *ref, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,group,dtype", [(64, 1, "f16"), (80, 8, "bf16"),
                                                   (192, 4, "bf16"), (256, 2, "f16")])
@pytest.mark.parametrize("which,causal,window,num_splits",
                         [("", True, (-1, -1), 3), ("softcap+alibi+sinks", False, (64, 16), 0),
                          ("sinks", True, (100, 0), 1)])
def test_fp8_caches_head_sizes_hooks_splits(rng, head_size, group, dtype, which, causal,
                                            window, num_splits):
    scales = (0.07, 0.03)
    nheads = 2 * group
    b = make_batch(rng, contexts=[900, 20, 400], q_lens=[3, 20, 130], nkv=2, group=group,
                   head_size=head_size, block_size=16, dtype=dtype, layout="vllm",
                   fp8_scales=scales)
    kw = hook_values(rng, nheads, which)
    scale = 1 / math.sqrt(head_size)
    out, lse = run_prefill(b, causal=causal, window_size=window, num_splits=num_splits,
                           k_scale=scales[0], v_scale=scales[1], **kw)
    check(out, lse, *batch_reference(b, scale, causal=causal, window=window, **_ref_kw(kw)),
          dtype)


# -- GPU: paged_prefill's few-token form (multi-token decode) -----------------------------------

FEW_Q = [1, 16, 0, 3, 8, 2, 5]        # up to 16 new tokens (tuning.PREFILL_DECODE_MAX_TOKENS)
FEW_CTX = [1, 3000, 9, 16, 1030, 2, 777]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size", [("vllm", 8), ("vllm", 16), ("vllm", 32),
                                               ("nhd", 1), ("nhd", 16), ("nhd", 256),
                                               ("nhd", 512)])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_few_token_form_layouts_and_splits(rng, layout, block_size, num_splits):
    """num_splits 1: v1; 5: v2 partitions (here 1024 tokens; the longest sequence has 3);
    0: the decode rule. Rows past cu_seqlens_q[-1] are left alone."""
    b = make_batch(rng, contexts=FEW_CTX, q_lens=FEW_Q, nkv=2, group=4, head_size=128,
                   block_size=block_size, dtype="bf16", layout=layout)
    assert tuning.paged_prefill_form("bf16", 128, b["max_seqlen_q"], 1) == "decode"
    out, lse, real = run_prefill_padded(b, 3, kv_layout=layout, num_splits=num_splits)
    ref = batch_reference(b, 1 / math.sqrt(128), causal=True)
    check(out[:real], lse[:, :real], *ref, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_few_token_form_one_token_with_empty_sequences(rng, num_splits):
    """max_seqlen_q 1 and sequences without a new token (requests that wait this step): each
    sequence's token is its row of cu_seqlens_q (the 1-token form, plain decode's kernel,
    once put sequence s's attention in row s and wrote past the last row; found by the
    fuzz, seed 3995233130). Rows past cu_seqlens_q[-1] are left alone."""
    b = make_batch(rng, contexts=[255, 91, 40, 7, 300], q_lens=[0, 1, 0, 1, 1], nkv=1,
                   group=16, head_size=112, block_size=32, dtype="bf16", layout="vllm")
    assert tuning.paged_prefill_form("bf16", 112, b["max_seqlen_q"], 3) == "decode"
    out, lse, real = run_prefill_padded(b, 2, num_splits=num_splits)
    ref = batch_reference(b, 1 / math.sqrt(112), causal=True)
    check(out[:real], lse[:, :real], *ref, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["", "softcap", "alibi", "sinks", "softcap+alibi+sinks"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)),
                                           (True, (5, 0)), (False, (6, 3))])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_few_token_form_hooks_and_windows(rng, which, causal, window, num_splits):
    b = make_batch(rng, contexts=[900, 20, 2400, 7], q_lens=[2, 7, 16, 7], nkv=2, group=4,
                   head_size=128, block_size=16, dtype="bf16", layout="vllm")
    kw = hook_values(rng, 8, which)
    scale = 0.3
    out, lse = run_prefill(b, causal=causal, window_size=window, softmax_scale=scale,
                           num_splits=num_splits, **kw)
    check(out, lse, *batch_reference(b, scale, causal=causal, window=window, **_ref_kw(kw)),
          "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,nkv,group,dtype", [(64, 1, 8, "f16"), (96, 2, 6, "bf16"),
                                                       (128, 1, 16, "bf16"), (192, 3, 1, "f16"),
                                                       (256, 2, 8, "bf16")])
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_few_token_form_head_sizes_and_groups(rng, head_size, nkv, group, dtype, layout):
    b = make_batch(rng, contexts=[500, 33, 129, 4], q_lens=[3, 1, 8, 4], nkv=nkv, group=group,
                   head_size=head_size, block_size=16, dtype=dtype, layout=layout)
    out, lse = run_prefill(b, kv_layout=layout)
    check(out, lse, *batch_reference(b, 1 / math.sqrt(head_size), causal=True), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("slope", [-0.4, 0.02, 0.06, 0.15, 0.5])
@pytest.mark.parametrize("scale", [0.05, 1.5])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_few_token_form_lazy_rescale(rng, slope, scale, num_splits):
    """The forms of 4 n-tiles and more (8 new tokens x group 4, 16 x group 2) move a
    column's max only when a logit passes it by more than 8 (log2 units). ALiBi slopes make
    the logits grow along the keys by -9 to +12 log2 units a 16-key tile (the old max kept
    over several tiles, or moved at each); a scale of 1.5 spreads them by tens; num_splits 4:
    v2 partitions, each with its own kept max."""
    for q_lens, group in (([8, 8, 3], 4), ([16, 11, 16], 2)):
        b = make_batch(rng, contexts=[2500, 700, 64], q_lens=q_lens, nkv=2, group=group,
                       head_size=128, block_size=16, dtype="bf16", layout="vllm")
        assert tuning.paged_prefill_form("bf16", 128, b["max_seqlen_q"], sum(q_lens)) == "decode"
        tokens, heads = tuning.paged_multi_token(128, group, b["max_seqlen_q"])
        assert tokens * heads >= 32      # 4 n-tiles of 8 columns: the lazy rescale's forms
        slopes = np.full(2 * group, slope, np.float32)
        out, lse = run_prefill(b, softmax_scale=scale, alibi_slopes=slopes,
                               num_splits=num_splits)
        check(out, lse, *batch_reference(b, scale, causal=True, alibi=slopes), "bf16")


@pytest.mark.gpu
def test_few_token_form_agrees_with_the_flash_form(rng):
    """The same call on both kernels (tuning.override(prefill_form=...)), each against the
    reference, and near each other."""
    b = make_batch(rng, contexts=FEW_CTX, q_lens=FEW_Q, nkv=2, group=4, head_size=128,
                   block_size=16, dtype="bf16", layout="nhd")
    ref = batch_reference(b, 1 / math.sqrt(128), causal=True)
    results = []
    for form in ("decode", "flash"):
        with tuning.override(prefill_form=form):
            out, lse = run_prefill(b, kv_layout="nhd")
        check(out, lse, *ref, "bf16")
        results.append(out.get().astype(np.float32))
    assert np.abs(results[0] - results[1]).max() < 0.02


# -- GPU: paged_attention (decode) with the hooks, windows and the NHD layout -------------------

def run_decode(b, **kw):
    import cupy as cp
    d = on_device(b, kw)
    out = cp.full(b["q"].shape, np.nan, dtype=b["q"].dtype)
    res, lse = cuattn.paged_attention(d["q"], d["k_cache"], d["v_cache"], d["block_tables"],
                                      d["seq_lens"], return_lse=True, out=out, **kw)
    assert res is out
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size,form", [("vllm", 16, "mma"), ("vllm", 8, "simt"),
                                                    ("nhd", 1, "mma"), ("nhd", 32, "mma"),
                                                    ("nhd", 256, "mma"), ("nhd", 512, "mma")])
@pytest.mark.parametrize("which", ["", "softcap", "sinks", "softcap+alibi+sinks"])
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("window", [(-1, -1), (300, 0)])
def test_decode_hooks_windows_and_layouts(rng, layout, block_size, form, which, version, window):
    contexts = [1, 700, 0, 2049, 17]
    b = make_batch(rng, contexts=contexts, q_lens=[1] * len(contexts), nkv=2, group=4,
                   head_size=128, block_size=block_size, dtype="bf16", layout=layout)
    kw = hook_values(rng, 8, which)
    with tuning.override(paged_form=form):
        out, lse = run_decode(b, kv_layout=layout, window_size=window, version=version,
                              partition_size=256 if version == "v2" else None, **kw)
    # the decode query of sequence s sits at position seq_lens[s] - 1; an empty one sees nothing
    refs = [attention_reference(b["q"][s:s + 1], b["ks"][s], b["vs"][s], 1 / math.sqrt(128),
                                causal=True, window=window, **_ref_kw(kw))
            for s in range(len(contexts))]
    check(out, lse, np.concatenate([r[0] for r in refs]),
          np.concatenate([r[1] for r in refs], axis=1), "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("cache,head_size,block_size", [("e4m3", 128, 16), ("e4m3", 64, 1),
                                                        ("bf16", 120, 256), ("e4m3", 80, 8),
                                                        ("e4m3", 256, 512)])
@pytest.mark.parametrize("which", ["", "softcap+alibi+sinks"])
@pytest.mark.parametrize("version", ["v1", "v2", "auto"])
@pytest.mark.parametrize("window", [(-1, -1), (300, 0)])
def test_decode_nhd_on_the_flash_form(rng, cache, head_size, block_size, which, version,
                                      window):
    """paged_attention over NHD caches the tensor-core form cannot take (fp8, head size 120)
    runs on the flash form, one query per sequence: an empty sequence, one of one key, long
    ones; v1 (one pass) and v2 / auto (split-KV), the hooks and a window."""
    contexts = [1, 700, 0, 2049, 17]
    scales = (0.05, 0.02) if cache == "e4m3" else None
    b = make_batch(rng, contexts=contexts, q_lens=[1] * len(contexts), nkv=2, group=4,
                   head_size=head_size, block_size=block_size, dtype="bf16", layout="nhd",
                   fp8_scales=scales)
    kw = hook_values(rng, 8, which)
    if scales:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    out, lse = run_decode(b, kv_layout="nhd", window_size=window, version=version, **kw)
    from cuattn.paged import attention
    from cuattn.param_structs import FLASH_PARAMS
    assert list(attention._plans.values())[-1].launches[0].dtype == FLASH_PARAMS.dtype
    scale = 1 / math.sqrt(head_size)
    refs = [attention_reference(b["q"][s:s + 1], b["ks"][s], b["vs"][s], scale, causal=True,
                                window=window, **_ref_kw(kw)) for s in range(len(contexts))]
    ref_lse = np.concatenate([r[1] for r in refs], axis=1)
    check(out, lse, np.concatenate([r[0] for r in refs]), ref_lse, "bf16")
    # the empty sequence: zeros, lse -inf (with sinks the sink's logit alone, as the reference)
    assert not np.isnan(out.get()[2].astype(np.float32)).any()
    assert "sinks" in kw or np.isneginf(lse.get()[:, 2]).all()


# -- GPU: head sizes only paged_prefill takes, more new tokens than keys -----------------------

# Head sizes below, between and above decode's (compiled 32 / 64 / 96 / 160 / 224 for mma.sync,
# 64 / 64 / 128 / 192 / 256 on Hopper: columns past the head size come in as zeros).
NEW_HEAD_SIZES = [(32, 4, "bf16"), (40, 2, "f16"), (72, 1, "bf16"), (160, 4, "bf16"),
                  (224, 2, "f16")]


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,group,dtype", NEW_HEAD_SIZES)
@pytest.mark.parametrize("layout,block_size", [("vllm", 16), ("nhd", 16), ("nhd", 512)])
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_new_head_sizes_on_both_flash_kernels(rng, head_size, group, dtype, layout, block_size,
                                              path):
    """Head sizes flash_forward takes and decode does not, on each flash kernel (forced: the
    Hopper one also at 32, a 64-column box over a 32-column row), both layouts, causal,
    full and a window, split and not; NaN in every slot past a sequence and in the cache
    blocks no table names, so a box or chunk past the head size that read the next head's
    or block's data would show."""
    assert tuning.paged_prefill_form(dtype, head_size, 16, 1) == "flash"
    _chunks_on_both_flash_kernels(rng, layout, block_size, head_size, group, dtype, path)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,group,dtype", NEW_HEAD_SIZES)
@pytest.mark.parametrize("layout", ["vllm", "nhd"])
def test_new_head_sizes_with_few_tokens_hooks_and_splits(rng, head_size, group, dtype, layout):
    """A few new tokens per sequence (the flash form: multi-token decode takes decode's head
    sizes only), every hook, split and not."""
    b = make_batch(rng, contexts=FEW_CTX, q_lens=FEW_Q, nkv=2, group=group,
                   head_size=head_size, block_size=16, dtype=dtype, layout=layout)
    kw = hook_values(rng, 2 * group, "softcap+alibi+sinks")
    scale = 1 / math.sqrt(head_size)
    for num_splits in (1, 4):
        out, lse, real = run_prefill_padded(b, 2, kv_layout=layout, num_splits=num_splits,
                                            **dict(kw))
        check(out[:real], lse[:, :real],
              *batch_reference(b, scale, causal=True, **_ref_kw(kw)), dtype)
        b["q"] = b["q"][:real]


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [16, 32, 48, 160, 224])
@pytest.mark.parametrize("layout,block_size", [("vllm", 16), ("nhd", 16), ("nhd", 512)])
def test_new_head_sizes_fp8(rng, head_size, layout, block_size):
    """fp8 caches at head sizes that are multiples of 16 only paged_prefill takes."""
    scales = (0.05, 0.02)
    b = make_batch(rng, contexts=MIXED_CTX, q_lens=MIXED_Q, nkv=2, group=2,
                   head_size=head_size, block_size=block_size, dtype="bf16", layout=layout,
                   fp8_scales=scales)
    out, lse = run_prefill(b, kv_layout=layout, k_scale=scales[0], v_scale=scales[1])
    check(out, lse, *batch_reference(b, 1 / math.sqrt(head_size), causal=True), "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [40, 128])
def test_reshape_and_cache_new_head_sizes_then_prefill(rng, head_size):
    """reshape_and_cache writes NHD blocks of 512 and head sizes only paged_prefill takes;
    paged_prefill reads them back."""
    import cupy as cp
    n, nkv, group, bs = 700, 2, 2, 512
    nheads = nkv * group
    k = rng.standard_normal((n, nkv, head_size)).astype(np.float16)
    v = rng.standard_normal((n, nkv, head_size)).astype(np.float16)
    q = rng.standard_normal((n, nheads, head_size)).astype(np.float16)
    num_blocks = 4
    for layout, block_size in (("nhd", bs), ("vllm", 16)):
        kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks * bs // block_size, nkv,
                                                      head_size, block_size, np.float16,
                                                      kv_layout=layout)
        kc, vc = cp.full(kshape, np.nan, cp.float16), cp.full(vshape, np.nan, cp.float16)
        table = cp.asarray(rng.permutation(kshape[0])[None, :], dtype=cp.int32)
        tok = cp.arange(n)
        slots = (table[0, tok // block_size] * block_size + tok % block_size).astype(cp.int32)
        cuattn.reshape_and_cache(cp.asarray(k), cp.asarray(v), kc, vc, slots, kv_layout=layout)
        out, lse = cuattn.paged_prefill(
            cp.asarray(q), kc, vc, table, cp.asarray([n], dtype=cp.int32),
            cp.asarray([0, n], dtype=cp.int32), n, kv_layout=layout, return_lse=True)
        ref = attention_reference(q, k, v, 1 / math.sqrt(head_size), causal=True)
        check(out, lse, *ref, "f16")


# Sequences with more new tokens than keys: none (seq_len 0), one, a few; a sequence with
# no new token; one with as many as keys.
SHORT_CTX = [3, 0, 10, 1, 40, 0, 7]
SHORT_Q = [8, 4, 16, 2, 5, 0, 7]


def _more_tokens_than_keys(rng, layout, block_size, form, path, contexts, q_lens, which,
                           causal, window, num_splits):
    b = make_batch(rng, contexts=contexts, q_lens=q_lens, nkv=2, group=4, head_size=128,
                   block_size=block_size, dtype="bf16", layout=layout)
    kw = hook_values(rng, 8, which)
    scale = 1 / math.sqrt(128)
    with forced_flash_path(path), tuning.override(prefill_form=form):
        assert tuning.paged_prefill_form("bf16", 128, b["max_seqlen_q"], 1) == form
        out, lse = run_prefill(b, kv_layout=layout, causal=causal, window_size=window,
                               num_splits=num_splits, **dict(kw))
    ref, ref_lse = batch_reference(b, scale, causal=causal, window=window, **_ref_kw(kw))
    check(out, lse, ref, ref_lse, "bf16")
    if causal and "sinks" not in kw:   # the earliest queries of a short sequence: no key
        assert np.isneginf(lse.get()[:, 0]).all() and np.isneginf(ref_lse[:, 0]).all()
        assert not np.abs(out.get()[0].astype(np.float32)).any()


MORE_TOKENS_CASES = [("", True, (-1, -1), 1), ("sinks", True, (-1, -1), 4),
                     ("softcap+alibi+sinks", True, (3, 0), 0), ("alibi", False, (-1, -1), 1),
                     ("", False, (2, 1), 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("which,causal,window,num_splits", MORE_TOKENS_CASES)
@pytest.mark.parametrize("layout,block_size", [("vllm", 16), ("nhd", 512)])
def test_more_new_tokens_than_keys_few_token_form(rng, which, causal, window, num_splits,
                                                  layout, block_size):
    """Multi-token decode (v1, and v2 partitions) on sequences whose new tokens outnumber
    their keys: queries at negative positions see no key under causal (zeros, lse -inf or
    the sink), every key without it; seq_len 0 sees nothing."""
    _more_tokens_than_keys(rng, layout, block_size, "decode", "mma", SHORT_CTX, SHORT_Q,
                           which, causal, window, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("which,causal,window,num_splits", MORE_TOKENS_CASES)
@pytest.mark.parametrize("layout,block_size", [("vllm", 16), ("nhd", 16), ("nhd", 512)])
@pytest.mark.parametrize("path", FLASH_PATHS)
def test_more_new_tokens_than_keys_flash_form(rng, which, causal, window, num_splits, layout,
                                              block_size, path):
    """The same on each flash kernel, with chunk-sized sequences too (a whole row tile of
    queries that see no key, one of 0 keys)."""
    _more_tokens_than_keys(rng, layout, block_size, "flash", path, SHORT_CTX + [100, 0],
                           SHORT_Q + [300, 130], which, causal, window, num_splits)
