"""FP8 flash_forward / flash_varlen_forward (issue 36): the Hopper kernel's e4m3 form.

CPU (CI): every FP8 form (head dims 128 / 256 x mask x split x hooks) compiles for sm_90a
with no spills (marker slow; the default run compiles a few).
GPU (marker ``gpu``, sm_90 devices): the accuracy rule of the issue, against a float64
reference over the dequantized inputs: ||out - ref|| / ||ref|| within 2x (+ 1e-3) that of
the same math done in NumPy with the kernel's roundings (tests/reference.py
fp8_attention_kernel_math: e4m3 inputs, P = 256 exp(S - m) rounded to e4m3, fp32
accumulation), lse likewise; outputs poisoned with NaN first; every feature, GQA, varlen
with empty sequences, descale shapes, outlier channels, graph replay, bad inputs, and a fuzz.
Run with: python -m pytest -q -m gpu tests/test_flash_fp8.py
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import tuning
from cuattn.keys import FlashFwdSm90Variant
from cuattn.constants import (FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, MASK_CAUSAL, MASK_NONE,
                              MASK_WINDOW)
from tests.compiled import compile_reports, unclean
from tests.reference import (attention_reference, fp8_attention_kernel_math, fp8_dequantized,
                             quantize_e4m3, tolerance)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
HOOKS = FEAT_SOFTCAP | FEAT_ALIBI | FEAT_SINKS


# ---- CPU: compilation -------------------------------------------------------------------------

def _fp8_forms(head_dims, hook_sets=(0, FEAT_SOFTCAP, FEAT_ALIBI, FEAT_SINKS, HOOKS)):
    return [tuning.flash_sm90_variant("e4m3", hd, mask=mask, split=split, features=f, tma=True,
                                      out=out)
            for hd in head_dims for mask in (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
            for split in (False, True) for f in hook_sets for out in ("bf16",)]


def _check_clean(variants):
    reports = compile_reports(variants, "sm_90")
    assert unclean(reports) == []
    assert [v.name for v, r in reports if r.registers != 65536 // v.num_threads // 8 * 8] == []


@pytest.mark.slow
def test_every_fp8_form_compiles_for_sm90a_without_spills():
    forms = _fp8_forms(sorted(tuning.FLASH_SM90_TILES_FP8))
    forms.append(tuning.flash_sm90_variant("e4m3", 128, mask=MASK_CAUSAL, split=False, tma=True,
                                           out="f16"))
    _check_clean(forms)


def test_a_few_fp8_forms_compile_for_sm90a_without_spills():
    """The plain form at hd128 and the split window form with every hook at hd256."""
    forms = [f for f in _fp8_forms((128, 256), (0, HOOKS))
             if (f.head_dim, f.mask, f.split, f.features) in
             ((128, MASK_NONE, False, 0), (256, MASK_WINDOW, True, HOOKS))]
    assert len(forms) == 2
    _check_clean(forms)


def test_fp8_tiles_fit_and_the_head_dim_rule():
    for hd in (16, 64, 128, 200, 256):
        v = tuning.flash_sm90_variant("e4m3", hd, mask=MASK_CAUSAL, split=False, tma=True,
                                      out="bf16")
        assert v.head_dim == (128 if hd <= 128 else 256)
        assert v.dynamic_smem_bytes <= 227 * 1024
    with pytest.raises(ValueError, match="e4m3"):
        FlashFwdSm90Variant("e4m3", 128, 128, 128, 2, MASK_NONE, False, 0,
                                            False, 0, "bf16")   # cp.async


# ---- GPU ----------------------------------------------------------------------------------------

def _need_hopper():
    from cuattn.jit import device_info
    if device_info(0).arch != tuning.SM90_ARCH:
        pytest.skip("the FP8 form runs on sm_90 devices")


def _quantize(x, per_head: bool, nkv: int):
    """x (batch, s, H, D) float -> (e4m3, descale (batch, nkv) float32 or None): per-head
    descales from each (batch, KV head)'s amax (q's over its query heads)."""
    if not per_head:
        return quantize_e4m3(x, 1.0), None
    b, s, h, d = x.shape
    amax = np.abs(x.reshape(b, s, nkv, h // nkv, d)).max(axis=(1, 3, 4))
    descale = np.maximum(amax / 448.0, 1e-8).astype(np.float32)         # (b, nkv)
    full = np.repeat(descale, h // nkv, axis=1)[:, None, :, None]
    return quantize_e4m3(x, full), descale


def _to_device(x8, as_uint8=False):
    import cupy as cp
    d = cp.asarray(x8.view(np.uint8))
    return d if as_uint8 else d.view(E4M3)


ACC_BITS = 9      # MEASURED (H200, device call A): lse errors up to 2^-10.3 of the sum below


def _abs_score_sum(q, k, scale):
    """The largest sum over keys of |q_i k_i| x scale of any (row, key) pair: the magnitude
    the FP8 GEMM's accumulation error scales with. q (batch, sq, H, D), k (batch, sk, Hkv, D)
    (dequantized, float64)."""
    group = q.shape[2] // k.shape[2]
    kk = np.repeat(np.abs(k), group, axis=2)
    return scale * (np.abs(q).transpose(0, 2, 1, 3) @ kk.transpose(0, 2, 3, 1)).max(initial=0)


def _rel(a, b):
    ref = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (ref if ref > 0 else 1.0)


def _case(rng, *, batch=2, sq=128, sk=128, nheads=4, nkv=2, d=128, causal=False,
          window=(-1, -1), softcap=0.0, alibi=False, sinks=False, per_head=True,
          num_splits=1, outlier=False, out_dtype=None, lse=True, as_uint8=False):
    """One fixed-length call checked by the rule; returns the errors (kernel, model)."""
    import cupy as cp
    q = rng.standard_normal((batch, sq, nheads, d)).astype(np.float32)
    k = rng.standard_normal((batch, sk, nkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, sk, nkv, d)).astype(np.float32)
    if outlier:     # a few channels of K 30x larger (FlashAttention-3 section 3.3)
        k[..., rng.choice(d, 4, replace=False)] *= 30.0
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(x, per_head, nkv) for x in (q, k, v))
    scale = 1.0 / math.sqrt(d)
    slopes = (rng.uniform(0.01, 0.3, nheads).astype(np.float32) if alibi else None)
    sink = (rng.uniform(-1, 2, nheads).astype(np.float32) if sinks else None)
    ones = np.ones((batch, nkv), np.float32)
    model, model_lse = fp8_attention_kernel_math(
        q8, k8, v8, ones if qd is None else qd, ones if kd is None else kd,
        ones if vd is None else vd, scale, causal=causal, window=window, softcap=softcap,
        alibi=slopes, sinks=sink)
    qr, kr, vr = (fp8_dequantized(x8, ones if ds is None else ds)
                  for x8, ds in ((q8, qd), (k8, kd), (v8, vd)))
    ref = np.zeros(qr.shape)
    ref_lse = np.zeros((batch, nheads, sq))
    for b in range(batch):
        ref[b], ref_lse[b] = attention_reference(qr[b], kr[b], vr[b], scale, causal=causal,
                                                 window=window, softcap=softcap, alibi=slopes,
                                                 sinks=sink)
    dev = lambda x: None if x is None else cp.asarray(x)     # noqa: E731
    odt = np.dtype(out_dtype) if out_dtype is not None else BF16
    model = model.astype(odt)                  # the kernel's last rounding: O to out's dtype
    out = cp.full(q.shape, np.nan, dtype=odt)
    got = cuattn.flash_forward(
        _to_device(q8, as_uint8), _to_device(k8, as_uint8), _to_device(v8, as_uint8),
        causal=causal, window_size=window, softcap=softcap, alibi_slopes=dev(slopes),
        sinks=dev(sink), q_descale=dev(qd), k_descale=dev(kd), v_descale=dev(vd),
        num_splits=num_splits, return_lse=lse, out_dtype=out_dtype, out=out)
    o, l = got if lse else (got, None)
    assert o is out
    o = o.get().astype(np.float64)
    assert np.isfinite(o).all(), "NaN/inf in out (unwritten, or a NaN slot was read)"
    err, model_err = _rel(o, ref), _rel(model.astype(np.float64), ref)
    assert err <= tolerance(model_err, 1e-3), (err, model_err)
    if l is not None:
        got_lse = l.get().astype(np.float64)
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        # lse is the scores' log-sum-exp, and the e4m3 GEMM's scores are not fp32-exact:
        # Hopper's FP8 tensor cores keep fewer accumulator bits (bench/NOTES.md, "FP8
        # forward"), an error that grows with the sum of |q_i k_i| of a row, which the model
        # (fp32) does not have: it joins the floor at ACC_BITS bits of that sum.
        lse_tol = tolerance(np.abs(model_lse[fin] - ref_lse[fin]).max(initial=0),
                            1e-3 + 2.0 ** -ACC_BITS * _abs_score_sum(qr, kr, scale))
        assert np.abs(got_lse[fin] - ref_lse[fin]).max(initial=0) <= lse_tol
    return err, model_err


_FEATURES = {
    "plain": {}, "causal": dict(causal=True), "window": dict(window=(40, 8)),
    "softcap": dict(softcap=20.0, causal=True), "alibi": dict(alibi=True),
    "sinks": dict(sinks=True, causal=True), "all": dict(softcap=30.0, alibi=True, sinks=True,
                                                        window=(64, 0)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("feature", sorted(_FEATURES))
def test_fp8_features(rng, d, feature):
    _need_hopper()
    _case(rng, d=d, sq=200, sk=328, **_FEATURES[feature])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 77, 300, 8, 1), (1, 513, 513, 6, 3),
                                   (3, 256, 64, 4, 4), (1, 16, 1000, 2, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_shapes_and_gqa(rng, shape, causal):
    _need_hopper()
    batch, sq, sk, h, hkv = shape
    _case(rng, batch=batch, sq=sq, sk=sk, nheads=h, nkv=hkv, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 128, 192, 256])
def test_fp8_head_dims_and_split(rng, d):
    _need_hopper()
    _case(rng, d=d, sq=64, sk=1024, num_splits=3, causal=True)
    _case(rng, d=d, sq=64, sk=1024, num_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_descales_and_outliers(rng, per_head):
    _need_hopper()
    _case(rng, per_head=per_head, sq=256, sk=512)
    _case(rng, per_head=per_head, sq=256, sk=512, outlier=True, causal=True)


@pytest.mark.gpu
def test_fp8_out_dtype_and_byte_inputs(rng):
    _need_hopper()
    _case(rng, out_dtype=np.float16, lse=False)
    _case(rng, as_uint8=True, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_with_empty_sequences(rng, causal):
    _need_hopper()
    import cupy as cp
    lens_q, lens_k = [0, 130, 1, 257, 0, 64], [5, 200, 0, 257, 0, 300]
    h, hkv, d = 4, 2, 128
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q = rng.standard_normal((cu_q[-1], h, d)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(np.float32)
    nb = len(lens_q)
    descale = [rng.uniform(0.5, 2.0, (nb, hkv)).astype(np.float32) for _ in range(3)]
    # each sequence quantized with its own descale
    q8, k8, v8 = (np.zeros(x.shape, E4M3) for x in (q, k, v))
    for b in range(nb):
        for x, x8, cu, ds in ((q, q8, cu_q, descale[0]), (k, k8, cu_k, descale[1]),
                              (v, v8, cu_k, descale[2])):
            rows = slice(cu[b], cu[b + 1])
            full = np.repeat(ds[b], x.shape[1] // hkv)[None, :, None]
            x8[rows] = quantize_e4m3(x[rows], full)
    scale = 1.0 / math.sqrt(d)
    out = cp.full(q.shape, np.nan, BF16)
    got, lse = cuattn.flash_varlen_forward(
        _to_device(q8), _to_device(k8), _to_device(v8), cp.asarray(cu_q, np.int32),
        cp.asarray(cu_k, np.int32), max(lens_q), max(lens_k), causal=causal,
        q_descale=cp.asarray(descale[0]), k_descale=cp.asarray(descale[1]),
        v_descale=cp.asarray(descale[2]), return_lse=True, out=out)
    got, lse = got.get().astype(np.float64), lse.get()
    for b in range(nb):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        ds = [x[b:b + 1] for x in descale]
        sub = [x[None, r] for x, r in ((q8, rq), (k8, rk), (v8, rk))]
        model, _ = fp8_attention_kernel_math(*sub, *ds, scale, causal=causal)
        deq = [fp8_dequantized(x, s)[0] for x, s in zip(sub, ds)]
        ref, ref_lse = attention_reference(*deq, scale, causal=causal)
        assert np.isfinite(got[rq]).all(), b
        err, model_err = _rel(got[rq], ref), _rel(model[0].astype(BF16).astype(np.float64), ref)
        assert err <= tolerance(model_err, 1e-3), (b, err, model_err)
        assert np.array_equal(np.isneginf(lse[:, rq]), np.isneginf(ref_lse)), b


@pytest.mark.gpu
def test_fp8_graph_replay_equals_eager(rng):
    _need_hopper()
    import cupy as cp
    q8, k8, v8 = (quantize_e4m3(rng.standard_normal((2, 300, 4, 128)), 1.0) for _ in range(3))
    q, k, v = (_to_device(x) for x in (q8, k8, v8))
    ds = cp.asarray(rng.uniform(0.5, 2, (2, 4)).astype(np.float32))
    eager = cuattn.flash_forward(q, k, v, causal=True, q_descale=ds, v_descale=ds)
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.empty_like(eager)
    cp.cuda.Device().synchronize()
    with stream:
        cuattn.flash_forward(q, k, v, causal=True, q_descale=ds, v_descale=ds, out=out)  # warm
        stream.begin_capture()
        cuattn.flash_forward(q, k, v, causal=True, q_descale=ds, v_descale=ds, out=out)
        graph = stream.end_capture()
        out.fill(0)
        graph.launch()
    stream.synchronize()
    assert cp.array_equal(out.view(cp.uint16), eager.view(cp.uint16))


@pytest.mark.gpu
def test_fp8_bad_inputs(rng):
    _need_hopper()
    import cupy as cp
    q = _to_device(quantize_e4m3(rng.standard_normal((1, 64, 4, 128)), 1.0))
    k = _to_device(quantize_e4m3(rng.standard_normal((1, 64, 2, 128)), 1.0))
    k16 = cp.zeros((1, 64, 2, 128), BF16)
    ok = cp.ones((1, 2), cp.float32)
    with pytest.raises(TypeError, match="^k: .*no mixing"):
        cuattn.flash_forward(q, k16, k)
    with pytest.raises(TypeError, match="^q: "):
        cuattn.flash_forward(k16.astype(cp.float32), k16, k16)
    with pytest.raises(ValueError, match="^q_descale: "):
        cuattn.flash_forward(k16, k16, k16, q_descale=ok)
    with pytest.raises(ValueError, match="^k_descale: "):
        cuattn.flash_forward(q, k, k, k_descale=cp.ones((1, 4), cp.float32))
    with pytest.raises(TypeError, match="^v_descale: "):
        cuattn.flash_forward(q, k, k, v_descale=cp.ones((1, 2), cp.float64))
    with pytest.raises(ValueError, match="^out_dtype: "):
        cuattn.flash_forward(q, k, k, out_dtype=E4M3)
    with pytest.raises(ValueError, match="^out_dtype: "):
        cuattn.flash_forward(k16, k16, k16, out_dtype=np.float16)
    with pytest.raises(TypeError, match="^out: "):
        cuattn.flash_forward(q, k, k, out=cp.zeros((1, 64, 4, 128), np.float16))
    with pytest.raises(ValueError, match="^q: head dim"):
        cuattn.flash_forward(q[..., :120], k[..., :120], k[..., :120])
    with pytest.raises(ValueError, match="^k: .*TMA"):
        cuattn.flash_forward(q, cp.broadcast_to(k[:, :, :1], k.shape), k)


@pytest.mark.gpu
def test_fp8_fuzz(rng):
    """300 random small calls by the rule (shapes, GQA, masks, hooks, splits, descales)."""
    _need_hopper()
    failures = []
    for i in range(300):
        hkv = int(rng.choice([1, 2]))
        kw = dict(batch=int(rng.integers(1, 3)), sq=int(rng.integers(1, 300)),
                  sk=int(rng.integers(1, 400)), nkv=hkv, nheads=hkv * int(rng.choice([1, 3])),
                  d=int(rng.choice([16, 64, 112, 128, 160, 256])),
                  causal=bool(rng.random() < 0.4), per_head=bool(rng.random() < 0.7),
                  num_splits=int(rng.choice([0, 1, 2])), lse=bool(rng.random() < 0.5))
        if rng.random() < 0.2:
            kw["window"] = (int(rng.integers(0, 200)), int(rng.integers(0, 50)))
        if rng.random() < 0.2:
            kw["softcap"] = float(rng.uniform(5, 50))
        kw["alibi"] = bool(rng.random() < 0.15)
        kw["sinks"] = bool(rng.random() < 0.15)
        try:
            _case(rng, **kw)
        except AssertionError as e:
            failures.append((i, kw, str(e)[:200]))
    assert failures == [], failures[:5]
