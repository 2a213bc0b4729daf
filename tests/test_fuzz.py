"""Randomized differential testing (issues 5, 33): every attention, gradient, merge and
cache-writing public function against its float64 NumPy reference over N random cases
(N = CUATTN_FUZZ_CASES, default 300; block_tables_from_flashinfer's random tables:
tests/test_flashinfer_tables.py).

Each test takes a base seed (CUATTN_TEST_SEED, else fresh entropy; printed first) and gives
every case its own generator from (base seed, function, case index). A failing test lists
each failing case with its parameters and the command that replays just that case, e.g.

    CUATTN_TEST_SEED=1234 CUATTN_FUZZ_ONLY=17 python -m pytest -q -s \\
        'tests/test_fuzz.py::test_fuzz[flash_forward]'

(CUATTN_FUZZ_ONLY takes a comma-separated list of case indices.) The cases mix in adversarial
values: integer-valued q, k whose scores reach ~1e4 (computed exactly in float32, so any
error is the kernel's, not the rounding's), every key of a row masked, lse = +/-inf in
merges, fp16 values near 65504; every input may be a strided view of a NaN-poisoned storage
and every given out= is one, so reads and writes outside the views show up. A fraction of the
attention cases carry the hooks (softcap, ALiBi slopes, sinks; for paged_attention also
windows and the NHD layout); paged_prefill's cases mix both cache layouts, 16-bit and fp8
caches, speculative and chunk-sized queries, shared prefixes and every hook, each paged cache
holding NaN wherever a sequence must not read (past its length, unreferenced blocks, table
entries past its end). flash_backward and flash_varlen_backward run the forward for out and
lse, then check dq, dk, dv (and the sinks' gradient) of every sequence against the float64
reference by test_flash_bwd's rule: GQA, windows, hooks, deterministic calls (which must
repeat bit for bit), empty and one-token sequences, head dims 8 to 256, given dq= / dk= / dv=.
flash_with_kvcache's cases (dense caches) draw decode, speculative and prefill queries (and
more queries than keys) against caches of 1 to 4096 slots, rows empty, full or overflowed by
the new keys (dropped), cache_seqlens on the device or as an int, cache_batch_idx a random
injective map or None, every mask and hook, q / out / caches / new keys as strided views;
every slot a row must not read holds NaN, and both caches must equal the host's append bit
for bit after the call.

CPU part: the generators, references and checks run against an oracle (the rounded
reference must pass, a perturbed one must fail), and the default N cases of fixed seeds stay
within the kernel-variant and host-work budgets below, so the GPU run of the forward-side
tests stays well under 120 s and each backward test within about 60 s.
"""
from __future__ import annotations

import math
import os
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import paged, tuning, tuning_bwd
from cuattn.paged.forms import form_for
from cuattn.flash import _mask_and_bounds
from cuattn.constants import FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, KV_PAGED_NHD, KV_PAGED_VLLM
from cuattn.keys import FlashFwdSm90Variant
from test_flash import _floor, _round, _visible, attention_ref
from test_flash_bwd import check_grads
from test_paged import E4M3, _cache_values, make_case, paged_reference
from test_prefill import write_tokens
from tests.reference import attention_backward_reference, attention_reference, \
    merge_reference, tolerance

N_CASES = int(os.environ.get("CUATTN_FUZZ_CASES", 300))
DEFAULT_CASES = 300
MAX_FAILURES = 20          # a sticky CUDA error fails every later case: stop early
DT = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
LN2 = math.log(2.0)
EDGES = (1, 2, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 255, 256, 257)
FUNCS = ("flash_forward", "flash_varlen_forward", "merge_attn_states", "merge_states",
         "paged_attention", "reshape_and_cache", "paged_prefill", "flash_backward",
         "flash_varlen_backward", "flash_with_kvcache")

# Budgets at the default N (checked on the CPU for fixed seeds). Kernel variants per function
# (flash_forward and flash_varlen_forward share theirs; bounded by construction: small sets of
# kernel-defining values), compiled in parallel before the cases run (~1-1.5 s each with
# NVRTC). The bounds: flash 39 plain (2 dtypes x hd 64 / 128 x 3 masks x 2 splits + combines,
# the run's odd head dim, and hd64 causal on both of its tile sets: tuning's short causal rule)
# + 13 hooked (2 hook sets x 3 masks x 2 splits + a combine with sinks); paged_attention 6 + 3
# + 4 x 3 (v1, v2, reduce of six configurations, one of them every partition); paged_prefill 3
# families x (2 masks x 2 splits x 4 tile classes + a combine) on the flash form, and the
# few-token form's kernels of its short cases (block size, query heads per block and tokens
# vary by case; v1 and every v2 partition where the library picks: a superset): 108-154 in all
# for seeds 0-7. Host seconds of one core for the data, the float64 references and the checks
# (the bulk of a GPU run), from per-function cost models calibrated on the CPU machine
# (measured before the hooks and paged_prefill: flash 5-6.5 s per test, paged 5-7 s, merges ~1
# s, reshape_and_cache ~2 s; ~20 s in all). With them the models give, for seeds 0-7: flash 4-9
# s a test, paged_attention 7-13 s (its fp8 cases, now modelled at their cost), paged_prefill
# 5.5-6.5 s; 28-36 s in all. The backward (flash_backward and flash_varlen_backward share
# their variants): at most 67, the forward's unsplit kernels that give out and lse (2 dtypes x
# hd 64 / 128 x 3 masks, hd64 causal on both tile sets: 14; the palette's odd head dim and its
# two-pass one: 3 + 3; 2 hook sets x 3 masks, hd64 causal twice: 8) and the backward's (main
# kernel 2 x 2 x 3 + 3 + 3 + 2 sets of softcap / ALiBi x 3 masks = 24; pre-pass and dQ
# convert of 7 (dtype, head dim) pairs = 14; the sinks' gradient, 1): 53-63 for seeds 0-7.
# Its host model (work_bwd) is fitted to build_bwd + check_bwd of 1200 cases timed on the CPU
# machine (the two float64 references per sequence and head: ~28 + 0.55 hd ns per score, ~90
# more with the softcap bound): flash_backward 7-10.5 s, flash_varlen_backward 9.5-14 s;
# 48-59 s in all with the others. The GPU run of each backward test: these seconds, compiles
# (~60 variants, in parallel) and a few ms of device calls per case: well within 60 s.
# flash_with_kvcache (issue 34): the append kernel (one per dtype) and paged_prefill's flash
# form over the dense cache, 3 families x (2 masks x 2 splits x the tile classes of
# seqlen_q x group, and the Hopper kernel's at seqlen_q >= 64 over >= 256 slots, + a
# combine), the third family's two hook sets each: 60-76 for seeds 0-7; its host model
# (work_kvcache, fitted to 900 cases timed on the CPU machine with one BLAS thread) 4.2-4.8
# s; 52-63 s in all.
KERNEL_BUDGET = {"flash": 52, "paged_attention": 21, "merge_attn_states": 6,
                 "merge_states": 6, "reshape_and_cache": 8, "paged_prefill": 170,
                 "flash_bwd": 67, "flash_with_kvcache": 85}
HOST_S_BUDGET = {"flash_forward": 11, "flash_varlen_forward": 11, "merge_attn_states": 2,
                 "merge_states": 2, "paged_attention": 15, "reshape_and_cache": 3,
                 "paged_prefill": 9, "flash_backward": 14, "flash_varlen_backward": 17,
                 "flash_with_kvcache": 7}
HOST_S_TOTAL = 75
# One flash case at most: 1.5e6 scores (batch x heads x sq x sk) and 4e6 elements of q + k + v;
# one backward case 8e5 and 3e6 (its references cost about twice the forward's per score);
# one paged_prefill case: 8e7 scores x head size and 3e6 elements of q and the caches' slots;
# one flash_with_kvcache case the same, its rows counted at the cache's length.
CAPS = (1.5e6, 4e6)
BWD_CAPS = (8e5, 3e6)
PREFILL_CAPS = (8e7, 3e6)
KVCACHE_CAPS = (8e7, 3e6)


# ---- seeds, picks, device views ------------------------------------------------------------

def _base_seed() -> int:
    return int(os.environ.get("CUATTN_TEST_SEED", np.random.SeedSequence().entropy % 2**32))


def _rng(base, fn, index, stream):
    """stream 0: a case's parameters, 1: its data, 2 (index 0): the run's palette."""
    return np.random.default_rng([base, FUNCS.index(fn), index, stream])


def _pick(rng, options, p=None):
    return options[int(rng.choice(len(options), p=p))]


def _length(rng, hi, edges=EDGES):
    """0 sometimes, a tile edge often, else uniform in [1, hi]."""
    u = rng.random()
    near = [e for e in edges if e <= hi]
    if u < 0.08:
        return 0
    if u < 0.4 and near:
        return int(_pick(rng, near))
    return int(rng.integers(1, hi + 1))


def _layout(rng, ndim, itemsize, strided, free_last=False):
    """None (contiguous) or (axis order of a larger storage, padding, offsets): the last dim
    stays contiguous and 16-byte aligned unless free_last."""
    if not strided:
        return None
    outer = ndim if free_last else ndim - 1
    step = 1 if free_last else 16 // itemsize
    perm = [int(a) for a in rng.permutation(outer)] + list(range(outer, ndim))
    pads = [step * int(rng.integers(0, 3)) if a >= outer else int(rng.integers(0, 3))
            for a in range(ndim)]
    offs = [step * int(rng.integers(0, p // step + 1)) if a >= outer else
            int(rng.integers(0, p + 1)) for a, p in enumerate(pads)]
    return perm, pads, offs


def _poison(dtype):
    return 0x7F if np.dtype(dtype).itemsize == 1 else np.nan     # 0x7F: e4m3 NaN


def _storage(x, layout):
    """(host storage, mask of its elements outside the view, index of the view)."""
    if layout is None:
        return x, np.zeros(x.shape, bool), None
    perm, pads, offs = layout
    store = np.full([x.shape[a] + pads[a] for a in perm], _poison(x.dtype), x.dtype)
    inv = tuple(int(a) for a in np.argsort(perm))
    idx = tuple(slice(o, o + n) for o, n in zip(offs, x.shape))
    store.transpose(inv)[idx] = x
    outside = np.ones(store.shape, bool)
    outside.transpose(inv)[idx] = False
    return store, outside, (inv, idx)


def _place(x, rng, strided, free_last=False):
    """Host x on the device, as a view of a larger poisoned storage when strided.
    Returns (device view, device storage, host mask of the storage outside the view)."""
    import cupy as cp
    x = x.view(np.uint8) if x.dtype == E4M3 else x
    store, outside, view = _storage(x, _layout(rng, x.ndim, x.itemsize, strided, free_last))
    d = cp.asarray(store)
    return (d if view is None else d.transpose(view[0])[view[1]]), d, outside


def _poisoned_out(shape, dtype, rng, how, free_last=False):
    """out= argument: None, or a NaN-filled array (a strided view when how == 'strided')."""
    if how == "none":
        return None, None, None
    return _place(np.full(shape, np.nan, dtype), rng, how == "strided", free_last)


def _assert_untouched(store, outside, what="out="):
    if store is not None and outside.any():
        rest = store.get()[outside].astype(np.float32)
        assert np.isnan(rest).all(), f"a write landed outside the {what} view"


def _prebuild(spec, cases):
    """Compile the variants the cases will need into the disk cache, in parallel (NVRTC
    releases the GIL). Only a speed-up: a failure here is left for the case to report."""
    from cuattn import jit
    arch = jit.arch_of_device(0)
    variants = set()
    for _, p in cases:
        try:
            variants.update(spec.kernels(p, arch))
        except Exception:                # noqa: BLE001
            pass

    def build(v):
        try:
            jit.build(v, arch)
        except Exception:                # noqa: BLE001
            pass
    with ThreadPoolExecutor(min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(build, sorted(variants, key=lambda v: v.name)))


# ---- shared checks (the rules of check_close, test_paged._check, test_merge._check) --------

def _check_out(got, ref, ref_lp, floor):
    """FlashAttention's rule: max|got - ref| <= 2 max|ref_lowp - ref| + floor; all finite."""
    got = got.astype(np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), "NaN/inf in out (unwritten, or a poisoned value was read)"
    err = np.abs(got - ref).max(initial=0)
    tol = tolerance(np.abs(ref_lp - ref).max(initial=0), floor)
    assert err <= tol, f"out error {err:.4g} > tolerance {tol:.4g}"


def _check_lse(got, ref, close):
    if got is None:
        return
    got = got.astype(np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert not np.isnan(got).any(), "NaN in lse"
    empty = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), empty), "lse = -inf must mark exactly the empty rows"
    if (~empty).any():
        assert close(got[~empty], ref[~empty]), \
            f"lse error {np.abs(got[~empty] - ref[~empty]).max():.4g}"


def _flash_lse_close(g, r, slack=0.0):
    return np.abs(g - r).max() <= 2e-3 * max(1.0, np.abs(r).max()) + slack


def _rounded(x, dtype):
    return x.astype(DT[dtype]).astype(np.float64)


def _perturbed(got, key="out"):
    """A wrong answer (for the CPU self-test): the largest element of got[key] negated (or,
    if small, moved by 1)."""
    out = got[key].copy()
    if out.size:
        j = int(np.abs(out.astype(np.float64)).argmax())
        x = float(out.flat[j])
        out.flat[j] = -x if abs(x) > 1 else x + 1
    return dict(got, **{key: out})


def _wrong_answers(got, nonzero=False):
    """One wrong answer per array a case's check compares (out; dq, dk, dv, dsinks) that has
    an element (nonzero: one that is not 0)."""
    return [_perturbed(got, k) for k in ("out", "dq", "dk", "dv", "dsinks")
            if got.get(k) is not None and got[k].size and
            (not nonzero or np.abs(got[k].astype(np.float32)).max() > 0)]


# ---- hooks (softcap, ALiBi, sinks) -----------------------------------------------------------
# In a case's parameters: softcap (a float, 0.0: off), alibi and sinks (bools); their values
# (float32 (nheads,) slopes and sinks) are data. Hooks are compile-time features (FEAT_* bits)
# of the kernels, so the cases take them from a few sets fixed per run (the palettes).

def _features(p) -> int:
    """The FEAT_* bits a case's call carries."""
    return (FEAT_SOFTCAP if p.get("softcap", 0.0) > 0 else 0) | \
        (FEAT_ALIBI if p.get("alibi") else 0) | (FEAT_SINKS if p.get("sinks") else 0)


def _hooked(p) -> bool:
    return bool(_features(p))


def _set_hooks(rng, p, bits):
    """softcap / alibi / sinks of a case from FEAT_* bits (the softcap value drawn here)."""
    p["softcap"] = (round(float(np.exp(rng.uniform(math.log(0.3), math.log(50.0)))), 3)
                    if bits & FEAT_SOFTCAP else 0.0)
    p["alibi"], p["sinks"] = bool(bits & FEAT_ALIBI), bool(bits & FEAT_SINKS)


def _hook_values(p, values):
    """Adversarial values the hooks leave meaningful: with ALiBi a non-integer bias joins the
    scores (those of "big" / "offset" are no longer exact in float32); with softcap the
    tanh slack grows with max|v| (see _softcap_slack), so no "vmax"."""
    if p.get("alibi") and values in ("big", "offset"):
        return "normal"
    if p.get("softcap", 0.0) > 0 and values == "vmax":
        return "normal"
    return values


def _alibi_std(h):
    """ALiBi's geometric slopes (those of test_paged.make_case)."""
    return (2.0 ** -(8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def _slopes(rng, h):
    return _alibi_std(h) if rng.random() < 0.5 else rng.uniform(0.0, 0.5, h).astype(np.float32)


def _sinks(rng, h):
    """Sink logits (scaled-score units): moderate, some dominant (30), some negligible."""
    s = rng.uniform(-4.0, 4.0, h)
    u = rng.random(h)
    s[u < 0.15] = 30.0
    s[u > 0.9] = -60.0
    return s.astype(np.float32)


def _hook_arrays(rng, p, h):
    """(alibi_slopes, sinks) of a case, None where off."""
    return (_slopes(rng, h) if p.get("alibi") else None,
            _sinks(rng, h) if p.get("sinks") else None)


def _softcap_slack(softcap, cap_max, v_max):
    """The error the kernels' tanh.approx.f32 (relative error 2^-10.99, cuda_src/common/
    logits.cuh) adds for softcap > 0, which the float64 reference in the input precision does
    not model: each capped score s' = cap tanh(s / cap) is off by up to 2^-10.99 |s'|; with a
    small margin d = 2^-10.9 max|s'| (cap_max: over the keys a row sees). Every softmax weight
    then moves by a factor within e^(+/-2d), so out moves by at most (e^(2d) - 1) max|v| and
    lse by at most d: an extra absolute floor for out and lse of the softcap cases only (a
    bound: test_softcap_slack_covers_an_approximate_tanh)."""
    if softcap <= 0:
        return 0.0, 0.0
    d = 2.0 ** -10.9 * cap_max
    return math.expm1(2 * d) * v_max, d


def _vec(x, rng):
    """A (nheads,) hook vector on the device: None, or a view into a NaN-poisoned storage."""
    return None if x is None else _place(x, rng, bool(rng.random() < 0.5))[0]


def _hook_args(p, c, rng):
    return dict(softcap=p["softcap"], alibi_slopes=_vec(c["alibi_slopes"], rng),
                sinks=_vec(c["sinks"], rng))


# ---- flash_forward / flash_varlen_forward ---------------------------------------------------

def _attn_ref(q, k, v, causal, window, scale, dtype, softcap=0.0, alibi=None, sinks=None,
              tanh=np.tanh):
    """attention_ref (tests/test_flash.py) on host arrays, its scores computed once with BLAS,
    with the hooks of tests/reference.py attention_reference (softcap, then the ALiBi bias
    -slope |i + sk - sq - j|, then the mask; sinks join the denominator): float64 out
    (B, Sq, H, D), the same math in the input precision (P and out rounded to it:
    FlashAttention's ref_same_precision), lse (B, H, Sq) and the largest |capped score| a
    row sees (0 without softcap; for _softcap_slack). tanh: the CPU self-test's stand-in for
    the kernels' approximate one."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # contiguous operands: np.matmul hands only those to BLAS
    qf = np.ascontiguousarray(q.astype(np.float64).transpose(0, 2, 1, 3))
    qf = qf.reshape(b, hkv, g * sq, d)                    # query head h reads kv head h // g
    kf = np.ascontiguousarray(k.astype(np.float64).transpose(0, 2, 3, 1))   # (B, Hkv, D, Sk)
    vf = np.ascontiguousarray(v.astype(np.float64).transpose(0, 2, 1, 3))   # (B, Hkv, Sk, D)
    s = (qf @ kf).reshape(b, h, sq, sk) * scale
    p, l, m, _, cap_max = _softmax_terms(s, causal, window, softcap, alibi, sinks, tanh)
    empty, l1 = l == 0, np.where(l > 0, l, 1.0)

    def pv(p):
        o = (p.reshape(b, hkv, g * sq, sk) @ vf).reshape(b, h, sq, d) / l1
        return np.where(empty, 0.0, o).transpose(0, 2, 1, 3)
    lse = np.where(empty, -np.inf, m + np.log(l1))[..., 0]
    return pv(p), _round(pv(_round(p, DT[dtype], np)), DT[dtype], np), lse, cap_max


def _softmax_terms(s, causal, window, softcap=0.0, alibi=None, sinks=None, tanh=np.tanh):
    """The hooks and the mask on scaled scores s (B, H, Sq, Sk) (softcap, then the ALiBi bias,
    then -inf where masked) and their softmax's parts: exp(z - m), the row sums l (the sink's
    term included), m, the sink's term exp(sink - m) (None without sinks) and the largest
    |capped score| a row sees (0 without softcap)."""
    sq, sk = s.shape[-2:]
    visible = _visible(np, sq, sk, causal, window)
    cap_max = 0.0
    if softcap > 0:
        s = softcap * tanh(s / softcap)
        cap_max = float(np.abs(s[:, :, visible]).max(initial=0.0))
    if alibi is not None:
        dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
        s -= np.asarray(alibi, np.float64)[None, :, None, None] * dist
    s[:, :, ~visible] = -np.inf
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, np.float64)[None, :, None, None]
        m = np.maximum(m, sink)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.exp(sink - m)
        l = l + sink
    return p, l, m, sink, cap_max


def _flash_palette(rng):
    """The run's one head dim outside 64/128 (compiled 32 ... 256) and its dtype; the hooked
    cases' compiled head dim (64, 128 or that one) and dtype, and their two sets of hooks
    (FEAT_* bits, together all three): a bounded set of hooked variants (2 x 3 masks x 2
    splits + a combine)."""
    hd, dtype = int(_pick(rng, (32, 96, 160, 192, 224, 256))), _pick(rng, ("f16", "bf16"))
    hook_hd = int(_pick(rng, (64, 128, hd)))
    first = int(rng.integers(1, 8))
    second = (7 & ~first) | int(rng.integers(0, 8))           # what the first lacks, and more
    if second == first:
        second = 7 if first != 7 else int(rng.integers(1, 7))
    return dict(hd=hd, dtype=dtype, hook_hd=hook_hd,
                hook_dtype=dtype if hook_hd == hd else _pick(rng, ("f16", "bf16")),
                hooks=[first, second])


def _side(rng, n):
    u = rng.random()
    if u < 0.25:
        return -1
    if u < 0.45:
        return 0
    return int(rng.integers(1, 17)) if u < 0.7 else int(rng.integers(1, max(2, 3 * n // 2)))


def _scale(rng, values, hd):
    """softmax_scale of a value mode (None: the default)."""
    if values == "big":                  # integer q, k in [-64, 64]: scores ~1e4, exact in fp32
        return LN2                       # softmax_scale * log2(e) = 1: a power of two
    if values == "offset":               # q, k = 30 +/- 1: scores ~1e4 with a spread of ~20
        return LN2 * 2.0 ** -max(0, round(math.log2(900 * hd * LN2 / 1e4)))
    if rng.random() < 0.3:
        return round(float(rng.uniform(0.02, 0.3)), 4)
    return None


def _dtype_and_head_dim(rng, pal, hooks):
    """A case's dtype and head dim from the palette: its hooked ones for a hooked case."""
    if hooks:                            # the run's hooked head dim, below it too
        return pal["hook_dtype"], pal["hook_hd"] - 8 * int(rng.integers(0, 4))
    if rng.random() < 0.1:               # the run's odd head dim, below its compiled one too
        return pal["dtype"], pal["hd"] - 8 * int(rng.integers(0, 4))
    dtype = _pick(rng, ("f16", "bf16"))  # compiled 64 / 128, with zero-filled tails
    return dtype, int(_pick(rng, (64, 64, 64, 56, 48, 40, 128, 128, 128, 120, 112, 104)))


def _flash_common(rng, pal):
    """Everything but the lengths: dtype, head dim, heads, hooks, options, values, layouts."""
    hooks = int(_pick(rng, pal["hooks"])) if rng.random() < 0.25 else 0
    dtype, hd = _dtype_and_head_dim(rng, pal, hooks)
    p = {}
    _set_hooks(rng, p, hooks)
    values = _hook_values(p, _pick(rng, ("normal", "big", "offset", "vmax"),
                                   p=[0.7, 0.1, 0.1, 0.1]))
    if values == "vmax" and dtype != "f16":
        values = "normal"
    scale = _scale(rng, values, hd)
    return dict(dtype=dtype, hd=hd, hkv=int(_pick(rng, (1, 2, 4))),
                gqa=int(_pick(rng, (1, 2, 4, 8))), values=values, scale=scale, **p,
                num_splits=int(_pick(rng, (0, 1, 2, 3, 4, 8, 16, 64),
                                     p=[0.3, 0.25, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])),
                return_lse=bool(rng.random() < 0.75),
                out=_pick(rng, ("none", "contig", "strided")),
                strided="".join(n for n in "qkv" if rng.random() < 0.4))


def _mask(rng, p, n):
    mask = _pick(rng, ("none", "causal", "window"), p=[0.3, 0.25, 0.45])
    p["causal"] = mask == "causal" or (mask == "window" and bool(rng.random() < 0.2))
    p["window"] = (_side(rng, n), _side(rng, n)) if mask == "window" else (-1, -1)


def _flash_sizes(p):
    """(scores, elements of q + k + v) of a case: what bounds its host work."""
    h, d = p["hkv"] * p["gqa"], p["hd"]
    pairs = list(zip(p["lens_q"], p["lens_k"]))
    return (h * sum(a * max(b, d) for a, b in pairs),
            d * sum(a * h + 2 * b * p["hkv"] for a, b in pairs))


def _fit(p, caps=CAPS):
    """Shrink to caps: batch (all sequences alike) or kv heads first, then the longest length."""
    while any(s > cap for s, cap in zip(_flash_sizes(p), caps)):
        lq, lk = p["lens_q"], p["lens_k"]
        if p.get("batch", 1) > 1:
            p["batch"] //= 2
            del lq[p["batch"]:], lk[p["batch"]:]
        elif p["hkv"] > 1:
            p["hkv"] //= 2
        else:
            i = int(np.argmax([max(a, b) for a, b in zip(lq, lk)]))
            side = lq if lq[i] >= lk[i] else lk
            side[i] = side[i] * 7 // 10


def _fixed_lengths(rng, p, regimes, weights, caps=CAPS):
    """batch, sq, sk of a fixed-length case from one of its regimes ((batch, sq, sk) makers,
    drawn by weight), shrunk to caps; then its mask."""
    batch, sq, sk = _pick(rng, regimes, p=weights)()
    p.update(batch=batch, lens_q=[sq] * batch, lens_k=[sk] * batch)
    _fit(p, caps)
    p.update(batch=len(p["lens_q"]), sq=p["lens_q"][0], sk=p.pop("lens_k")[0])
    del p["lens_q"]
    _mask(rng, p, max(p["sq"], p["sk"]))
    return p


def _varlen_lengths(rng, p, hi, long_k, caps=CAPS):
    """Packed sequences of up to hi tokens each (1 in 10 cases a short query against long_k
    keys, a [lo, hi) range), shrunk to caps; rows past the last sequence, max_seqlen_* above
    the longest, the mask."""
    long = rng.random() < 0.1
    batch = int(rng.integers(1, 3 if long else 9))
    lq = [_length(rng, hi) for _ in range(batch)]
    lk = [_length(rng, hi) for _ in range(batch)]
    if long:                             # one decode-like sequence against a long context
        i = int(rng.integers(0, batch))
        lq[i], lk[i] = _length(rng, 64), int(rng.integers(*long_k))
    p.update(lens_q=lq, lens_k=lk)
    _fit(p, caps)
    p.update(pad_q=int(_pick(rng, (0, 0, 0, 3))), pad_k=int(_pick(rng, (0, 0, 0, 5))),
             extra_max=int(_pick(rng, (0, 0, 0, 1, 100))))   # max_seqlen_* above the longest
    _mask(rng, p, max(lq + lk))
    return p


def gen_flash(rng, pal):
    return _fixed_lengths(rng, _flash_common(rng, pal), [    # small, medium, long k, long q, square
        lambda: (int(rng.integers(1, 5)), _length(rng, 200), _length(rng, 200)),
        lambda: (int(rng.integers(1, 3)), _length(rng, 1100), _length(rng, 1100)),
        lambda: (1, _length(rng, 64), int(rng.integers(4096, 32769))),
        lambda: (1, int(rng.integers(4096, 12001)), _length(rng, 128)),
        lambda: (1, int(rng.integers(1024, 2049)), int(rng.integers(1024, 2049)))],
        [0.45, 0.35, 0.1, 0.05, 0.05])


def gen_varlen(rng, pal):
    return _varlen_lengths(rng, _flash_common(rng, pal), 300, (4096, 32769))


def _qkv(rng, p, qshape, kshape):
    dt = DT[p["dtype"]]
    if p["values"] == "big":
        q, k = (rng.integers(-64, 65, s).astype(np.float32) for s in (qshape, kshape))
    elif p["values"] == "offset":
        q, k = (30 + rng.integers(-1, 2, s).astype(np.float32) for s in (qshape, kshape))
    else:
        q, k = (rng.standard_normal(s, dtype=np.float32) for s in (qshape, kshape))
    v = rng.standard_normal(kshape, dtype=np.float32)
    if p["values"] == "vmax":            # fp16 values near 65504: out must stay finite
        sel = rng.random(kshape) < _pick(rng, (0.05, 1.0))
        v[sel] = rng.choice([-1.0, 1.0], sel.sum()) * rng.uniform(6e4, 65504, sel.sum())
    return q.astype(dt), k.astype(dt), v.astype(dt)


def _v_max(v):
    return float(np.abs(v.astype(np.float32)).max(initial=0.0))


def build_flash(p, rng):
    h = p["hkv"] * p["gqa"]
    q, k, v = _qkv(rng, p, (p["batch"], p["sq"], h, p["hd"]),
                   (p["batch"], p["sk"], p["hkv"], p["hd"]))
    slopes, sinks = _hook_arrays(rng, p, h)
    ref, ref_lp, lse, cap = _attn_ref(q, k, v, p["causal"], p["window"], p["scale"],
                                      p["dtype"], p["softcap"], slopes, sinks)
    return dict(q=q, k=k, v=v, ref=ref, ref_lp=ref_lp, ref_lse=lse, alibi_slopes=slopes,
                sinks=sinks, slack=_softcap_slack(p["softcap"], cap, _v_max(v)))


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def build_varlen(p, rng):
    h = p["hkv"] * p["gqa"]
    cu_q, cu_k = _cu(p["lens_q"]), _cu(p["lens_k"])
    q, k, v = _qkv(rng, p, (cu_q[-1] + p["pad_q"], h, p["hd"]),
                   (cu_k[-1] + p["pad_k"], p["hkv"], p["hd"]))
    slopes, sinks = _hook_arrays(rng, p, h)
    refs = [_attn_ref(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                      v[None, cu_k[b]:cu_k[b + 1]], p["causal"], p["window"], p["scale"],
                      p["dtype"], p["softcap"], slopes, sinks) for b in range(len(p["lens_q"]))]
    return dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, rows=int(cu_q[-1]),
                ref=np.concatenate([r[0][0] for r in refs]),
                ref_lp=np.concatenate([r[1][0] for r in refs]),
                ref_lse=np.concatenate([r[2][0] for r in refs], axis=1),
                alibi_slopes=slopes, sinks=sinks,
                slack=_softcap_slack(p["softcap"], max(r[3] for r in refs),
                                     _v_max(v[:cu_k[-1]])))


def _flash_options(p):
    return dict(causal=p["causal"], softmax_scale=p["scale"], window_size=p["window"],
                return_lse=p["return_lse"], num_splits=p["num_splits"])


def _flash_result(res, p, out, store, outside):
    o, lse = res if p["return_lse"] else (res, None)
    if out is not None:
        assert o is out, "out= was not returned"
        _assert_untouched(store, outside)
    return dict(out=o.get(), lse=None if lse is None else lse.get())


def call_flash(p, c, rng):
    q, k, v = (_place(c[n], rng, n in p["strided"])[0] for n in "qkv")
    out, store, outside = _poisoned_out(c["q"].shape, DT[p["dtype"]], rng, p["out"])
    res = cuattn.flash_forward(q, k, v, out=out, **_flash_options(p), **_hook_args(p, c, rng))
    return _flash_result(res, p, out, store, outside)


def call_varlen(p, c, rng):
    import cupy as cp
    q, k, v = (_place(c[n], rng, n in p["strided"])[0] for n in "qkv")
    out, store, outside = _poisoned_out(c["q"].shape, DT[p["dtype"]], rng, p["out"])
    res = cuattn.flash_varlen_forward(
        q, k, v, cp.asarray(c["cu_q"]), cp.asarray(c["cu_k"]),
        max(p["lens_q"]) + p["extra_max"], max(p["lens_k"]) + p["extra_max"], out=out,
        **_flash_options(p), **_hook_args(p, c, rng))
    return _flash_result(res, p, out, store, outside)


def check_flash(p, c, got):
    out, lse = got["out"], got["lse"]
    if "rows" in c:                      # varlen, paged_prefill: the rows the sequences cover
        out, lse = out[:c["rows"]], None if lse is None else lse[:, :c["rows"]]
    slack_out, slack_lse = c["slack"]
    _check_out(out, c["ref"], c["ref_lp"], _floor(DT[p["dtype"]]) + slack_out)
    _check_lse(lse, c["ref_lse"], lambda g, r: _flash_lse_close(g, r, slack_lse))


def oracle_flash(p, c):
    return dict(out=c["ref"].astype(DT[p["dtype"]]),
                lse=c["ref_lse"].astype(np.float32) if p["return_lse"] else None)


def _mask_of(p, max_sq, max_sk):
    """The mask kind the library gives a case's window (cuattn.flash._mask_and_bounds)."""
    left, right = p["window"]
    return _mask_and_bounds(left, 0 if p["causal"] else right, max_sq, max_sk)[0]


def _may_split(n, tiles, batch):
    """Whether a call of num_splits n over this many key tiles may split (n = 0: the tuning
    rule, whose choice depends on the device: a superset)."""
    return (n == 0 and tiles >= 2 * tuning.FLASH_MIN_TILES_PER_SPLIT) or \
        min(n, max(tiles, 1), 65535 // max(batch, 1)) > 1


def kernels_flash(p, arch):
    if "lens_q" in p:
        batch = len(p["lens_q"])
        max_sq, max_sk = max(p["lens_q"]) + p["extra_max"], max(p["lens_k"]) + p["extra_max"]
    else:
        batch, max_sq, max_sk = p["batch"], p["sq"], p["sk"]
    if max_sq == 0:
        return []
    mask = _mask_of(p, max_sq, max_sk)

    features = _features(p)

    def fwd(split):
        return tuning.flash_kernel_variant(p["dtype"], p["hd"], mask=mask, split=split,
                                           arch=arch, features=features, tma=True,   # (the strides a map takes)
                                           seqlen_q=max_sq)
    tiles = -(-max_sk // fwd(False).block_n)
    extra = [fwd(True), tuning.flash_combine_variant(p["dtype"], p["hd"],
                                                     sinks=bool(features & FEAT_SINKS))]
    return [fwd(False)] + (extra if _may_split(p["num_splits"], tiles, batch) else [])


def work_flash(p):
    h, d = p["hkv"] * p["gqa"], p["hd"]
    pairs = [(p["sq"], p["sk"])] * p["batch"] if "sq" in p else zip(p["lens_q"], p["lens_k"])
    per_score = (3 * d + 30) * (1.3 if _hooked(p) else 1.0)       # (tanh, the bias: ~30%)
    macs = sum(h * a * b * per_score + 40 * d * (h * a + 2 * p["hkv"] * b) for a, b in pairs)
    return macs / 7.5e9                  # host seconds on one core


# ---- flash_backward / flash_varlen_backward -------------------------------------------------
# A case runs the forward (flash_forward / flash_varlen_forward, unsplit: tested above) for out
# and lse on the device, then the backward; each sequence's gradients are checked against
# tests/reference.py attention_backward_reference by test_flash_bwd's rule (check_grads).

_BWD_INPUTS = ("q", "k", "v", "dout", "out", "lse")      # each a strided view in some cases


def _bwd_palette(rng):
    """The flash palette and a head dim of the main kernel's two-pass form (above 128:
    compiled 160, 192 or 256, which 224 runs as): the palette's odd one if above 128."""
    pal = _flash_palette(rng)
    pal["big"] = (pal["dtype"], pal["hd"]) if pal["hd"] > 128 else \
        (_pick(rng, ("f16", "bf16")), int(_pick(rng, (160, 192, 224, 256))))
    return pal


def _bwd_common(rng, pal):
    """Everything but the lengths: dtype, head dim (1 in 10 unhooked cases the two-pass
    form's), heads, hooks, values, options; the inputs given as strided views, and dq=, dk=,
    dv= each none, contiguous or strided."""
    hooks = int(_pick(rng, pal["hooks"])) if rng.random() < 0.25 else 0
    if not hooks and rng.random() < 0.1:
        dtype, top = pal["big"]
        hd = top - 8 * int(rng.integers(0, 4))
    else:
        dtype, hd = _dtype_and_head_dim(rng, pal, hooks)
    p = {}
    _set_hooks(rng, p, hooks)
    values = _hook_values(p, _pick(rng, ("normal", "big", "vmax"), p=[0.8, 0.12, 0.08]))
    if values == "vmax" and dtype != "f16":
        values = "normal"
    scale = 2.0 ** -int(rng.integers(0, 3)) if values == "big" else _scale(rng, values, hd)
    return dict(dtype=dtype, hd=hd, hkv=int(_pick(rng, (1, 2, 4))),
                gqa=int(_pick(rng, (1, 2, 4, 8))), values=values, scale=scale, **p,
                deterministic=bool(rng.random() < 0.25),
                grads=tuple(_pick(rng, ("none", "contig", "strided")) for _ in "qkv"),
                strided=tuple(n for n in _BWD_INPUTS if rng.random() < 0.4))


def gen_bwd(rng, pal):
    return _fixed_lengths(rng, _bwd_common(rng, pal), [      # small, medium, long k, long q
        lambda: (int(rng.integers(1, 5)), _length(rng, 160), _length(rng, 160)),
        lambda: (int(rng.integers(1, 3)), _length(rng, 700), _length(rng, 700)),
        lambda: (1, _length(rng, 48), int(rng.integers(1000, 3001))),
        lambda: (1, int(rng.integers(1000, 3001)), _length(rng, 96))],
        [0.55, 0.3, 0.08, 0.07], BWD_CAPS)


def gen_bwd_varlen(rng, pal):
    return _varlen_lengths(rng, _bwd_common(rng, pal), 200, (1000, 3001), BWD_CAPS)


def _bwd_values(rng, p, qshape, kshape):
    """q, k, v, dout of a value mode: "big", integer q and k with |q . k| <= 256, so that the
    scores (at a power-of-two scale) are exact in either dtype and the reference's lowp form
    rounds none of them (a softmax peaked over a few keys); "vmax", fp16 values near 65504 in
    v, dout scaled by 2^-10 (dP ~ D ~ 1e3 cancel in dP - D; dS and the gradients in range)."""
    if p["values"] == "big":
        r = max(1, math.isqrt(256 // p["hd"]))
        q, k = (rng.integers(-r, r + 1, s).astype(np.float32) for s in (qshape, kshape))
    else:
        q, k = (rng.standard_normal(s, dtype=np.float32) for s in (qshape, kshape))
    v = rng.standard_normal(kshape, dtype=np.float32)
    dout = rng.standard_normal(qshape, dtype=np.float32)
    if p["values"] == "vmax":
        sel = rng.random(kshape) < _pick(rng, (0.05, 1.0))
        v[sel] = rng.choice([-1.0, 1.0], sel.sum()) * rng.uniform(6e4, 65504, sel.sum())
        dout *= 2.0 ** -10
    return tuple(x.astype(DT[p["dtype"]]) for x in (q, k, v, dout))


_TANH_ERR = 2.0 ** -10.99               # tanh.approx.f32's relative error (_softcap_slack)


def _softcap_grad_slack(q, k, v, dout, scale, *, causal, window, softcap, alibi, sinks):
    """Bounds of what the kernels' tanh.approx.f32 moves one sequence's dq, dk, dv and dsinks
    by, which the float64 reference does not model (_softcap_slack is the forward's). Every
    capped score moves by at most a = 2^-10.9 max|s'|, so each P_ij and P_sink (the forward's
    lse shares the error) by a factor within e^(+/-2a), c = e^(2a) - 1. With
    E_i = sum_j P_ij |dP_ij|: D_i moves by at most c E_i, dZ = P (dP - D) by at most
    B = c (P |dP - D| + (1 + c) P E), and dS = dZ (1 - t^2), whose 1 - t^2 is off by at most
    2.01 x 2^-10.99, by G = B + 2.01 x 2^-10.99 P |dP - D|; so |ddQ| <= scale G |K|,
    |ddK| <= scale G^T |Q| and |ddV| <= c P^T |dO| (summed over a KV head's query heads),
    |ddsink| <= sum_i c P_sink (|D_i| + (1 + c) E_i). A bound:
    test_softcap_grad_slack_covers_an_approximate_tanh."""
    zero = dict(dq=0.0, dk=0.0, dv=0.0, dsinks=0.0)
    if softcap <= 0:
        return zero
    sq, h, d = q.shape
    sk, hkv, _ = k.shape

    def heads(x):                        # (heads, rows, d), contiguous for BLAS
        return np.ascontiguousarray(x.astype(np.float64).transpose(1, 0, 2))

    def per_kv(x):                       # (h, sk, d) -> summed over each KV head's group
        return x.reshape(hkv, h // hkv, sk, d).sum(axis=1)
    qh, oh = heads(q), heads(dout)
    kh, vh = (np.repeat(heads(x), h // hkv, axis=0) for x in (k, v))   # query head h: h // g
    e, l, _, sink, cap_max = _softmax_terms(scale * (qh @ kh.transpose(0, 2, 1))[None], causal,
                                            window, softcap, alibi, sinks)
    l = np.where(l > 0, l, 1.0)[0]
    p = e[0] / l
    c = math.expm1(2 * 2.0 ** -10.9 * cap_max)
    dp = oh @ vh.transpose(0, 2, 1)
    dd = (p * dp).sum(axis=-1, keepdims=True)
    ee = (p * np.abs(dp)).sum(axis=-1, keepdims=True)
    dz = p * np.abs(dp - dd)
    g = c * (dz + (1 + c) * p * ee) + 2.01 * _TANH_ERR * dz
    zero.update(dq=scale * (g @ np.abs(kh)).max(initial=0.0),
                dk=scale * per_kv(g.transpose(0, 2, 1) @ np.abs(qh)).max(initial=0.0),
                dv=c * per_kv(p.transpose(0, 2, 1) @ np.abs(oh)).max(initial=0.0))
    if sink is not None:
        ds = c * sink[0] / l * (np.abs(dd) + (1 + c) * ee)
        zero["dsinks"] = float(ds.sum(axis=(1, 2)).max(initial=0.0))
    return zero


def _bwd_lengths(p):
    """Per sequence (query, key) lengths; a fixed-length case's batch as its sequences."""
    if "lens_q" in p:
        return p["lens_q"], p["lens_k"]
    return [p["sq"]] * p["batch"], [p["sk"]] * p["batch"]


def build_bwd(p, rng):
    """Inputs, and per sequence the float64 gradients, their lowp form and the softcap slack
    (packed: a fixed-length case's batch as its sequences); the rows whose dq must be exactly
    0 (those that see no key, those past the sequences)."""
    h, hkv, d = p["hkv"] * p["gqa"], p["hkv"], p["hd"]
    lens_q, lens_k = _bwd_lengths(p)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, k, v, dout = _bwd_values(rng, p, (cu_q[-1] + p.get("pad_q", 0), h, d),
                                (cu_k[-1] + p.get("pad_k", 0), hkv, d))
    slopes, sinks = _hook_arrays(rng, p, h)
    scale = 1.0 / math.sqrt(d) if p["scale"] is None else p["scale"]
    kw = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"], alibi=slopes,
              sinks=sinks)

    def zeros():
        return dict(dq=np.zeros(q.shape), dk=np.zeros((cu_k[-1], hkv, d)),
                    dv=np.zeros((cu_k[-1], hkv, d)), dsinks=np.zeros(h))
    ref, lowp = zeros(), zeros()
    slack, dq_zero = [], np.ones(len(q), bool)
    for s, (a, b) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        seq = (q[rq], k[rk], v[rk], dout[rq])
        for grads, dt in ((ref, None), (lowp, DT[p["dtype"]])):
            dq, dk, dv, dsinks = attention_backward_reference(*seq, scale, lowp=dt, **kw)
            grads["dq"][rq], grads["dk"][rk], grads["dv"][rk] = dq, dk, dv
            if sinks is not None:
                grads["dsinks"] += dsinks
        slack.append(_softcap_grad_slack(*seq, scale, **kw))
        dq_zero[rq] = ~_visible(np, a, b, p["causal"], p["window"]).any(axis=1)
    if "sq" in p:                        # the call's (batch, seqlen, heads, head dim)
        q, dout = (x.reshape(p["batch"], p["sq"], h, d) for x in (q, dout))
        k, v = (x.reshape(p["batch"], p["sk"], hkv, d) for x in (k, v))
    return dict(q=q, k=k, v=v, dout=dout, alibi_slopes=slopes, sinks=sinks, cu_q=cu_q,
                cu_k=cu_k, ref=ref, lowp=lowp, slack=slack, dq_zero=dq_zero)


def call_bwd(p, c, rng):
    """The forward for out and lse (out= a poisoned view where "out" is strided, lse copied into
    one where "lse" is), then the backward, dq= / dk= / dv= as drawn; rows of a given dk / dv
    past cu_seqlens_k[-1] stay NaN (not written), deterministic calls repeat bit for bit."""
    import cupy as cp
    x = {n: _place(c[n], rng, n in p["strided"])[0] for n in ("q", "k", "v", "dout")}
    opts = dict(causal=p["causal"], softmax_scale=p["scale"], window_size=p["window"],
                **_hook_args(p, c, rng))
    varlen = "lens_q" in p
    if varlen:
        lens = (cp.asarray(c["cu_q"]), cp.asarray(c["cu_k"]), max(p["lens_q"]) + p["extra_max"],
                max(p["lens_k"]) + p["extra_max"])
        fwd, bwd = cuattn.flash_varlen_forward, cuattn.flash_varlen_backward
    else:
        lens, fwd, bwd = (), cuattn.flash_forward, cuattn.flash_backward
    dt = DT[p["dtype"]]
    out = _poisoned_out(c["q"].shape, dt, rng, "strided" if "out" in p["strided"] else "none")
    out, lse = fwd(x["q"], x["k"], x["v"], *lens, out=out[0], return_lse=True, num_splits=1,
                   **opts)
    fwd_out = (out.get(), lse.get())
    lse = _place(fwd_out[1], rng, "lse" in p["strided"], free_last=True)[0]
    given = [_poisoned_out(a.shape, dt, rng, how) for a, how in zip((c["q"], c["k"], c["k"]),
                                                                    p["grads"])]
    args = (x["dout"], x["q"], x["k"], x["v"], out, lse) + lens
    res = bwd(*args, deterministic=p["deterministic"], dq=given[0][0], dk=given[1][0],
              dv=given[2][0], **opts)
    for r, (view, store, outside) in zip(res, given):
        if view is not None:
            assert r is view, "dq= / dk= / dv= was not returned"
            _assert_untouched(store, outside)
    host = [r.get() for r in res]
    got = dict(dq=host[0], dk=host[1], dv=host[2], dsinks=host[3] if len(host) == 4 else None,
               forward=fwd_out)
    if varlen:
        n = int(c["cu_k"][-1])
        for name, (view, _, _) in zip(("dk", "dv"), given[1:]):
            if view is not None:
                assert np.isnan(got[name][n:].astype(np.float32)).all(), \
                    f"{name} written past cu_seqlens_k[-1]"
            got[name] = got[name][:n]
    if p["deterministic"]:
        for name, r in zip(got, bwd(*args, deterministic=True, **opts)):
            again = r.get()[:len(got[name])]
            assert np.array_equal(again.view(np.uint8), got[name].view(np.uint8)), \
                f"deterministic: {name} differs between two calls"
    return got


def check_bwd(p, c, got):
    h, hkv, d = p["hkv"] * p["gqa"], p["hkv"], p["hd"]
    dt = DT[p["dtype"]]
    grads = dict(dq=got["dq"].reshape(-1, h, d), dk=got["dk"].reshape(-1, hkv, d),
                 dv=got["dv"].reshape(-1, hkv, d))
    assert not grads["dq"][c["dq_zero"]].astype(np.float32).any(), \
        "dq is not 0 in a row that sees no key (or past the sequences)"
    cu_q, cu_k = c["cu_q"], c["cu_k"]
    for s, slack in enumerate(c["slack"]):
        rk = slice(cu_k[s], cu_k[s + 1])
        for name, rows in (("dq", slice(cu_q[s], cu_q[s + 1])), ("dk", rk), ("dv", rk)):
            check_grads(grads[name][rows], c["ref"][name][rows], c["lowp"][name][rows], dt,
                        f"{name} of sequence {s}", slack[name])
    if c["sinks"] is not None:
        want = c["ref"]["dsinks"] if "forward" not in got else _dsinks_of(c, *got["forward"])
        check_grads(got["dsinks"], want, c["lowp"]["dsinks"] - c["ref"]["dsinks"] + want, dt,
                    "dsinks", sum(slack["dsinks"] for slack in c["slack"]))


def _dsinks_of(c, out, lse):
    """dsinks = -sum over rows of p_sink * D, D = rowsum(dout * out), in float64 from the out
    and lse the backward is given (the forward's, rounded), as the kernel defines it. The
    float64 reference's own out differs from the forward's by more than its low-precision
    twin models (a 2.3x miss at f16 with V near 65504; read from the code, not measured: the
    forward divides rounded P V by the unrounded sum), and dsinks sums that difference over
    every row; dq / dk / dv keep the reference's rule."""
    sinks = np.asarray(c["sinks"], np.float64)
    dout, out, lse = (np.asarray(a, np.float64) for a in (c["dout"], out, lse))
    d = (dout * out).sum(-1)                                   # (..., rows, heads)
    if "cu_q" in c and d.ndim == 2:                            # varlen: lse (heads, total_q)
        n = int(c["cu_q"][-1])
        return -(np.exp(sinks[None, :] - lse[:, :n].T) * d[:n]).sum(axis=0)
    return -(np.exp(sinks[None, None, :] - lse.transpose(0, 2, 1)) * d).sum(axis=(0, 1))


def oracle_bwd(p, c):
    dt = DT[p["dtype"]]
    kshape = c["k"].shape if "sq" in p else c["ref"]["dk"].shape
    return dict(dq=c["ref"]["dq"].astype(dt).reshape(c["q"].shape),
                dk=c["ref"]["dk"].astype(dt).reshape(kshape),
                dv=c["ref"]["dv"].astype(dt).reshape(kshape),
                dsinks=None if c["sinks"] is None else c["ref"]["dsinks"].astype(np.float32))


def kernels_bwd(p, arch):
    """The forward's (unsplit), then the backward's as flash_bwd._plan launches them: the
    pre-pass and dQ convert where there are rows, the main kernel where there are keys, the
    sinks' gradient with sinks."""
    lens_q, lens_k = _bwd_lengths(p)
    max_sq, max_sk = (max(n) + p.get("extra_max", 0) for n in (lens_q, lens_k))
    prep, convert, dsinks = tuning_bwd.flash_bwd_row_variants(p["dtype"], p["hd"])
    main = tuning_bwd.flash_bwd_variant(p["dtype"], p["hd"], mask=_mask_of(p, max_sq, max_sk),
                                        arch=arch, features=_features(p))
    rows = sum(lens_q) + p.get("pad_q", 0)
    return kernels_flash(dict(p, num_splits=1), arch) + [prep, convert] * (rows > 0) + \
        [main] * (max_sk > 0) + [dsinks] * p["sinks"]


def work_bwd(p):
    """The reference and its lowp form loop over the heads of each sequence: a cost per head,
    per score and per row element; the softcap bound's per score (fitted to build_bwd and
    check_bwd on the CPU machine, one core)."""
    h, d = p["hkv"] * p["gqa"], p["hd"]
    per_score = 28 + 0.55 * d + (90 if p["softcap"] > 0 else 0)
    return sum(4e-5 * h + (h * a * b * per_score + 75 * d * (h * a + p["hkv"] * b)) / 1e9
               for a, b in zip(*_bwd_lengths(p))) + 3e-4


# ---- merge_attn_states / merge_states ------------------------------------------------------

def _merge_palette(rng):
    return dict(hs=8 * int(rng.integers(1, 65)))        # the run's odd head size, 8 ... 512


def gen_merge(rng, pal, stacked):
    dtype = _pick(rng, ("f16", "bf16"))
    hs = int(_pick(rng, (64, 128, pal["hs"]), p=[0.4, 0.4, 0.2]))
    k = int(_pick(rng, (1, 2, 2, 3, 4, 5, 8))) if stacked else 2
    t = 0 if rng.random() < 0.04 else _length(rng, _pick(rng, (64, 512, 3000)))
    h = int(rng.integers(1, 33))
    while k * t * h * hs > 5e5:
        h, t = (h // 2, t) if h > 1 else (h, t * 7 // 10)
    values = _pick(rng, ("normal", "vmax"), p=[0.85, 0.15]) if dtype == "f16" else "normal"
    return dict(dtype=dtype, hs=hs, k=k, stacked=stacked, tokens=t, heads=h, values=values,
                lse_sd=float(_pick(rng, (0.5, 3.0, 30.0))),
                lse_offset=float(_pick(rng, (0.0, 0.0, 80.0, -1e4, 1e4))),
                p_empty=float(_pick(rng, (0.0, 0.1, 0.5))),
                empty_rows=bool(rng.random() < 0.3), nan_empty=bool(rng.random() < 0.7),
                strided=bool(rng.random() < 0.5), lse_strided=bool(rng.random() < 0.5),
                out=_pick(rng, ("none", "contig", "strided")),
                out_lse=_pick(rng, ("none", "contig", "strided")))


def build_merge(p, rng):
    k, t, h, d = p["k"], p["tokens"], p["heads"], p["hs"]
    outs = rng.standard_normal((k, t, h, d), dtype=np.float32)
    if p["values"] == "vmax":
        sel = rng.random(outs.shape) < 0.5
        outs[sel] = rng.choice([-1.0, 1.0], sel.sum()) * rng.uniform(6e4, 65504, sel.sum())
    lses = (rng.standard_normal((k, h, t)) * p["lse_sd"] + p["lse_offset"]).astype(np.float32)
    empty = rng.random(lses.shape) < p["p_empty"]                    # lse = +inf or -inf
    if p["empty_rows"]:                                              # every state empty
        empty |= (rng.random((h, t)) < 0.1)[None]
    lses[empty] = np.where(rng.random(empty.sum()) < 0.5, np.inf, -np.inf)
    if p["nan_empty"]:                   # what an empty state holds must not be read
        outs[np.broadcast_to(empty.transpose(0, 2, 1)[..., None], outs.shape)] = np.nan
    outs = outs.astype(DT[p["dtype"]])
    ref, ref_lse = merge_reference(np.nan_to_num(outs.astype(np.float64), nan=0.0), lses)
    return dict(outs=outs, lses=lses, ref=ref, ref_lse=ref_lse)


def call_merge(p, c, rng):
    o, l = c["outs"], c["lses"]
    t, h, d = o.shape[1:]
    if p["stacked"]:
        args = (_place(o, rng, p["strided"])[0],
                _place(l, rng, p["lse_strided"], free_last=True)[0])
        fn = cuattn.merge_states
    else:
        a, b = (_place(o[i], rng, p["strided"])[0] for i in (0, 1))
        la, lb = (_place(l[i], rng, p["lse_strided"], free_last=True)[0] for i in (0, 1))
        args, fn = (a, la, b, lb), cuattn.merge_attn_states
    out = _poisoned_out((t, h, d), DT[p["dtype"]], rng, p["out"])
    out_lse = _poisoned_out((h, t), np.float32, rng, p["out_lse"], free_last=True)
    res = fn(*args, out=out[0], out_lse=out_lse[0])
    for got, (given, store, outside) in zip(res, (out, out_lse)):
        if given is not None:
            assert got is given, "out= / out_lse= was not returned"
            _assert_untouched(store, outside)
    return dict(out=res[0].get(), lse=res[1].get())


def check_merge(p, c, got):
    _check_out(got["out"], c["ref"], _rounded(c["ref"], p["dtype"]), 1e-3)
    _check_lse(got["lse"], c["ref_lse"],
               lambda g, r: np.allclose(g, r, rtol=1e-5, atol=1e-5))


def oracle_merge(p, c):
    return dict(out=c["ref"].astype(DT[p["dtype"]]), lse=c["ref_lse"].astype(np.float32))


def kernels_merge(p, arch):
    return [tuning.merge_variant(p["dtype"], p["hs"], p["stacked"])]


def work_merge(p):
    return p["k"] * p["tokens"] * p["heads"] * p["hs"] / 5.5e7 + 1e-3


# ---- paged caches by plain indexing (paged_attention's NHD cases, paged_prefill) ------------

def _q_values(rng, shape, values, dt):
    if values == "big":                  # integer q, k in [-64, 64]: scores exact in fp32
        q = rng.integers(-64, 65, shape).astype(np.float32)
    elif values == "offset":             # q, k = 30 +/- 1
        q = 30 + rng.integers(-1, 2, shape).astype(np.float32)
    else:
        q = rng.standard_normal(shape, dtype=np.float32)
    return q.astype(dt)


def _kv_values(rng, shape, values, dt):
    """K and V tokens (n, nkv, hs) of a value mode (those of _qkv)."""
    k = _q_values(rng, shape, values, dt)
    v = rng.standard_normal(shape, dtype=np.float32)
    if values == "vmax":                 # fp16 values near 65504: out must stay finite
        sel = rng.random(shape) < 0.5
        v[sel] = rng.choice([-1.0, 1.0], sel.sum()) * rng.uniform(6e4, 65504, sel.sum())
    return k, v.astype(dt)


def _paged_cache(rng, contexts, *, nkv, hs, bs, dtype, layout, extra_table, shared=0,
                 values="normal"):
    """16-bit K / V caches in the documented layouts (cuattn/paged/layout.py), written token
    by token by plain indexing: sequence s holds contexts[s] tokens in shuffled physical
    blocks, its first ``shared`` blocks the same blocks for every sequence (prefix caching).
    NaN in every slot no sequence may read: past a length, 5 unreferenced ("spare") blocks,
    which the table entries past a sequence's blocks name."""
    dt = DT[dtype]
    nb = [-(-n // bs) for n in contexts]
    used = shared + sum(b - shared for b in nb)
    perm = rng.permutation(used + 5).astype(np.int32)
    spare = perm[used:]
    x = 16 // dt.itemsize
    if layout == "nhd":
        kshape = vshape = (used + 5, bs, nkv, hs)
    else:
        kshape, vshape = (used + 5, nkv, hs // x, bs, x), (used + 5, nkv, hs, bs)
    k_cache, v_cache = np.full(kshape, np.nan, dt), np.full(vshape, np.nan, dt)
    table = rng.choice(spare, (len(contexts), max(max(nb, default=0) + extra_table, 1)))
    table = table.astype(np.int32)
    pre_k, pre_v = _kv_values(rng, (shared * bs, nkv, hs), values, dt)
    nxt, ks, vs = shared, [], []
    for s, n in enumerate(contexts):
        table[s, :shared] = perm[:shared]
        table[s, shared:nb[s]] = perm[nxt:nxt + nb[s] - shared]
        nxt += nb[s] - shared
        k, v = _kv_values(rng, (n, nkv, hs), values, dt)
        k[:shared * bs], v[:shared * bs] = pre_k, pre_v
        tok = np.arange(n)
        write_tokens(k_cache, v_cache, layout, table[s, tok // bs], tok % bs, k, v)
        ks.append(k)
        vs.append(v)
    return dict(k_cache=k_cache, v_cache=v_cache, block_tables=table,
                seq_lens=np.array(contexts, np.int32), spare=spare, tokens=(ks, vs))


_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)


def _cache_float(x, scale):
    """test_paged._cache_values (fp8 bytes dequantised by their scale), by a table of the 256
    e4m3 values (ml_dtypes' conversion of every element costs more than the reference)."""
    if x.dtype in (np.dtype(np.uint8), E4M3):
        return _E4M3_VALUES[x.view(np.uint8)] * scale
    return x.astype(np.float64)


def _gather(c, layout, s, k_scale=1.0, v_scale=1.0):
    """Sequence s's K and V (n, nkv, hs) in float64, token by token through its block table
    by plain indexing of the documented layouts (fp8 bytes dequantised by their scales)."""
    kc, vc = c["k_cache"], c["v_cache"]
    n = int(c["seq_lens"][s])
    bs, nkv, hs = kc.shape[1:] if layout == "nhd" else (vc.shape[3], vc.shape[1], vc.shape[2])
    tok = np.arange(n)
    blk, off = c["block_tables"][s, tok // bs], tok % bs
    if layout == "nhd":
        k, v = kc[blk, off], vc[blk, off]
    else:
        k, v = kc[blk, :, :, off, :].reshape(n, nkv, hs), vc[blk, :, :, off]
    return _cache_float(k, k_scale), _cache_float(v, v_scale)


def _fp8_scales(rng):
    """(k_scale, v_scale) of a case: fp8 dequantisation (ignored for 16-bit caches, so drawn
    there too)."""
    return tuple(round(float(np.exp(rng.uniform(np.log(0.02), np.log(2.0)))), 4) for _ in "kv")


def _quantise_caches(c, p):
    """fp8 caches (p["cache"] "e4m3" or "u8") of the 16-bit ones _paged_cache wrote: x / scale
    in e4m3, clipped to +/-448 (NaN slots stay NaN). vLLM's K layout is laid out again for
    1-byte elements: [blk, h, d // 16, off, d % 16] (x = 16 // itemsize)."""
    for n, sc in (("k_cache", p["k_scale"]), ("v_cache", p["v_scale"])):
        x = np.clip(c[n].astype(np.float32) / np.float32(sc), -448, 448).astype(E4M3)
        if n == "k_cache" and p["layout"] == "vllm":
            nb, h, _, bs, _ = x.shape                  # [blk, h, d // 8, off, d % 8]
            x = x.transpose(0, 1, 3, 2, 4).reshape(nb, h, bs, -1, 16).transpose(0, 1, 3, 2, 4)
            x = np.ascontiguousarray(x)
        c[n] = x.view(np.uint8) if p["cache"] == "u8" else x


# ---- paged_attention ------------------------------------------------------------------------

def _paged_config(rng, core, partition=None, hooked=False):
    """Kernel-defining choices: dtype, cache, head size, block size, group, ALiBi, softcap,
    sinks, layout, partition (None: the library picks). hooked: softcap or sinks on."""
    cache = "same" if core else _pick(rng, ("same", "e4m3", "u8"), p=[0.5, 0.25, 0.25])
    sizes = [s for s in paged.HEAD_SIZES if cache == "same" or s % 16 == 0]
    hs = int(_pick(rng, (64, 128))) if core or rng.random() < 0.5 else int(_pick(rng, sizes))
    # NHD, blocks 1..256: the tensor-core form (16-bit caches, head sizes multiples of 16),
    # else the flash form (fp8 caches, head size 120)
    nhd = not core and bool(rng.random() < (0.5 if hooked else 0.25))
    if nhd:
        bs = int(_pick(rng, paged.NHD_BLOCK_SIZES))
    else:
        bs = 16 if core or rng.random() < 0.5 else int(_pick(rng, (8, 32)))
    softcap = sinks = False
    while not core:
        softcap, sinks = (bool(rng.random() < (0.5 if hooked else 0.15)) for _ in "cs")
        if softcap or sinks or not hooked:
            break
    return dict(dtype=_pick(rng, ("f16", "bf16")), cache=cache, hs=hs, bs=bs,
                group=int(_pick(rng, (1, 4, 8) if core else (1, 2, 4, 8))),
                alibi=not core and bool(rng.random() < 0.3),
                partition=partition if core else int(_pick(rng, (128, 256, 512, 1024))),
                layout="nhd" if nhd else "vllm", softcap=softcap, sinks=sinks)


def _paged_palette(rng):
    """Six configurations per run: two common ones (partition 512 and the library's choice),
    three from the whole space, one of them with softcap or sinks."""
    return [_paged_config(rng, True, 512), _paged_config(rng, True, None)] + \
        [_paged_config(rng, False) for _ in range(3)] + [_paged_config(rng, False, hooked=True)]


def _max_context(p):
    return (max(-(-n // p["bs"]) for n in p["lens"]) + p["extra_table"]) * p["bs"]


def _decode_window(rng, lens):
    """(left, right): the query at seq_len - 1 sees keys j >= seq_len - 1 - left (right is
    moot for decode); a fifth of the cases bounded."""
    u = rng.random()
    if u < 0.8:
        left = -1
    elif u < 0.84:
        left = 0
    elif u < 0.92:
        left = int(rng.integers(1, 17))
    else:
        left = int(rng.integers(1, max(2, 3 * max(lens) // 2)))
    return left, int(_pick(rng, (-1, -1, 0, 5)))


def gen_paged(rng, pal):
    p = dict(pal[int(rng.choice(6, p=[0.28, 0.28, 0.1, 0.1, 0.1, 0.14]))])
    g, bs, part = p["group"], p["bs"], p["partition"] or 512
    p["gqa"] = 16 if g == 8 and rng.random() < 0.4 else g
    p["nkv"] = int(_pick(rng, (1, 1, 2, 4)))              # 1 with gqa > 1: MQA
    edges = (1, bs - 1, bs, bs + 1, part - 1, part, part + 1, 2 * part + 1)
    regime = _pick(rng, ("short", "medium", "long"), p=[0.6, 0.3, 0.1])
    if regime == "long":                 # tens of thousands of tokens: one KV head
        p["nkv"] = 1
        lens = [int(rng.integers(8192, 32769))]
        if rng.random() < 0.3:
            lens.append(_length(rng, 600, edges))
    else:
        n, hi = (int(rng.integers(1, 13)), 600) if regime == "short" else \
            (int(rng.integers(1, 5)), 2500)
        lens = [_length(rng, hi, edges) for _ in range(n)]
    p["lens"] = lens
    p["extra_table"] = int(rng.integers(0, 4))
    version = _pick(rng, ("v1", "v2", "auto"))
    if version == "v1" and 4 * g * max(_max_context(p), 128) > 160_000:
        version = "auto"                 # v1 keeps a whole sequence's logits in shared memory
    _set_hooks(rng, p, _features(p))
    p["window"] = _decode_window(rng, lens)
    values = "normal" if p["alibi"] else _pick(rng, ("normal", "big", "offset", "vmax"),
                                                   p=[0.7, 0.1, 0.1, 0.1])
    if values == "vmax" and (p["dtype"], p["cache"]) != ("f16", "same"):
        values = "normal"
    values = _hook_values(p, values)
    fp8 = p["cache"] != "same"
    ks, vs = _fp8_scales(rng)
    scale = None if rng.random() < 0.7 else round(float(rng.uniform(0.02, 0.3)), 4)
    if values in ("big", "offset"):      # integer q, k: softmax_scale * k_scale * log2(e) = 2^-a
        ks = 4.0 if fp8 else ks
        keff = ks if fp8 else 1.0
        a = 0 if values == "big" else max(0, round(math.log2(900 * p["hs"] * LN2 / 1e4)))
        scale = LN2 * 2.0 ** -a / keff
    p.update(version=version, values=values, k_scale=ks, v_scale=vs, scale=scale,
             q_strided=bool(rng.random() < 0.5), cache_strided=bool(rng.random() < 0.3),
             out=_pick(rng, ("none", "contig", "strided")),
             return_lse=bool(rng.random() < 0.75))
    return p


def _ints_into(cache, fp8, values, rng):
    """Replace every finite entry of a cache (the slots a sequence reads) by integers."""
    if fp8:
        u = cache.view(np.uint8)
        fin = (u & 0x7F) != 0x7F
        lo, hi = (-16, 16) if values == "big" else (7, 9)   # x k_scale 4: ~30 for "offset"
        ints = rng.integers(lo, hi + 1, fin.sum()).astype(np.float32)
        u[fin] = ints.astype(E4M3).view(np.uint8)
    else:
        fin = np.isfinite(cache.astype(np.float32))
        lo, hi = (-64, 64) if values == "big" else (29, 31)
        cache[fin] = rng.integers(lo, hi + 1, fin.sum()).astype(np.float32).astype(cache.dtype)


def _paged_plain(p):
    """No hook, window or NHD: test_paged's paged_reference models the case."""
    return p["layout"] == "vllm" and not _hooked(p) and p["window"][0] < 0


def _decode_reference(p, c, scale):
    """Per sequence _attn_ref of its query (position seq_len - 1: causal, the window's left
    side) over its K/V gathered through the block table (_gather): out, lse, slack."""
    outs, lses, cap, v_max = [], [], 0.0, 0.0
    for s in range(len(p["lens"])):
        k, v = _gather(c, p["layout"], s, p["k_scale"], p["v_scale"])
        o, _, lse, m = _attn_ref(c["q"][None, s:s + 1], k[None], v[None], True,
                                 (p["window"][0], -1), scale, p["dtype"], p["softcap"],
                                 c["alibi_slopes"], c["sinks"])
        outs.append(o[0])
        lses.append(lse[0])
        cap, v_max = max(cap, m), max(v_max, float(np.abs(v).max(initial=0.0)))
    return (np.concatenate(outs), np.concatenate(lses, axis=1),
            _softcap_slack(p["softcap"], cap, v_max))


def build_paged(p, rng):
    h = p["nkv"] * p["gqa"]
    if p["layout"] == "nhd":             # the values drawn as they are written
        c = _paged_cache(rng, p["lens"], nkv=p["nkv"], hs=p["hs"], bs=p["bs"],
                         dtype=p["dtype"], layout="nhd", extra_table=p["extra_table"],
                         values=p["values"])
        if p["cache"] != "same":
            _quantise_caches(c, p)
        c["q"] = _q_values(rng, (len(p["lens"]), h, p["hs"]), p["values"], DT[p["dtype"]])
        c["alibi_slopes"] = _alibi_std(h) if p["alibi"] else None
    else:
        c = make_case(rng, lengths=p["lens"], nkv=p["nkv"], gqa=p["gqa"], head_size=p["hs"],
                      block_size=p["bs"], dtype=p["dtype"], cache_kind=p["cache"],
                      k_scale=p["k_scale"], v_scale=p["v_scale"],
                      extra_table=p["extra_table"], alibi=p["alibi"])
        if p["values"] in ("big", "offset"):
            lo, hi = (-64, 64) if p["values"] == "big" else (29, 31)
            c["q"] = rng.integers(lo, hi + 1, c["q"].shape).astype(np.float32).astype(
                c["q"].dtype)
            _ints_into(c["k_cache"], p["cache"] != "same", p["values"], rng)
        elif p["values"] == "vmax":
            vc = c["v_cache"]
            fin = np.isfinite(vc) & (rng.random(vc.shape) < 0.5)
            vc[fin] = rng.choice([-1.0, 1.0], fin.sum()) * rng.uniform(6e4, 65504, fin.sum())
    c["sinks"] = _sinks(rng, h) if p["sinks"] else None
    scale = 1.0 / math.sqrt(p["hs"]) if p["scale"] is None else p["scale"]
    if _paged_plain(p):
        c["ref"], c["ref_lse"] = paged_reference(c["q"], c["k_cache"], c["v_cache"],
                                                 c["block_tables"], c["seq_lens"], scale,
                                                 p["k_scale"], p["v_scale"], c["alibi_slopes"])
        c["slack"] = (0.0, 0.0)
    else:
        c["ref"], c["ref_lse"], c["slack"] = _decode_reference(p, c, scale)
    return c


def call_paged(p, c, rng):
    import cupy as cp
    q = _place(c["q"], rng, p["q_strided"])[0]
    kc, vc = (_place(c[n], rng, p["cache_strided"])[0] for n in ("k_cache", "v_cache"))
    out, store, outside = _poisoned_out(c["q"].shape, c["q"].dtype, rng, p["out"])
    res = cuattn.paged_attention(
        q, kc, vc, cp.asarray(c["block_tables"]), cp.asarray(c["seq_lens"]),
        softmax_scale=p["scale"], k_scale=p["k_scale"], v_scale=p["v_scale"],
        window_size=p["window"], kv_layout=p["layout"], version=p["version"],
        partition_size=p["partition"], return_lse=p["return_lse"], out=out,
        **_hook_args(p, c, rng))
    return _flash_result(res, p, out, store, outside)


def check_paged(p, c, got):
    slack_out, slack_lse = c["slack"]
    _check_out(got["out"], c["ref"], _rounded(c["ref"], p["dtype"]), 1e-3 + slack_out)
    _check_lse(got["lse"], c["ref_lse"],
               lambda g, r: np.allclose(g, r, rtol=1e-4, atol=1e-3 + slack_lse))


def _cache_kind(p):
    """The case's cache as the library names it: its dtype's short name or "e4m3"."""
    return p["dtype"] if p["cache"] == "same" else "e4m3"


def _paged_key(p, partition):
    """The main kernel's variant, of the form paged_attention runs for the case."""
    cache = _cache_kind(p)
    nhd = p["layout"] == "nhd"
    return form_for(cache, p["hs"], p["group"], nhd=nhd).variant(
        p["dtype"], cache, p["hs"], p["bs"], p["group"], partition, p["alibi"],
        softcap=p["softcap"] > 0, sinks=p["sinks"], nhd=nhd)


def kernels_paged(p, arch):
    """The v1 / v2 variants the call may run: a superset where the library's choice depends
    on the device (version "auto", partition None)."""
    if p["layout"] == "nhd" and not tuning.tensor_core_decode_fits(_cache_kind(p), p["hs"]):
        return []                        # the flash form: its kernels compile on first use
    keys = [_paged_key(p, 0)] if p["version"] != "v2" else []
    if p["version"] != "v1":
        parts = [p["partition"]] if p["partition"] else tuning.PAGED_PARTITION_SIZES
        keys += [_paged_key(p, ps) for ps in parts]
        keys.append(tuning.paged_reduce_variant(p["dtype"], p["hs"], sinks=p["sinks"]))
    return keys


def work_paged(p):
    """fp8 caches cost twice (make_case's ml_dtypes conversions); vLLM-layout 16-bit cases
    through _decode_reference a quarter more than through paged_reference."""
    tokens = sum(p["lens"]) + 5 * p["bs"] + len(p["lens"]) * p["bs"]
    factor = 2.0 if p["cache"] != "same" else \
        (1.0 if _paged_plain(p) or p["layout"] == "nhd" else 1.25)
    return tokens * p["nkv"] * p["hs"] * (30 + 4 * p["gqa"]) * factor / 1.3e9


# ---- reshape_and_cache ----------------------------------------------------------------------

def gen_reshape(rng, pal):
    cache = _pick(rng, ("same", "e4m3", "u8"), p=[0.5, 0.25, 0.25])
    dtype = _pick(rng, ("f16", "bf16"))
    hs = int(_pick(rng, [s for s in paged.HEAD_SIZES if cache == "same" or s % 16 == 0]))
    bs, nkv = int(_pick(rng, paged.BLOCK_SIZES)), int(rng.integers(1, 9))
    blocks = int(rng.integers(1, 129))
    while blocks * bs * nkv * hs > 1e6:
        nkv, blocks = (nkv // 2, blocks) if nkv > 1 else (nkv, blocks // 2)
    tokens = 0 if rng.random() < 0.05 else int(rng.integers(1, min(1000, blocks * bs) + 1))
    values = "vmax" if dtype == "f16" and cache == "same" and rng.random() < 0.2 else "normal"
    return dict(dtype=dtype, cache=cache, hs=hs, bs=bs, nkv=nkv, blocks=blocks, tokens=tokens,
                slot64=bool(rng.random() < 0.5), neg=float(_pick(rng, (0.0, 0.0, 0.1, 0.5))),
                amp=float(_pick(rng, (1e-3, 1.0, 1.0, 30.0))), values=values,
                kv_strided=bool(rng.random() < 0.5), cache_strided=bool(rng.random() < 0.3))


def build_reshape(p, rng):
    dt = DT[p["dtype"]]
    cdt = dt if p["cache"] == "same" else (E4M3 if p["cache"] == "e4m3" else np.dtype(np.uint8))
    n, nkv, hs, bs = p["tokens"], p["nkv"], p["hs"], p["bs"]
    kshape, vshape = cuattn.paged_kv_cache_shapes(p["blocks"], nkv, hs, bs, cdt)
    bits = np.uint8 if cdt.itemsize == 1 else np.uint16
    k0, v0 = (rng.integers(0, np.iinfo(bits).max + 1, s, dtype=bits).view(cdt)
              for s in (kshape, vshape))                              # any bytes, NaN included
    kv = rng.standard_normal((2, n, nkv, hs), dtype=np.float32) * p["amp"]
    if p["values"] == "vmax":
        kv = np.sign(kv) * rng.uniform(6e4, 65504, kv.shape)
    key, value = kv.astype(dt)
    slots = rng.permutation(p["blocks"] * bs)[:n].astype(np.int64 if p["slot64"] else np.int32)
    neg = rng.random(n) < p["neg"]
    slots[neg] = -rng.integers(1, 2**40 if p["slot64"] else 2**31, neg.sum())
    # fp8: max|x| / scale stays below e4m3's 448 (beyond it ml_dtypes gives NaN, CUDA 448)
    ks, vs = (float(p["amp"] * np.exp(rng.uniform(np.log(0.02), np.log(2.0))))
              if cdt.itemsize == 1 else 1.0 for _ in "kv")
    k_exp, v_exp = k0.copy(), v0.copy()
    ok = slots >= 0
    blk, off = slots[ok] // bs, slots[ok] % bs
    kt, vt = key[ok], value[ok]
    if cdt.itemsize == 1:
        kt, vt = ((x.astype(np.float32) / np.float32(s)).astype(E4M3).view(np.uint8).view(cdt)
                  for x, s in ((kt, ks), (vt, vs)))
    k_exp[blk, :, :, off, :] = kt.reshape(-1, nkv, hs // kshape[4], kshape[4])
    v_exp[blk, :, :, off] = vt
    c = dict(key=key, value=value, slots=slots, k_scale=ks, v_scale=vs)
    for n, init, want in (("k", k0, k_exp), ("v", v0, v_exp)):   # the caches' storages
        layout = _layout(rng, init.ndim, init.itemsize, p["cache_strided"])
        init, want = (x.view(np.uint8) if x.dtype == E4M3 else x for x in (init, want))
        c[n + "_init"], _, c[n + "_view"] = _storage(init, layout)
        c[n + "_want"] = _storage(want, layout)[0]
    return c


def call_reshape(p, c, rng):
    import cupy as cp
    key, value = (_place(c[n], rng, p["kv_strided"])[0] for n in ("key", "value"))
    stores = [cp.asarray(c[n + "_init"]) for n in "kv"]
    views = [s if c[n + "_view"] is None else s.transpose(c[n + "_view"][0])[c[n + "_view"][1]]
             for n, s in zip("kv", stores)]      # (fp8 caches travel as their uint8 bytes)
    cuattn.reshape_and_cache(key, value, *views, cp.asarray(c["slots"]),
                             k_scale=c["k_scale"], v_scale=c["v_scale"])
    return dict(k=stores[0].get(), v=stores[1].get())


def check_reshape(p, c, got):
    for n in "kv":                       # bit for bit, the storage outside the views included
        diff = got[n].view(np.uint8) != c[n + "_want"].view(np.uint8)
        assert not diff.any(), f"{n}_cache differs in {int(diff.sum())} bytes"


def oracle_reshape(p, c):
    return dict(k=c["k_want"], v=c["v_want"])


def kernels_reshape(p, arch):
    return [tuning.reshape_variant(p["dtype"], _cache_kind(p), p["slot64"])] if p["tokens"] else []


def work_reshape(p):
    cache = p["blocks"] * p["nkv"] * p["hs"] * p["bs"]
    return (cache + p["tokens"] * p["nkv"] * p["hs"]) / 1e8 + 1e-3


# ---- paged_prefill --------------------------------------------------------------------------

def _prefill_palette(rng):
    """Three families of kernel-defining values per run: dtype, head size (128, the run's odd
    one, any paged_prefill takes), cache layout (one each, then either), hooks (the third family's, a non-empty
    set), the one mask besides causal their cases take and the cache (16-bit, but for one of
    the last two families fp8 e4m3, as ml_dtypes' type or uint8 bytes, where its head size
    fits). Within a family a case's mask (2), split-KV (2) and the tile class of its rows
    (max_seqlen_q x group: <= 16, 32, 64 or more; two classes above head size 128) pick the
    kernel: at most 2 x 2 x 4 variants and a combine per family."""
    first = _pick(rng, ("vllm", "nhd"))
    layouts = (first, "nhd" if first == "vllm" else "vllm", _pick(rng, ("vllm", "nhd")))
    odd = [s for s in paged.PREFILL_HEAD_SIZES if s != 128]
    fams = [dict(dtype=_pick(rng, ("f16", "bf16")),
                 hs=128 if i == 0 else int(_pick(rng, odd if i == 1 else
                                                 paged.PREFILL_HEAD_SIZES)),
                 layout=layouts[i], hooks=int(rng.integers(1, 8)) if i == 2 else 0,
                 mask=_pick(rng, ("none", "window")), cache="same") for i in range(3)]
    fits = [i for i in (1, 2) if fams[i]["hs"] % 16 == 0]     # fp8 rows: whole 16-byte vectors
    if fits:
        fams[int(_pick(rng, fits))]["cache"] = _pick(rng, ("e4m3", "u8"))
    return fams


def _q_short(rng):
    """New tokens of a speculative / decode-like sequence: 0 ... 16, the edges often."""
    u = rng.random()
    if u < 0.1:
        return 0
    if u < 0.5:
        return int(_pick(rng, (1, 2, 4, 8, 15, 16)))
    return int(rng.integers(1, 17))


def _prefill_sizes(p):
    """(scores x head size, elements of q + the caches) of a case: what bounds its host
    work."""
    h, d, bs = p["nkv"] * p["gqa"], p["hs"], p["bs"]
    ctx = [a + b for a, b in zip(p["lens_q"], p["prefix"])]
    slots = sum(-(-n // bs) * bs for n in ctx) + 5 * bs
    return (h * d * sum(a * max(n, d) for a, n in zip(p["lens_q"], ctx)),
            d * (h * sum(p["lens_q"]) + 2 * p["nkv"] * slots))


def _fit_prefill(p):
    """Shrink to PREFILL_CAPS: KV heads, then long prefixes, sequences, the one left."""
    lq, pre = p["lens_q"], p["prefix"]
    while any(s > cap for s, cap in zip(_prefill_sizes(p), PREFILL_CAPS)):
        if p["nkv"] > 1:
            p["nkv"] //= 2
        elif max(pre) > 1024:
            i = int(np.argmax(pre))
            pre[i] = pre[i] * 7 // 10
        elif len(lq) > 1:
            del lq[-1], pre[-1]
        elif pre[0] >= lq[0]:
            pre[0] = pre[0] * 7 // 10
        else:
            lq[0] = lq[0] * 7 // 10


def gen_prefill(rng, pal):
    fam = pal[int(rng.choice(3, p=[0.4, 0.25, 0.35]))]
    p = dict(dtype=fam["dtype"], hs=fam["hs"], layout=fam["layout"], cache=fam["cache"])
    p["bs"] = int(_pick(rng, paged.BLOCK_SIZES if p["layout"] == "vllm" else
                        paged.NHD_BLOCK_SIZES))
    p["nkv"] = int(_pick(rng, (1, 1, 2, 4)))
    p["gqa"] = int(_pick(rng, (1, 2, 4, 8, 16), p=[0.2, 0.2, 0.3, 0.2, 0.1]))
    regime = _pick(rng, ("spec", "mixed", "chunk"), p=[0.45, 0.35, 0.2])
    batch = int(rng.integers(1, 4 if regime == "chunk" else 9))
    lq = [_q_short(rng) for _ in range(batch)]
    if regime == "mixed":                # a few chunk-sized queries among the short ones
        for i in rng.choice(batch, min(batch, int(rng.integers(1, 3))), replace=False):
            lq[int(i)] = int(rng.integers(17, 401))
    elif regime == "chunk":
        lq = [_length(rng, 400) for _ in range(batch)]
    prefix = []                          # cached tokens before the new ones
    for a in lq:
        u = rng.random()
        if u < 0.15:
            prefix.append(0)             # a first chunk: the whole context is new
        elif u < 0.2 and a <= 16:
            prefix.append(int(rng.integers(4096, 12289)))      # a long context
        else:
            prefix.append(_length(rng, int(_pick(rng, (64, 600, 3000))) if a <= 16 else 1000))
    p.update(lens_q=lq, prefix=prefix)
    _fit_prefill(p)
    ctx = [a + b for a, b in zip(p["lens_q"], p.pop("prefix"))]
    shared = 0
    if len(ctx) > 1 and rng.random() < 0.2:    # prefix caching: the first blocks shared
        shared = int(rng.integers(0, min(ctx) // p["bs"] + 1))
    p.update(ctx=ctx, shared=shared, extra_table=int(rng.integers(0, 4)),
             pad_q=int(_pick(rng, (0, 0, 0, 3))),              # rows past cu_seqlens_q[-1]
             extra_max=int(_pick(rng, (0, 0, 0, 1, 7))))       # max_seqlen_q above the longest
    # the mask: causal (bottom-right, the default), or the family's other one
    kind = "causal" if rng.random() < 0.6 else fam["mask"]
    p["causal"], p["window"] = kind == "causal", (-1, -1)
    if kind == "window":     # a bounded side (one that excludes no key runs without it)
        n = max(ctx)
        p["causal"] = bool(rng.random() < 0.4)
        left, right = _side(rng, n), _side(rng, n)
        if left < 0 and (p["causal"] or right < 0):
            left = int(rng.integers(0, n + 1))
        p["window"] = (left, right)
    _set_hooks(rng, p, fam["hooks"])
    values = _pick(rng, ("normal", "big", "offset", "vmax"), p=[0.7, 0.1, 0.1, 0.1])
    if values == "vmax" and p["dtype"] != "f16" or p["cache"] != "same":
        values = "normal"                # fp8: integers / k_scale are no longer exact
    values = _hook_values(p, values)
    ks, vs = _fp8_scales(rng)
    p.update(values=values, scale=_scale(rng, values, p["hs"]), k_scale=ks, v_scale=vs,
             num_splits=int(_pick(rng, (0, 1, 2, 3, 4, 8, 16, 64),
                                  p=[0.3, 0.25, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])),
             return_lse=bool(rng.random() < 0.75), out=_pick(rng, ("none", "contig", "strided")),
             q_strided=bool(rng.random() < 0.4), cache_strided=bool(rng.random() < 0.3),
             table_strided=bool(rng.random() < 0.3))
    return p


def build_prefill(p, rng):
    h = p["nkv"] * p["gqa"]
    c = _paged_cache(rng, p["ctx"], nkv=p["nkv"], hs=p["hs"], bs=p["bs"], dtype=p["dtype"],
                     layout=p["layout"], extra_table=p["extra_table"], shared=p["shared"],
                     values=p["values"])
    fp8 = p["cache"] != "same"
    if fp8:
        _quantise_caches(c, p)
    scales = (p["k_scale"], p["v_scale"]) if fp8 else (1.0, 1.0)
    cu = _cu(p["lens_q"])
    c["q"] = _q_values(rng, (cu[-1] + p["pad_q"], h, p["hs"]), p["values"], DT[p["dtype"]])
    c["alibi_slopes"], c["sinks"] = _hook_arrays(rng, p, h)
    refs, v_max = [], 0.0
    for s in range(len(p["ctx"])):       # query i of s at position ctx - q_len + i
        k, v = _gather(c, p["layout"], s, *scales)
        refs.append(_attn_ref(c["q"][None, cu[s]:cu[s + 1]], k[None], v[None], p["causal"],
                              p["window"], p["scale"], p["dtype"], p["softcap"],
                              c["alibi_slopes"], c["sinks"]))
        v_max = max(v_max, float(np.abs(v).max(initial=0.0)))
    c.update(cu_q=cu, rows=int(cu[-1]), ref=np.concatenate([r[0][0] for r in refs]),
             ref_lp=np.concatenate([r[1][0] for r in refs]),
             ref_lse=np.concatenate([r[2][0] for r in refs], axis=1),
             slack=_softcap_slack(p["softcap"], max(r[3] for r in refs), v_max))
    return c


def call_prefill(p, c, rng):
    import cupy as cp
    q = _place(c["q"], rng, p["q_strided"])[0]
    kc, vc = (_place(c[n], rng, p["cache_strided"])[0] for n in ("k_cache", "v_cache"))
    table = c["block_tables"]
    if p["table_strided"]:               # a view of a wider table, its extra columns spare
        wide = np.full((table.shape[0], table.shape[1] + 3), c["spare"][0], np.int32)
        wide[:, :table.shape[1]] = table
        bt = cp.asarray(wide)[:, :table.shape[1]]
    else:
        bt = cp.asarray(table)
    out, store, outside = _poisoned_out(c["q"].shape, c["q"].dtype, rng, p["out"])
    res = cuattn.paged_prefill(
        q, kc, vc, bt, cp.asarray(c["seq_lens"]), cp.asarray(c["cu_q"]),
        max(p["lens_q"]) + p["extra_max"], causal=p["causal"], softmax_scale=p["scale"],
        window_size=p["window"], kv_layout=p["layout"], return_lse=p["return_lse"],
        num_splits=p["num_splits"], k_scale=p["k_scale"], v_scale=p["v_scale"], out=out,
        **_hook_args(p, c, rng))
    return _flash_result(res, p, out, store, outside)


def _few_token_kernels(p, max_sq):
    """The few-token form's (paged/prefill.py _decode_plan): v1 and v2's kernels, every
    partition where the library picks (num_splits 0), else the call's."""
    tokens, group = tuning.paged_multi_token(p["hs"], p["gqa"], max_sq)

    def key(ps):
        return tuning.paged_mma_variant(p["dtype"], p["hs"], p["bs"], group, ps, tokens=tokens,
                                        alibi=p["alibi"], softcap=p["softcap"] > 0,
                                        sinks=p["sinks"], nhd=p["layout"] == "nhd")
    n = p["num_splits"]
    if n == 1:
        return [key(0)]
    max_context = (max(-(-c // p["bs"]) for c in p["ctx"]) + p["extra_table"]) * p["bs"]
    parts = tuning.PAGED_PARTITION_SIZES if n == 0 else \
        [tuning.paged_split_partition(max_context, n)]
    return [key(0)] * (n == 0) + [key(ps) for ps in parts] + \
        [tuning.paged_reduce_variant(p["dtype"], p["hs"], sinks=p["sinks"])]


def kernels_prefill(p, arch):
    """The few-token form's kernels where the call takes it (tuning.paged_prefill_form), else
    what kernels_flash enumerates, for tuning.paged_prefill_variant."""
    max_sq = max(p["lens_q"]) + p["extra_max"]
    if max_sq == 0:
        return []
    total_q = sum(p["lens_q"]) + p["pad_q"]
    if tuning.paged_prefill_form(_cache_kind(p), p["hs"], max_sq, total_q) == "decode":
        return _few_token_kernels(p, max_sq)
    max_blocks = max(max(-(-n // p["bs"]) for n in p["ctx"]) + p["extra_table"], 1)
    mask, features = _mask_of(p, max_sq, max_blocks * p["bs"]), _features(p)
    kv = KV_PAGED_NHD if p["layout"] == "nhd" else KV_PAGED_VLLM
    hopper = tuning.paged_prefill_path(arch, p["hs"], p["layout"], p["bs"],
                                       _cache_kind(p)) == "wgmma"

    def fwd(split):
        if hopper:     # (the caches' strides a map takes)
            return tuning.flash_sm90_variant(p["dtype"], p["hs"], mask=mask, split=split,
                                             features=features, tma=True, seqlen_q=max_sq,
                                             kv=kv)
        return tuning.paged_prefill_variant(p["dtype"], p["hs"], mask=mask, split=split,
                                            arch=arch, kv=kv, features=features,
                                            rows=max_sq * p["gqa"], fp8=p["cache"] != "same")
    tiles = -(-max_blocks * p["bs"] // fwd(False).block_n)
    extra = [fwd(True), tuning.flash_combine_variant(p["dtype"], p["hs"],
                                                     sinks=bool(features & FEAT_SINKS))]
    return [fwd(False)] + (extra if _may_split(p["num_splits"], tiles, len(p["ctx"])) else [])


def work_prefill(p):
    """fp8 caches: their quantisation and dequantising gather cost about two passes more
    over the slots."""
    h, d, bs = p["nkv"] * p["gqa"], p["hs"], p["bs"]
    slots = sum(-(-n // bs) * bs for n in p["ctx"]) + 5 * bs
    macs = sum(h * a * n * (3 * d + 30) + 40 * d * (h * a + 2 * p["nkv"] * n)
               for a, n in zip(p["lens_q"], p["ctx"]))
    passes = 3 if p["cache"] != "same" else 1
    return macs / 7.5e9 + passes * slots * p["nkv"] * d / 1e8 + 1e-3


# ---- flash_with_kvcache ---------------------------------------------------------------------
# A dense cache (batch_cache, seqlen_cache, nheads_kv, head_size) whose rows hold each entry's
# cache_seqlens keys (NaN in every other slot, and in the rows no entry names), new k / v
# appended first (those past a row's end dropped): out and lse of every entry against
# _attn_ref over its row's first min(cache_seqlens + seqlen_new, seqlen_cache) keys, and both
# caches after the call bit for bit against the append done on the host (NaN where NaN;
# strided caches: the storage outside the views still NaN).

def _kvcache_palette(rng):
    """Three families of kernel-defining values per run: dtype (the first two differ), the
    compiled head dim (64 or 128; the run's odd one, 32 ... 256; any, with hooks, a non-empty
    set: two sets of hooks, together all three), the one mask besides causal their cases take
    (window and none for the first two).
    A case's head size is its family's or up to 24 below it (same compiled dims: 40 runs
    as 64, 72 as 96 / 128 on sm_90, 200 as 224 / 256). Within a family a case's mask (2),
    split-KV (2) and its tile class (seqlen_q x group: <= 16, 32, 64 or more, and the Hopper
    kernel's at seqlen_q >= 64 over caches of >= 256 slots) pick the kernel."""
    first = _pick(rng, ("f16", "bf16"))
    masks = [_pick(rng, ("window", "none"))]
    masks.append("none" if masks[0] == "window" else "window")
    hooks = int(rng.integers(1, 8))
    more = (7 & ~hooks) | int(rng.integers(0, 8))             # what the first lacks, and more
    if more == hooks:
        more = 7 if hooks != 7 else int(rng.integers(1, 7))
    return [dict(dtype=first, hd=int(_pick(rng, (64, 128))), hooks=[0], mask=masks[0]),
            dict(dtype="bf16" if first == "f16" else "f16",
                 hd=int(_pick(rng, (32, 96, 160, 192, 224, 256))), hooks=[0], mask=masks[1]),
            dict(dtype=_pick(rng, ("f16", "bf16")), hd=int(_pick(rng, (64, 128, 96, 192, 256))),
                 hooks=[hooks, more], mask=_pick(rng, ("window", "none")))]


def _kvcache_sizes(p):
    """(scores x head size, elements of q, the new keys and the used rows' slots) of a case:
    what bounds its host work (every row counted at the cache's length)."""
    h, d, cap = p["nkv"] * p["gqa"], p["hs"], p["seqlen_cache"]
    return (h * d * p["batch"] * p["sq"] * max(cap, d),
            d * p["batch"] * (h * p["sq"] + 2 * p["nkv"] * (cap + p["new"])))


def _fit_kvcache(p):
    """Shrink to KVCACHE_CAPS: KV heads, the batch, the group, then the longer of seqlen_q and
    the cache (keeping the Hopper kernel's reach, seqlen_q >= 64 over >= 256 slots, while
    the other can give), and the new keys with seqlen_q where they were equal."""
    floors = (64 if p["sq"] >= 64 else 1, 256 if p["seqlen_cache"] >= 256 else 1)
    while any(s > cap for s, cap in zip(_kvcache_sizes(p), KVCACHE_CAPS)):
        sq, cap = p["sq"], p["seqlen_cache"]
        if p["nkv"] > 1:
            p["nkv"] //= 2
        elif p["batch"] > 1:
            p["batch"] -= 1
        elif p["gqa"] > 2:
            p["gqa"] //= 2
        elif cap >= sq and (cap * 7 // 10 >= floors[1] or sq * 7 // 10 < floors[0]):
            p["seqlen_cache"] = max(1, cap * 7 // 10)
        else:
            p["sq"] = max(1, sq * 7 // 10)
            if p["new"] == sq:
                p["new"] = p["sq"]
    p["new"] = min(p["new"], p["seqlen_cache"])   # (more new keys than slots: a ValueError)


_KVCACHE_EDGES = (17, 31, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513)


def _kvcache_len(rng, cap, new):
    """Keys a cache row holds before the call: empty, full (every new key dropped), filled to
    the end by the new keys, some of the new keys past the end (dropped), or any that leaves
    the new keys room."""
    u = rng.random()
    if u < 0.12:
        return 0
    if u < 0.19:
        return cap
    if u < 0.29 and new:
        return max(0, cap - new)
    if u < 0.37 and new:
        return int(rng.integers(max(0, cap - new + 1), cap + 1))
    return int(rng.integers(0, max(0, cap - new) + 1))


def gen_kvcache(rng, pal):
    fam = pal[int(rng.choice(3, p=[0.45, 0.25, 0.3]))]
    p = dict(dtype=fam["dtype"], hs=fam["hd"] - 8 * int(_pick(rng, (0, 1, 2, 3),
                                                            p=[0.55, 0.15, 0.15, 0.15])))
    p["nkv"], p["gqa"], p["batch"] = (int(rng.integers(1, 5)), int(rng.integers(1, 9)),
                                      int(rng.integers(1, 7)))
    u = rng.random()                     # the cache: tiny, up to a few hundred, thousands
    if u < 0.15:
        cap = int(_pick(rng, (1, 1, 2, 3, 7, 8, 15, 16)))
    elif u < 0.7:
        cap = int(_pick(rng, _KVCACHE_EDGES)) if u < 0.35 else int(rng.integers(17, 601))
    else:
        cap = int(rng.integers(600, 4097))
    regime = _pick(rng, ("decode", "spec", "prefill", "over"), p=[0.3, 0.25, 0.33, 0.12])
    if regime == "decode":
        sq = 1
    elif regime == "spec":
        sq = max(2, _q_short(rng))
    elif regime == "prefill":            # the Hopper kernel's 64 rows, tile edges
        sq = int(_pick(rng, (17, 63, 64, 65, 127, 128, 129, 255, 256, 257))) \
            if rng.random() < 0.4 else int(rng.integers(17, 401))
    else:                                # more queries than any row's keys
        cap = min(cap, int(_pick(rng, (1, 7, 40, 300))))
        sq = cap + int(rng.integers(1, 60))
    u = rng.random()                     # new keys: none (k = v = None), as many as queries,
    if u < 0.25:                         # or another count (some past a short cache's end)
        new = 0
    elif u < 0.7:
        new = sq
    else:
        new = int(rng.integers(1, max(sq, 16) + 1))
    p.update(seqlen_cache=cap, sq=sq, new=new)
    _fit_kvcache(p)
    cap, batch, new = p["seqlen_cache"], p["batch"], p["new"]
    extra = int(_pick(rng, (0, 0, 1, 3)))
    p["batch_cache"] = batch + extra
    p["batch_idx"] = [int(r) for r in rng.permutation(batch + extra)[:batch]] \
        if rng.random() < 0.7 else None   # None: entry b reads row b
    p["int_lens"] = bool(rng.random() < 0.15)     # cache_seqlens as a Python int
    lens = [_kvcache_len(rng, cap, new)] * batch if p["int_lens"] else \
        [_kvcache_len(rng, cap, new) for _ in range(batch)]
    p["lens"] = lens
    kind = "causal" if rng.random() < 0.45 else fam["mask"]
    p["causal"], p["window"] = kind == "causal", (-1, -1)
    if kind == "window":                 # a bounded side (one that excludes no key runs without)
        n = cap
        p["causal"] = bool(rng.random() < 0.3)
        left, right = _side(rng, n), _side(rng, n)
        if left < 0 and (p["causal"] or right < 0):
            left = int(rng.integers(0, n + 1))
        p["window"] = (left, right)
    _set_hooks(rng, p, int(_pick(rng, fam["hooks"])))
    values = _pick(rng, ("normal", "big", "offset", "vmax"), p=[0.7, 0.1, 0.1, 0.1])
    if values == "vmax" and p["dtype"] != "f16":
        values = "normal"
    values = _hook_values(p, values)
    p.update(values=values, scale=_scale(rng, values, p["hs"]),
             num_splits=int(_pick(rng, (0, 1, 2, 3, 4, 8, 16, 64),
                                  p=[0.3, 0.25, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05])),
             return_lse=bool(rng.random() < 0.75), out=_pick(rng, ("none", "contig", "strided")),
             q_strided=bool(rng.random() < 0.4), cache_strided=bool(rng.random() < 0.35),
             new_strided=bool(rng.random() < 0.3))
    return p


def _kvcache_keys(p):
    """Keys each entry's attention sees: its row's keys and the new ones, at most the
    cache's length (new keys past the end are dropped)."""
    return [min(n + p["new"], p["seqlen_cache"]) for n in p["lens"]]


def build_kvcache(p, rng):
    dt = DT[p["dtype"]]
    h, nkv, hs, cap = p["nkv"] * p["gqa"], p["nkv"], p["hs"], p["seqlen_cache"]
    rows = np.asarray(p["batch_idx"] if p["batch_idx"] is not None else range(p["batch"]),
                      np.int32)
    kc = np.full((p["batch_cache"], cap, nkv, hs), np.nan, dt)
    vc = kc.copy()
    for row, n in zip(rows, p["lens"]):
        kc[row, :n], vc[row, :n] = _kv_values(rng, (n, nkv, hs), p["values"], dt)
    k = v = None
    if p["new"]:
        k, v = _kv_values(rng, (p["batch"], p["new"], nkv, hs), p["values"], dt)
    q = _q_values(rng, (p["batch"], p["sq"], h, hs), p["values"], dt)
    slopes, sinks = _hook_arrays(rng, p, h)
    k_after, v_after = kc.copy(), vc.copy()
    refs, v_max = [], 0.0
    for b, (row, n, keys) in enumerate(zip(rows, p["lens"], _kvcache_keys(p))):
        if k is not None:                # the append: new keys past the row's end dropped
            k_after[row, n:keys], v_after[row, n:keys] = k[b, :keys - n], v[b, :keys - n]
        ks, vs = k_after[row, :keys], v_after[row, :keys]
        refs.append(_attn_ref(q[b:b + 1], ks[None], vs[None], p["causal"], p["window"],
                              p["scale"], p["dtype"], p["softcap"], slopes, sinks))
        v_max = max(v_max, _v_max(vs))
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, batch_idx=rows,
                cache_seqlens=np.asarray(p["lens"], np.int32), k_after=k_after,
                v_after=v_after, alibi_slopes=slopes, sinks=sinks,
                ref=np.concatenate([r[0] for r in refs]),
                ref_lp=np.concatenate([r[1] for r in refs]),
                ref_lse=np.concatenate([r[2] for r in refs]),
                slack=_softcap_slack(p["softcap"], max(r[3] for r in refs), v_max))


def _heads_slice(x, rng):
    """Host x (batch, seqlen, heads, head dim) on the device as a slice along the heads of a
    wider NaN-poisoned storage (a fused QKV buffer: its rows still pack), each head's row
    padded by 0 or 16 bytes. Returns (device view, device storage, host mask of the storage
    outside the view)."""
    import cupy as cp
    b, s, h, d = x.shape
    extra, pad = int(rng.integers(1, 2 * h + 1)), (16 // x.itemsize) * int(rng.integers(0, 2))
    off = int(rng.integers(0, extra + 1))
    store = np.full((b, s, h + extra, d + pad), np.nan, x.dtype)
    store[:, :, off:off + h, :d] = x
    outside = np.ones(store.shape, bool)
    outside[:, :, off:off + h, :d] = False
    dev = cp.asarray(store)
    return dev[:, :, off:off + h, :d], dev, outside


def call_kvcache(p, c, rng):
    import cupy as cp
    q = _heads_slice(c["q"], rng)[0] if p["q_strided"] else cp.asarray(c["q"])
    caches = [_place(c[n], rng, p["cache_strided"]) for n in ("k_cache", "v_cache")]
    k, v = (None if c[n] is None else _place(c[n], rng, p["new_strided"])[0] for n in "kv")
    if p["out"] == "strided":
        out, store, outside = _heads_slice(np.full(c["q"].shape, np.nan, c["q"].dtype), rng)
    else:
        out, store, outside = _poisoned_out(c["q"].shape, c["q"].dtype, rng, p["out"])
    res = cuattn.flash_with_kvcache(
        q, caches[0][0], caches[1][0], k, v,
        cache_seqlens=p["lens"][0] if p["int_lens"] else cp.asarray(c["cache_seqlens"]),
        cache_batch_idx=None if p["batch_idx"] is None else cp.asarray(c["batch_idx"]),
        causal=p["causal"], softmax_scale=p["scale"], window_size=p["window"],
        return_lse=p["return_lse"], num_splits=p["num_splits"], out=out,
        **_hook_args(p, c, rng))
    got = _flash_result(res, p, out, store, outside)
    for name, (view, cache_store, cache_outside) in zip(("k_cache", "v_cache"), caches):
        _assert_untouched(cache_store, cache_outside, name)
        got[name] = view.get()
    return got


def check_kvcache(p, c, got):
    """The caches first (an append that went astray explains a wrong attention), bit for
    bit; then out and lse as check_flash."""
    for name, want in (("k_cache", c["k_after"]), ("v_cache", c["v_after"])):
        g = got[name]
        assert g.shape == want.shape, (name, g.shape, want.shape)
        bad = g.view(np.uint16) != want.view(np.uint16)
        if bad.any():
            row, slot = (int(i) for i in np.argwhere(bad)[0][:2])
            raise AssertionError(f"{name}: {int(bad.sum())} elements differ from the append "
                                 f"(first at row {row}, slot {slot})")
    check_flash(p, c, got)


def oracle_kvcache(p, c):
    return dict(oracle_flash(p, c), k_cache=c["k_after"].copy(), v_cache=c["v_after"].copy())


def kernels_kvcache(p, arch):
    """The append kernel where there are new keys, then the attention's: paged_prefill's
    flash form over an NHD cache of one block per row (the power of two at or above
    seqlen_cache), on the Hopper kernel where cuattn/kvcache.py allows it (seqlen_q, the
    cache's length) and tuning.paged_prefill_path picks it, else the mma.sync kernel with
    the query heads of a KV head packed into its rows."""
    from cuattn.kvcache import _HOPPER_MIN_SEQLEN_CACHE, _HOPPER_MIN_SEQLEN_Q
    sq, cap = p["sq"], p["seqlen_cache"]
    append = [tuning.kvcache_append_variant(p["dtype"])] if p["new"] else []
    block_size = 1 << (cap - 1).bit_length()
    mask, features = _mask_of(p, sq, cap), _features(p)
    hopper = sq >= _HOPPER_MIN_SEQLEN_Q and cap >= _HOPPER_MIN_SEQLEN_CACHE and \
        tuning.paged_prefill_path(arch, p["hs"], "nhd", block_size, p["dtype"]) == "wgmma"

    def fwd(split):
        if hopper:
            return tuning.flash_sm90_variant(p["dtype"], p["hs"], mask=mask, split=split,
                                             features=features, tma=True, seqlen_q=sq,
                                             kv=KV_PAGED_NHD)
        return tuning.paged_prefill_variant(p["dtype"], p["hs"], mask=mask, split=split,
                                            arch=arch, kv=KV_PAGED_NHD, features=features,
                                            rows=sq * p["gqa"])
    tiles = -(-cap // fwd(False).block_n)
    extra = [fwd(True), tuning.flash_combine_variant(p["dtype"], p["hs"],
                                                     sinks=bool(features & FEAT_SINKS))]
    return append + [fwd(False)] + (extra if _may_split(p["num_splits"], tiles, p["batch"])
                                    else [])


def work_kvcache(p):
    """_attn_ref per entry (work_flash's cost per score), the values drawn and rounded (q,
    the keys each entry reads), the caches' slots (filled, copied for the append, compared
    bit for bit) and a cost per entry: fitted to build_kvcache + check_kvcache of 900 cases
    timed on the CPU machine (one BLAS thread)."""
    h, d, keys = p["nkv"] * p["gqa"], p["hs"], _kvcache_keys(p)
    per_score = (3 * d + 30) * (1.3 if _hooked(p) else 1.0)
    macs = sum(h * p["sq"] * n * per_score for n in keys) + \
        160 * d * (h * p["sq"] * p["batch"] + p["nkv"] * sum(keys))
    slots = p["batch_cache"] * p["seqlen_cache"] * p["nkv"] * d
    return macs / 7.5e9 + slots / 4e8 + 5e-4 * p["batch"] + 1e-3


# ---- the runner ----------------------------------------------------------------------------

Spec = namedtuple("Spec", "palette gen build call check oracle kernels work")
SPECS = {
    "flash_forward": Spec(_flash_palette, gen_flash, build_flash, call_flash, check_flash,
                          oracle_flash, kernels_flash, work_flash),
    "flash_varlen_forward": Spec(_flash_palette, gen_varlen, build_varlen, call_varlen,
                                 check_flash, oracle_flash, kernels_flash, work_flash),
    "merge_attn_states": Spec(_merge_palette, lambda r, pal: gen_merge(r, pal, False),
                              build_merge, call_merge, check_merge, oracle_merge, kernels_merge,
                              work_merge),
    "merge_states": Spec(_merge_palette, lambda r, pal: gen_merge(r, pal, True),
                         build_merge, call_merge, check_merge, oracle_merge, kernels_merge,
                         work_merge),
    "paged_attention": Spec(_paged_palette, gen_paged, build_paged, call_paged, check_paged,
                            oracle_flash, kernels_paged, work_paged),
    "reshape_and_cache": Spec(lambda r: None, gen_reshape, build_reshape, call_reshape,
                              check_reshape, oracle_reshape, kernels_reshape, work_reshape),
    "paged_prefill": Spec(_prefill_palette, gen_prefill, build_prefill, call_prefill,
                          check_flash, oracle_flash, kernels_prefill, work_prefill),
    "flash_backward": Spec(_bwd_palette, gen_bwd, build_bwd, call_bwd, check_bwd, oracle_bwd,
                           kernels_bwd, work_bwd),
    "flash_varlen_backward": Spec(_bwd_palette, gen_bwd_varlen, build_bwd, call_bwd, check_bwd,
                                  oracle_bwd, kernels_bwd, work_bwd),
    "flash_with_kvcache": Spec(_kvcache_palette, gen_kvcache, build_kvcache, call_kvcache,
                               check_kvcache, oracle_kvcache, kernels_kvcache, work_kvcache),
}
# The functions that share a run's palette, and their kernel variants' budget.
_GROUP = {"flash_forward": "flash", "flash_varlen_forward": "flash",
          "flash_backward": "flash_bwd", "flash_varlen_backward": "flash_bwd"}


def _cases(fn, base, indices):
    spec = SPECS[fn]
    shared = next(f for f in FUNCS if _GROUP.get(f, f) == _GROUP.get(fn, fn))
    palette = spec.palette(_rng(base, shared, 0, 2))
    return [(i, spec.gen(_rng(base, fn, i, 0), palette)) for i in indices]


def _fuzz(fn):
    spec = SPECS[fn]
    base = _base_seed()
    print(f"\n[seed] {fn}: CUATTN_TEST_SEED={base}")
    only = os.environ.get("CUATTN_FUZZ_ONLY")
    cases = _cases(fn, base, [int(i) for i in only.split(",")] if only else range(N_CASES))
    t0 = time.perf_counter()
    _prebuild(spec, cases)
    t1 = time.perf_counter()
    failures, ran = [], 0
    for i, p in cases:
        ran += 1
        rng = _rng(base, fn, i, 1)
        try:
            c = spec.build(p, rng)
            spec.check(p, c, spec.call(p, c, rng))
        except Exception as e:           # noqa: BLE001 -- collected, reported at the end
            failures.append(f"case {i}: {p}\n    {type(e).__name__}: {str(e)[:300]}\n"
                            f"    replay: CUATTN_TEST_SEED={base} CUATTN_FUZZ_ONLY={i} "
                            f"python -m pytest -q -s 'tests/test_fuzz.py::test_fuzz[{fn}]'")
            if len(failures) >= MAX_FAILURES:
                break
    print(f"[fuzz] {fn}: {ran} cases run, {len(failures)} failures "
          f"(compile {t1 - t0:.1f} s, cases {time.perf_counter() - t1:.1f} s, seed {base})")
    if failures:
        stop = " (stopped early)" if ran < len(cases) else ""
        pytest.fail(f"{fn}: {len(failures)} of {ran} cases failed{stop}, seed {base}\n"
                    + "\n".join(failures), pytrace=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", FUNCS)
def test_fuzz(fn):
    _fuzz(fn)


# ---- CPU: the harness itself ----------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_case_space_stays_within_the_budgets(seed):
    """Kernel variants (compiles) and host seconds of the default N cases."""
    kernels = {g: set() for g in KERNEL_BUDGET}
    total = 0.0
    for fn in FUNCS:
        cases = _cases(fn, seed, range(DEFAULT_CASES))
        for _, p in cases:
            kernels[_GROUP.get(fn, fn)].update(SPECS[fn].kernels(p, "sm_90"))
        host = sum(SPECS[fn].work(p) for _, p in cases)
        total += host
        print(f"{fn}: ~{host:.1f} host s (budget {HOST_S_BUDGET[fn]})")
        assert host <= HOST_S_BUDGET[fn], (fn, host)
    assert total <= HOST_S_TOTAL, total
    for g, vs in kernels.items():
        print(f"{g}: {len(vs)} kernel variants (budget {KERNEL_BUDGET[g]})")
        assert len(vs) <= KERNEL_BUDGET[g], (g, sorted(v.name for v in vs))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_built_caches_have_the_library_layouts(seed):
    """Every (layout, cache kind) of the paged_prefill cases the seed draws (its first case
    of each) builds K and V caches of the shapes paged_kv_cache_shapes gives for the cache's
    element type (an fp8 cache of vLLM's layout was once built with the 16-bit x and refused
    by the library in every such case)."""
    first = {}
    for i, p in _cases("paged_prefill", seed, range(DEFAULT_CASES)):
        first.setdefault((p["layout"], p["cache"]), (i, p))
    for (layout, _), (i, p) in sorted(first.items()):
        c = SPECS["paged_prefill"].build(p, _rng(seed, "paged_prefill", i, 1))
        k, v = c["k_cache"], c["v_cache"]
        want = cuattn.paged_kv_cache_shapes(k.shape[0], p["nkv"], p["hs"], p["bs"], k.dtype,
                                            kv_layout=layout)
        assert (k.shape, v.shape) == tuple(want), (layout, p["cache"], k.shape, v.shape, want)


def test_cases_replay_alone():
    """A case's parameters depend on (seed, function, index) only, not on N or the others."""
    for fn in FUNCS:
        full = dict(_cases(fn, 7, range(40)))
        assert dict(_cases(fn, 7, [33, 5])) == {33: full[33], 5: full[5]}
        b1 = SPECS[fn].build(full[5], _rng(7, fn, 5, 1))
        b2 = SPECS[fn].build(full[5], _rng(7, fn, 5, 1))
        a = next(x for x in b1.values() if isinstance(x, np.ndarray) and x.size)
        b = next(x for x in b2.values() if isinstance(x, np.ndarray) and x.size)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


_REF_CASES = [(False, (-1, -1), 37, 91, 4, 2), (True, (-1, -1), 50, 20, 4, 1),
              (False, (3, 0), 17, 17, 2, 2), (False, (5, 2), 40, 9, 8, 1),
              (False, (-1, -1), 5, 0, 2, 1), (True, (4, -1), 0, 7, 2, 2)]


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_fast_flash_reference_matches_attention_ref(dt):
    """_attn_ref is test_flash.attention_ref (and its lowp form), vectorised differently."""
    rng = np.random.default_rng(0)
    for causal, window, sq, sk, h, hkv in _REF_CASES:
        q = rng.standard_normal((2, sq, h, 40)).astype(DT[dt])
        k, v = (rng.standard_normal((2, sk, hkv, 40)).astype(DT[dt]) for _ in "kv")
        ref, ref_lp, lse, _ = _attn_ref(q, k, v, causal, window, 0.2, dt)
        kw = dict(causal=causal, window=window, scale=0.2)
        want, want_lse = attention_ref(q, k, v, **kw)
        want_lp, _ = attention_ref(q, k, v, lowp=DT[dt], **kw)
        assert np.allclose(ref, want, atol=1e-12)
        assert np.allclose(lse, want_lse, atol=1e-12)          # (equal infinities match)
        assert np.allclose(ref_lp, want_lp, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("fn", FUNCS)
def test_harness_on_cpu_with_an_oracle(fn):
    """Generated cases build, their references pass for the reference rounded to the output
    dtype (the tolerance is attainable) and fail for a perturbed answer (the check bites)."""
    spec = SPECS[fn]
    bitten = 0
    t0 = time.perf_counter()
    for i, p in _cases(fn, 11, range(30)):
        c = spec.build(p, _rng(11, fn, i, 1))
        got = spec.oracle(p, c)
        spec.check(p, c, got)
        if fn == "reshape_and_cache":
            bad = dict(got, v=got["v"].copy())
            bad["v"].view(np.uint8).flat[0] ^= 1
            wrong = [bad]
        else:
            wrong = _wrong_answers(got)
            if not wrong:
                continue
        for bad in wrong:
            with pytest.raises(AssertionError):
                spec.check(p, c, bad)
        bitten += 1
    print(f"{fn}: 30 cases on the CPU in {time.perf_counter() - t0:.1f} s, {bitten} perturbed")
    assert bitten >= 10


# The kinds of options the hooked-cases test wants of a function besides the three hooks.
_MORE_KINDS = {"paged_attention": {"window", "nhd"}, "paged_prefill": {"nhd", "fp8"},
               "flash_backward": {"window", "causal", "deterministic"},
               "flash_varlen_backward": {"window", "causal", "deterministic"},
               "flash_with_kvcache": {"window", "causal", "dropped", "int_lens"}}


def _hook_kinds(fn, p):
    """The new options a case exercises."""
    kinds = {k for k in ("softcap", "alibi", "sinks") if p.get(k)}
    if fn == "paged_attention" and p["window"][0] >= 0:
        kinds.add("window")
    if _GROUP.get(fn) == "flash_bwd":
        kinds |= {k for k, on in (("window", p["window"] != (-1, -1)), ("causal", p["causal"]),
                                  ("deterministic", p["deterministic"])) if on}
    if p.get("layout") == "nhd":
        kinds.add("nhd")
    if fn == "paged_prefill" and p["cache"] != "same":
        kinds.add("fp8")
    if fn == "flash_with_kvcache":
        kinds |= {k for k, on in (("window", p["window"] != (-1, -1)), ("causal", p["causal"]),
                                  ("dropped", p["new"] and max(p["lens"]) + p["new"] >
                                   p["seqlen_cache"]), ("int_lens", p["int_lens"])) if on}
    return kinds


@pytest.mark.parametrize("fn", ["flash_forward", "flash_varlen_forward", "paged_attention",
                                "paged_prefill", "flash_backward", "flash_varlen_backward",
                                "flash_with_kvcache"])
def test_hooked_cases_on_cpu_with_an_oracle(fn):
    """The generic oracle test on cases that carry hooks (and, for paged_attention, windows
    and the NHD layout; for paged_prefill the NHD layout and fp8 caches; for the backward
    windows, causal and deterministic calls; for flash_with_kvcache windows, causal, new keys
    dropped past a row's end and an int cache_seqlens): every kind occurs in the default N
    cases, and the first cases of each kind pass for the rounded reference and fail for a
    perturbed one."""
    spec = SPECS[fn]
    cases = _cases(fn, 11, range(DEFAULT_CASES))
    want = {"softcap", "alibi", "sinks"} | _MORE_KINDS.get(fn, set())
    seen = {k: [] for k in want}
    for i, p in cases:
        for k in _hook_kinds(fn, p):
            seen[k].append(i)
    assert all(seen.values()), {k: len(v) for k, v in seen.items()}
    picked = sorted({i for v in seen.values() for i in v[:3]})
    by_index = dict(cases)
    bitten = 0
    for i in picked:
        p = by_index[i]
        c = spec.build(p, _rng(11, fn, i, 1))
        got = spec.oracle(p, c)
        spec.check(p, c, got)
        wrong = _wrong_answers(got, nonzero=True)
        for bad in wrong:
            with pytest.raises(AssertionError):
                spec.check(p, c, bad)
        bitten += bool(wrong)
    print(f"{fn}: {len(picked)} hooked cases, {bitten} perturbed; "
          f"{ {k: len(v) for k, v in seen.items()} } of {DEFAULT_CASES}")
    assert bitten >= len(picked) // 2


def test_fast_reference_with_hooks_matches_attention_reference():
    """_attn_ref with softcap / ALiBi / sinks equals tests/reference.py attention_reference
    (float64, one sequence and head at a time), rows that see no key included."""
    rng = np.random.default_rng(1)
    for causal, window, sq, sk, h, hkv in _REF_CASES + [(True, (0, 0), 9, 3, 4, 2)]:
        q = rng.standard_normal((2, sq, h, 40)).astype(DT["bf16"])
        k, v = (rng.standard_normal((2, sk, hkv, 40)).astype(DT["bf16"]) for _ in "kv")
        for softcap, alibi, sinks in ((1.5, None, None), (0.0, _slopes(rng, h), None),
                                      (0.0, None, _sinks(rng, h)),
                                      (7.0, _alibi_std(h), _sinks(rng, h))):
            ref, _, lse, cap = _attn_ref(q, k, v, causal, window, 0.3, "bf16", softcap, alibi,
                                         sinks)
            for b in range(2):
                want, want_lse = attention_reference(q[b], k[b], v[b], 0.3, causal=causal,
                                                     window=window, softcap=softcap,
                                                     alibi=alibi, sinks=sinks)
                assert np.allclose(ref[b], want, atol=1e-12)
                assert np.allclose(lse[b], want_lse, atol=1e-12)
            assert (cap > 0) == (softcap > 0 and sq * sk > 0) and cap <= softcap


def test_softcap_slack_covers_an_approximate_tanh():
    """A reference whose tanh is off by the kernels' relative error 2^-10.99 (each element the
    worse way, or at random) passes check_flash with the softcap slack; one off by 2^-5 (a
    wrong or much cruder tanh) fails it where the cap is not tiny."""
    rng = np.random.default_rng(2)
    for trial in range(16):
        dtype = ("f16", "bf16")[trial % 2]
        softcap = (0.5, 3.0, 20.0, 50.0)[trial // 4]
        sq, sk, h, hkv, d = 33, 200, 4, 2, 64
        q = (rng.standard_normal((1, sq, h, d)) * (1, 4)[trial // 2 % 2]).astype(DT[dtype])
        k, v = (rng.standard_normal((1, sk, hkv, d)).astype(DT[dtype]) for _ in "kv")
        p = dict(dtype=dtype, return_lse=True)
        ref, ref_lp, lse, cap = _attn_ref(q, k, v, True, (-1, -1), 0.5, dtype, softcap)
        c = dict(ref=ref, ref_lp=ref_lp, ref_lse=lse,
                 slack=_softcap_slack(softcap, cap, _v_max(v)))
        for err, sign in ((2.0 ** -10.99, 1.0), (2.0 ** -10.99, None), (2.0 ** -5, None)):
            if sign is None:
                sign = rng.choice([-1.0, 1.0], (1, h, sq, sk))
            approx, _, approx_lse, _ = _attn_ref(
                q, k, v, True, (-1, -1), 0.5, dtype, softcap,
                tanh=lambda x: np.tanh(x) * (1 + sign * err))      # noqa: B023
            got = dict(out=approx.astype(DT[dtype]), lse=approx_lse.astype(np.float32))
            if err < 2.0 ** -10:
                check_flash(p, c, got)
            elif softcap >= 3:
                with pytest.raises(AssertionError):
                    check_flash(p, c, got)


def test_softcap_grad_slack_covers_an_approximate_tanh():
    """The reference's gradients with a tanh off by the kernels' relative error 2^-10.99 (each
    element the worse way, or at random) stay within _softcap_grad_slack of the exact ones
    (GQA, sinks, ALiBi, a window, peaked scores), and pass check_bwd; with a tanh off by 2^-4
    (a wrong or much cruder one) check_bwd fails where the cap is not tiny. (A worst case over
    the errors' signs, the bound is 3 to 100 times the error of these trials: 2^-5 can pass
    at cap 20 in bf16, whose lowp reference already rounds the scores by 2^-9.)"""
    rng = np.random.default_rng(5)
    for trial in range(12):
        big = trial // 2 % 2 == 1
        p = dict(dtype=("f16", "bf16")[trial % 2], hd=64, hkv=2, gqa=2,
                 values="big" if big else "normal", scale=1.0 if big else None,
                 softcap=(0.5, 3.0, 20.0)[trial // 4], alibi=trial % 3 == 0, sinks=True,
                 causal=trial % 2 == 1, window=(40, 7) if trial % 3 == 1 else (-1, -1),
                 batch=1, sq=37, sk=90)
        c = build_bwd(p, rng)
        seq = [c[n][0] for n in ("q", "k", "v", "dout")]
        kw = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"],
                  alibi=c["alibi_slopes"], sinks=c["sinks"])
        for err, sign in ((_TANH_ERR, 1.0), (_TANH_ERR, -1.0), (_TANH_ERR, None),
                          (2.0 ** -4, None)):
            def tanh(x):
                return np.tanh(x) * (1 + err * (rng.choice([-1.0, 1.0], x.shape)   # noqa: B023
                                                if sign is None else sign))        # noqa: B023
            approx = attention_backward_reference(*seq, p["scale"] or 0.125, tanh=tanh, **kw)
            got = oracle_bwd(p, dict(c, ref=dict(zip(("dq", "dk", "dv", "dsinks"), approx))))
            if err < 2.0 ** -10:
                for name, a in zip(("dq", "dk", "dv", "dsinks"), approx):
                    assert np.abs(a - c["ref"][name]).max() <= c["slack"][0][name], (trial, name)
                check_bwd(p, c, got)
            elif p["softcap"] >= 3:
                with pytest.raises(AssertionError):
                    check_bwd(p, c, got)


def test_paged_cache_builder_and_gather():
    """_paged_cache writes each sequence's tokens where the documented layouts say (read
    back by _gather), shares the prefix blocks, and leaves NaN everywhere else: past each
    length, in the spare blocks, which the table entries past a sequence's blocks name.
    _cache_float dequantises fp8 exactly as test_paged._cache_values."""
    rng = np.random.default_rng(3)
    for layout, bs in (("vllm", 8), ("vllm", 32), ("nhd", 1), ("nhd", 16), ("nhd", 256)):
        ctx = [70, 64, 65, 300, 64]      # (the shared prefix: 64 tokens where bs <= 64)
        shared = 64 // bs if bs <= 64 else 0
        c = _paged_cache(rng, ctx, nkv=2, hs=80, bs=bs, dtype="bf16", layout=layout,
                         extra_table=2, shared=shared)
        ks, vs = c["tokens"]
        readable = np.zeros(c["k_cache"].shape[0], bool)
        for s, n in enumerate(ctx):
            k, v = _gather(c, layout, s)
            assert np.array_equal(k, ks[s].astype(np.float64))
            assert np.array_equal(v, vs[s].astype(np.float64))
            nb = -(-n // bs)
            assert np.isin(c["block_tables"][s, nb:], c["spare"]).all()
            assert (c["block_tables"][s, :shared] == c["block_tables"][0, :shared]).all()
            readable[c["block_tables"][s, :nb]] = True
            if n % bs:                   # the slots past the length in its last block
                last = c["block_tables"][s, nb - 1]
                tail = c["k_cache"][last, n % bs:] if layout == "nhd" else \
                    c["k_cache"][last, :, :, n % bs:]
                assert np.isnan(tail.astype(np.float32)).all()
        assert not readable[c["spare"]].any()
        for cache in (c["k_cache"], c["v_cache"]):
            assert np.isnan(cache[c["spare"]].astype(np.float32)).all()
            filled = np.isfinite(cache.astype(np.float32)).sum()
            assert filled == 2 * 80 * (sum(ctx) - (len(ctx) - 1) * shared * bs)
    b = rng.integers(0, 256, 4096).astype(np.uint8)
    for x in (b, b.view(E4M3)):
        got, want = _cache_float(x, 0.37), _cache_values(x, 0.37)
        assert np.array_equal(got, want, equal_nan=True)


def test_prefill_reference_agrees_with_test_prefill():
    """On test_prefill.make_batch's caches (its own writer), _gather + _attn_ref give what
    test_prefill.batch_reference (attention_reference over the tokens it wrote) gives."""
    from test_prefill import batch_reference, make_batch
    rng = np.random.default_rng(4)
    for layout, bs in (("vllm", 16), ("nhd", 4)):
        b = make_batch(rng, contexts=[40, 300, 16, 7], q_lens=[1, 30, 16, 0], nkv=2, group=4,
                       head_size=64, block_size=bs, dtype="bf16", layout=layout)
        slopes, sinks = _alibi_std(8), _sinks(rng, 8)
        hooks = dict(softcap=3.0, alibi=slopes, sinks=sinks)
        for causal, window in ((True, (-1, -1)), (False, (20, 3))):
            want, want_lse = batch_reference(b, 0.2, causal=causal, window=window, **hooks)
            cu = b["cu_seqlens_q"]
            for s in range(4):
                k, v = _gather(b, layout, s)
                ref, _, lse, _ = _attn_ref(b["q"][None, cu[s]:cu[s + 1]], k[None], v[None],
                                           causal, window, 0.2, "bf16", 3.0, slopes, sinks)
                assert np.allclose(ref[0], want[cu[s]:cu[s + 1]], atol=1e-12)
                assert np.allclose(lse[0], want_lse[:, cu[s]:cu[s + 1]], atol=1e-12)


# ---- CPU: flash_with_kvcache's cases and checks ----------------------------------------------

def _kvcache_kinds(p):
    """The edges a flash_with_kvcache case exercises."""
    sq, cap, new, lens = p["sq"], p["seqlen_cache"], p["new"], p["lens"]
    kinds = {"decode" if sq == 1 else "spec" if sq <= 16 else "prefill",
             "no_new" if not new else "new", "dropped" if new and max(lens) + new > cap else "",
             "more_q_than_keys" if sq > max(_kvcache_keys(p)) else "",
             "empty_row" if 0 in lens else "", "full_row" if cap in lens else "",
             "tiny_cache" if cap <= 16 else "", "long_cache" if cap >= 1000 else "",
             "int_lens" if p["int_lens"] else "device_lens",
             "no_batch_idx" if p["batch_idx"] is None else "batch_idx",
             "spare_rows" if p["batch_cache"] > p["batch"] else "",
             "causal" if p["causal"] else "", "window" if p["window"] != (-1, -1) else "",
             "unmasked" if not p["causal"] and p["window"] == (-1, -1) else "",
             "splits" if p["num_splits"] > 1 else "one_split" if p["num_splits"] == 1 else "auto",
             "lse" if p["return_lse"] else "", "out_" + p["out"],
             "q_strided" if p["q_strided"] else "", "cache_strided" if p["cache_strided"] else "",
             "new_strided" if p["new_strided"] and new else "",
             "hopper" if any(isinstance(v, FlashFwdSm90Variant)
                             for v in kernels_kvcache(p, "sm_90")) else "",
             "odd_head" if p["hs"] not in (64, 128) else "", "gqa" if p["gqa"] > 1 else "mha",
             "f16" if p["dtype"] == "f16" else "bf16"}
    return kinds - {""}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kvcache_cases_reach_the_edges(seed):
    """Every edge of the dense cache (decode / speculative / prefill queries and more queries
    than keys, no new keys and new keys dropped past a row's end, empty and full rows, tiny
    and long caches, cache_seqlens as an int, cache_batch_idx None and spare rows, every mask,
    split-KV, strided views, the Hopper kernel's reach on sm_90, both dtypes) occurs in the
    default N cases of a seed, each at least 5 times."""
    want = {"decode", "spec", "prefill", "more_q_than_keys", "no_new", "new", "dropped",
            "empty_row", "full_row", "tiny_cache", "long_cache", "int_lens", "device_lens",
            "no_batch_idx", "batch_idx", "spare_rows", "causal", "window", "unmasked",
            "splits", "one_split", "auto", "lse", "out_none", "out_contig", "out_strided",
            "q_strided", "cache_strided", "new_strided", "hopper", "odd_head", "gqa", "mha",
            "f16", "bf16"}
    seen = {k: 0 for k in want}
    for _, p in _cases("flash_with_kvcache", seed, range(DEFAULT_CASES)):
        assert 1 <= p["seqlen_cache"] and all(0 <= n <= p["seqlen_cache"] for n in p["lens"])
        assert p["hs"] % 8 == 0 and 8 <= p["hs"] <= 256 and p["batch_cache"] >= p["batch"]
        if p["batch_idx"] is not None:
            assert len(set(p["batch_idx"])) == p["batch"]
            assert all(0 <= r < p["batch_cache"] for r in p["batch_idx"])
        for k in _kvcache_kinds(p) & want:
            seen[k] += 1
    assert min(seen.values()) >= 5, seen


def test_kvcache_cache_check_bites():
    """check_kvcache compares the caches bit for bit: one bit flipped in an appended slot,
    in a slot left as it was, or in a NaN slot (another NaN) fails it."""
    rng = np.random.default_rng(6)
    fn, bitten = "flash_with_kvcache", 0
    for i, p in _cases(fn, 13, range(40)):
        if not p["new"]:
            continue
        c = SPECS[fn].build(p, _rng(13, fn, i, 1))
        got = SPECS[fn].oracle(p, c)
        check_kvcache(p, c, got)
        appended = c["k_after"].view(np.uint16) != c["k_cache"].view(np.uint16)
        nan = np.isnan(c["k_after"].astype(np.float32))
        kept = ~appended & ~nan
        for name in ("k_cache", "v_cache"):
            for where in (appended, kept, nan):
                if not where.any():
                    continue
                bad = dict(got, **{name: got[name].copy()})
                j = int(rng.choice(np.flatnonzero(where)))
                bad[name].view(np.uint16).flat[j] ^= np.uint16(1)
                with pytest.raises(AssertionError, match=name):
                    check_kvcache(p, c, bad)
                bitten += 1
    assert bitten >= 30


def test_kvcache_reference_agrees_with_test_kvcache():
    """build_kvcache's caches after the append and its out / lse equal test_kvcache.reference
    (attention_reference per entry over the row after its own append, the oracle of the
    GPU tests) on cases with dropped keys, empty rows, int lengths and hooks."""
    from test_kvcache import reference
    fn, checked = "flash_with_kvcache", 0
    for i, p in _cases(fn, 17, range(DEFAULT_CASES)):
        if p["sq"] * max(p["seqlen_cache"], 1) * p["nkv"] * p["gqa"] * p["batch"] > 3e5 or \
                not ({"dropped", "empty_row", "int_lens"} & _kvcache_kinds(p)):
            continue
        c = SPECS[fn].build(p, _rng(17, fn, i, 1))
        case = dict(q=c["q"], k_cache=c["k_cache"], v_cache=c["v_cache"], k=c["k"], v=c["v"],
                    cache_seqlens=c["cache_seqlens"], rows=c["batch_idx"])
        scale = p["scale"] or 1 / math.sqrt(p["hs"])
        out, lse, kc, vc = reference(
            case, scale, causal=p["causal"], window=p["window"], softcap=p["softcap"],
            alibi=c["alibi_slopes"], sinks=c["sinks"])
        assert np.array_equal(kc.view(np.uint16), c["k_after"].view(np.uint16)), i
        assert np.array_equal(vc.view(np.uint16), c["v_after"].view(np.uint16)), i
        assert np.allclose(c["ref"], out, atol=1e-10), i
        assert np.allclose(c["ref_lse"], lse, atol=1e-10), i
        checked += 1
        if checked == 12:
            break
    assert checked == 12
