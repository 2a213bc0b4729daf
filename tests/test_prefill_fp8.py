"""paged_prefill's FP8 math (issue 36): NHD fp8 caches on the Hopper kernel's e4m3 form, its
queries quantized from 16 bits with q_scale or given in e4m3 with q_descale.

GPU (marker ``gpu``, sm_90 devices): the accuracy rule of tests/test_flash_fp8.py (the
kernel's ||out - ref|| / ||ref|| against the float64 reference of the dequantized inputs
within 2x (+ 1e-3) that of tests/reference.py fp8_attention_kernel_math), per call over
every sequence; caches built by tests/test_prefill.make_batch (shuffled blocks, NaN in every
slot no sequence may read), outputs poisoned with NaN; scales as floats and as device arrays
(one, or per KV head), GQA, both head dims, sequences without new tokens, hooks, windows,
split-KV, out= in float16; the 16-bit call over the same cache without q_scale (widened,
16-bit math) beside it.
CPU (CI): the paged FP8 forms and the query quantizer compile for sm_90a without spills
(all forms under marker slow).
Run with: python -m pytest -q -m gpu tests/test_prefill_fp8.py
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuattn
from cuattn import tuning
from cuattn.constants import (FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, KV_PAGED_NHD, KV_PAGED_VLLM,
                              MASK_CAUSAL, MASK_NONE, MASK_WINDOW)
from tests.compiled import compile_reports, unclean
from tests.reference import (E4M3_MAX, attention_reference, fp8_attention_kernel_math,
                             quantize_e4m3)
from tests.test_flash_fp8 import ACC_BITS, _need_hopper, _rel
from tests.test_prefill import DTYPES, FP8, make_batch, on_device

HOOKS = FEAT_SOFTCAP | FEAT_ALIBI | FEAT_SINKS


# ---- CPU: compilation -------------------------------------------------------------------------

def _paged_fp8_forms(head_dims=(128, 256), hook_sets=(0, HOOKS)):
    return [tuning.flash_sm90_variant("e4m3", hd, mask=mask, split=split, features=f, tma=True,
                                      kv=KV_PAGED_NHD, out=out)
            for hd in head_dims for mask in (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
            for split in (False, True) for f in hook_sets for out in ("bf16", "f16")]


@pytest.mark.slow
def test_every_paged_fp8_form_compiles_for_sm90a_without_spills():
    assert unclean(compile_reports(_paged_fp8_forms(), "sm_90")) == []


def test_a_few_paged_fp8_forms_and_the_quantizer_compile_without_spills():
    forms = [f for f in _paged_fp8_forms() if f.out == "bf16" and
             (f.head_dim, f.mask, f.split, f.features) in
             ((128, MASK_CAUSAL, False, 0), (256, MASK_WINDOW, True, HOOKS))]
    assert len(forms) == 2
    forms += [tuning.quantize_variant(dt) for dt in ("f16", "bf16")]
    assert unclean(compile_reports(forms, "sm_90")) == []


def test_vllm_layout_has_no_fp8_form():
    with pytest.raises(ValueError, match="NHD"):
        tuning.flash_sm90_variant("e4m3", 128, mask=MASK_CAUSAL, split=False, tma=True,
                                  kv=KV_PAGED_VLLM, out="bf16")


# ---- GPU ----------------------------------------------------------------------------------------


def _scale_arg(value, nkv, per_head, on_device_):
    """A scale as paged_prefill takes it: a float, or a float32 device array (one value, or
    one per KV head)."""
    import cupy as cp
    if not on_device_:
        return float(value)
    return cp.asarray(np.full(nkv if per_head else 1, value, np.float32))


def _run(rng, *, contexts, q_lens, nkv=2, group=2, head_size=128, block_size=16,
         dtype="bf16", fp8_q=False, device_scales=False, per_head=False, causal=True,
         window=(-1, -1), softcap=0.0, alibi=False, sinks=False, num_splits=0,
         out_dtype=None):
    """One paged_prefill call on FP8 math, checked by the rule; returns (err, model err)."""
    import cupy as cp
    ks_, vs_, qs_ = 0.05, 0.04, 0.03          # cache scales (value = stored x scale), q's
    b = make_batch(rng, contexts=contexts, q_lens=q_lens, nkv=nkv, group=group,
                   head_size=head_size, block_size=block_size, dtype=dtype, layout="nhd",
                   fp8_scales=(ks_, vs_))
    b["q"] = (b["q"].astype(np.float32) * 3).astype(b["q"].dtype)
    nheads = nkv * group
    scale = 1.0 / math.sqrt(head_size)
    kw = dict(causal=causal, window_size=window, softcap=softcap, num_splits=num_splits,
              k_scale=_scale_arg(ks_, nkv, per_head, device_scales),
              v_scale=_scale_arg(vs_, nkv, per_head, device_scales))
    slopes = rng.uniform(0.01, 0.3, nheads).astype(np.float32) if alibi else None
    sink = rng.uniform(-1, 2, nheads).astype(np.float32) if sinks else None
    if alibi:
        kw["alibi_slopes"] = cp.asarray(slopes)
    if sinks:
        kw["sinks"] = cp.asarray(sink)
    q8 = quantize_e4m3(b["q"], qs_)               # what the kernel reads either way
    num_seqs = len(contexts)
    d = on_device(b, {})
    if fp8_q:
        d["q"] = cp.asarray(q8.view(np.uint8)).view(FP8)
        kw["q_descale"] = cp.full((num_seqs, nkv), qs_, np.float32)
    else:
        kw["q_scale"] = _scale_arg(qs_, nkv, per_head, device_scales)
    out_type = DTYPES[out_dtype or ("bf16" if fp8_q else dtype)]
    out = cp.full(b["q"].shape, np.nan, out_type)
    cp.cuda.Device().synchronize()
    res, lse = cuattn.paged_prefill(
        d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"],
        d["cu_seqlens_q"], b["max_seqlen_q"], kv_layout="nhd", return_lse=True, out=out, **kw)
    assert res is out and lse.shape == (nheads, b["q"].shape[0])
    got, got_lse = out.get().astype(np.float64), lse.get().astype(np.float64)

    # per sequence: the model of the kernel's roundings and the float64 reference
    hooks = dict(causal=causal, window=window, softcap=softcap, alibi=slopes, sinks=sink)
    cu = b["cu_seqlens_q"]
    models, model_lses, refs, ref_lses, floors = [], [], [], [], []
    for s, n in enumerate(contexts):
        rows = slice(cu[s], cu[s + 1])
        k8 = (b["ks"][s] / ks_).astype(FP8)[None]      # the cache's own bytes (exact)
        v8 = (b["vs"][s] / vs_).astype(FP8)[None]
        m, ml = fp8_attention_kernel_math(q8[rows][None], k8, v8, qs_, ks_, vs_, scale,
                                          **hooks)
        qr = q8[rows].astype(np.float64) * qs_
        r, rl = attention_reference(qr, b["ks"][s], b["vs"][s], scale, **hooks)
        models.append(m[0])
        model_lses.append(ml[0])
        refs.append(r)
        ref_lses.append(rl)
        kk = np.repeat(np.abs(b["ks"][s]), group, axis=1)          # (n, H, D)
        floors.append(scale * (np.abs(qr).transpose(1, 0, 2) @ kk.transpose(1, 2, 0))
                      .max(initial=0))
    model = np.concatenate(models).astype(out_type).astype(np.float64)
    ref = np.concatenate(refs)
    err, model_err = _rel(got, ref), _rel(model, ref)
    assert np.isfinite(got).all(), "a row was left unwritten or non-finite"
    assert err <= 2 * model_err + 1e-3, (err, model_err)
    ref_lse, model_lse = np.concatenate(ref_lses, axis=1), np.concatenate(model_lses, axis=1)
    seen = np.isfinite(ref_lse)
    assert (np.isfinite(got_lse) == seen).all()
    lse_floor = 2 * np.abs(model_lse - ref_lse)[seen].max(initial=0) + 1e-3 + \
        2.0 ** -ACC_BITS * max(floors, default=0)
    assert np.abs(got_lse - ref_lse)[seen].max(initial=0) <= lse_floor
    return err, model_err


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_q", [False, True], ids=["q_scale", "e4m3-q"])
@pytest.mark.parametrize("head_size,block_size", [(128, 16), (128, 64), (256, 16), (64, 8)])
def test_fp8_math_prefill(fp8_q, head_size, block_size):
    _need_hopper()
    rng = np.random.default_rng(head_size + block_size + fp8_q)
    _run(rng, contexts=[700, 37, 1000, 300, 5], q_lens=[300, 37, 1, 0, 5], head_size=head_size,
         block_size=block_size, fp8_q=fp8_q)


@pytest.mark.gpu
@pytest.mark.parametrize("per_head", [False, True], ids=["one", "per-kv-head"])
def test_fp8_math_device_scales(per_head):
    _need_hopper()
    _run(np.random.default_rng(1), contexts=[513, 200], q_lens=[129, 200], nkv=4, group=1,
         device_scales=True, per_head=per_head)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(softcap=5.0), dict(alibi=True), dict(sinks=True), dict(window=(100, 0)),
    dict(causal=False), dict(num_splits=3), dict(alibi=True, sinks=True, softcap=5.0,
                                                 num_splits=2),
    dict(dtype="f16"), dict(fp8_q=True, out_dtype="f16"), dict(group=8, nkv=1)],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_fp8_math_features(case):
    _need_hopper()
    _run(np.random.default_rng(7), contexts=[900, 64, 260], q_lens=[260, 64, 3], **case)


@pytest.mark.gpu
def test_without_q_scale_the_fp8_cache_runs_16_bit_math():
    """No q_scale: the cache is widened to 16 bits (the mma.sync kernel), q unrounded: its
    error against the float64 reference is far below FP8 math's."""
    import cupy as cp
    _need_hopper()
    rng = np.random.default_rng(3)
    b = make_batch(rng, contexts=[400, 90], q_lens=[128, 90], nkv=2, group=2, head_size=128,
                   block_size=16, dtype="bf16", layout="nhd", fp8_scales=(0.05, 0.04))
    d = on_device(b, {})
    cp.cuda.Device().synchronize()
    res = cuattn.paged_prefill(d["q"], d["k_cache"], d["v_cache"], d["block_tables"],
                               d["seq_lens"], d["cu_seqlens_q"], b["max_seqlen_q"],
                               kv_layout="nhd", k_scale=0.05, v_scale=0.04)
    cu = b["cu_seqlens_q"]
    ref = np.concatenate([attention_reference(b["q"][cu[s]:cu[s + 1]].astype(np.float64),
                                              b["ks"][s], b["vs"][s], 1 / math.sqrt(128),
                                              causal=True)[0] for s in range(2)])
    assert _rel(res.get().astype(np.float64), ref) < 1e-2


def test_e4m3_max_matches_the_format():
    assert E4M3_MAX == float(np.finfo(FP8).max)
