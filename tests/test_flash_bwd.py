"""flash_backward / flash_varlen_backward.

CPU (CI): the float64 reference of the gradients against finite differences of the forward
reference (every option); the backward's forms compile for sm_90 / sm_80 / sm_86 within
255 registers and each family's shared memory; names and the tiling rule.
GPU (marker ``gpu``): gradients of every feature, alone and combined, against the float64
reference with FlashAttention's rule (each of dq, dk, dv within 3x the error of the same math
with every intermediate rounded to the input dtype, plus a small floor), outputs poisoned
with NaN; varlen with empty and one-token sequences; rows that see no key; deterministic
mode bit-identical over 20 runs; CUDA-graph replay equal to eager. Bad inputs:
tests/test_bad_inputs.py. Run the GPU part with: python -m pytest -q -m gpu tests/test_flash_bwd.py
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import tuning, tuning_bwd
from cuattn.constants import FEAT_ALIBI, FEAT_SOFTCAP, MASK_CAUSAL, MASK_NONE, MASK_WINDOW
from cuattn.keys import FlashBwdSm90Variant, FlashBwdVariant
from tests.compiled import compile_reports, unclean
from tests.reference import attention_backward_reference, attention_reference, grad_tolerance

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_90": 227 * 1024}


# ---- CPU: the reference ---------------------------------------------------------------------

@pytest.mark.parametrize("opts", [
    dict(), dict(causal=True), dict(window=(2, 1)), dict(softcap=1.5), dict(alibi=True),
    dict(sinks=True), dict(causal=True, softcap=2.0, alibi=True, sinks=True)],
    ids=["plain", "causal", "window", "softcap", "alibi", "sinks", "all"])
def test_reference_gradients_match_finite_differences(opts):
    """The float64 backward reference is the derivative of the forward reference: central
    differences of L = sum(out * dout) (+ nothing for lse) on a tiny GQA shape."""
    rng = np.random.default_rng(0)
    sq, sk, h, hkv, d = 3, 5, 4, 2, 4
    q, dout = rng.standard_normal((2, sq, h, d))
    k, v = rng.standard_normal((2, sk, hkv, d))
    scale = 0.7
    alibi = rng.uniform(0.1, 0.5, h) if opts.get("alibi") else None
    sinks = rng.standard_normal(h) if opts.get("sinks") else None
    kw = dict(causal=opts.get("causal", False), window=opts.get("window", (-1, -1)),
              softcap=opts.get("softcap", 0.0), alibi=alibi)

    def loss(q_, k_, v_, sinks_):
        out, _ = attention_reference(q_, k_, v_, scale, sinks=sinks_, **kw)
        return float((out * dout).sum())

    dq, dk, dv, dsinks = attention_backward_reference(q, k, v, dout, scale, sinks=sinks, **kw)
    eps = 1e-6
    for name, x, grad in (("q", q, dq), ("k", k, dk), ("v", v, dv)) + \
            ((("sinks", sinks, dsinks),) if sinks is not None else ()):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = {"q": q, "k": k, "v": v, "sinks": sinks}
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            num[idx] = (loss(**{**_as_call(args), _arg(name): xp}) -
                        loss(**{**_as_call(args), _arg(name): xm})) / (2 * eps)
        assert np.allclose(num, grad, atol=1e-6, rtol=1e-5), (name, np.abs(num - grad).max())


def _arg(name):
    return {"q": "q_", "k": "k_", "v": "v_", "sinks": "sinks_"}[name]


def _as_call(args):
    return {_arg(n): x for n, x in args.items()}


# ---- the two kernels of sm_90 ------------------------------------------------------------------
# Every GPU test below runs on both main kernels of an sm_90 device, the Hopper one ("wgmma")
# and mma.sync's ("mma"), forced by tuning.override(flash_path=...) (which the forward that
# makes out and lse follows too); other devices run theirs ("mma") once.

def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("gpu") is not None:
        metafunc.parametrize("bwd_path", ["wgmma", "mma"], indirect=True)


@pytest.fixture(autouse=True)
def bwd_path(request):
    path = getattr(request, "param", None)
    if path is None:
        yield None
        return
    from cuattn.jit import arch_of_device
    arch = arch_of_device(0)
    if path == "wgmma" and arch != "sm_90":
        pytest.skip(f"the Hopper backward runs on sm_90 only, this device is {arch}")
    with tuning.override(flash_path=path if arch == "sm_90" else "mma"):
        yield path


# ---- CPU: compilation -----------------------------------------------------------------------

_HEAD_DIMS = tuning_bwd.BWD_HEAD_DIMS


def _forms(arch):
    """The mma.sync kernel's forms (on sm_90 too: forced)."""
    with tuning.override(flash_path="mma"):
        return [tuning_bwd.flash_bwd_variant(dt, hd, mask=mask, arch=arch, features=f)
                for hd in _HEAD_DIMS for mask in (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
                for f in (0, FEAT_SOFTCAP | FEAT_ALIBI) for dt in ("bf16",)]


# The Hopper kernel's head dims that tuning_bwd.flash_bwd_path picks it for.
_SM90_HEAD_DIMS = tuning_bwd.FLASH_BWD_SM90_DEFAULT


def _sm90_forms(head_dims=_SM90_HEAD_DIMS, dtypes=("bf16",)):
    return [tuning_bwd.flash_bwd_variant(dt, hd, mask=mask, arch="sm_90", features=f)
            for hd in head_dims for mask in (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
            for f in (0, FEAT_SOFTCAP | FEAT_ALIBI) for dt in dtypes]


@pytest.mark.parametrize("arch", sorted(SMEM_LIMIT))
def test_backward_tiles_fit_each_family(arch):
    for v in _forms(arch):
        assert v.dynamic_smem_bytes <= SMEM_LIMIT[arch], (arch, v.name)
        assert v.block_m % v.q_chunk == 0 and v.num_threads <= 256
    if arch == "sm_90":
        with tuning.override(flash_path="wgmma"):
            forms = _sm90_forms(sorted(tuning_bwd.FLASH_BWD_SM90_TILES))
        for v in forms:
            assert isinstance(v, FlashBwdSm90Variant), v.name
            assert v.dynamic_smem_bytes <= SMEM_LIMIT[arch], v.name


def _within_bounds(forms, arch):
    return unclean(compile_reports(forms, arch))


@pytest.mark.slow
def test_backward_forms_compile_for_sm90():
    """Every head dim x mask x hooks form of sm_90, of both kernels, compiles within 255
    registers and no more spill than the kernel's spill_bound bytes (a few loop-invariant
    values)."""
    assert _within_bounds(_forms("sm_90") + _sm90_forms(dtypes=("bf16", "f16")), "sm_90") == []


def test_a_few_backward_forms_compile_for_sm90():
    """The default tier's sample of the sweep above: of mma.sync's kernel the lightest form,
    the heaviest one-pass form (hd128 window with both hooks) and the heaviest two-pass one
    (hd256); of the Hopper kernel the lightest and the heaviest."""
    with tuning.override(flash_path="mma"):
        forms = [tuning_bwd.flash_bwd_variant("bf16", 32, mask=MASK_NONE, arch="sm_90"),
                 tuning_bwd.flash_bwd_variant("bf16", 128, mask=MASK_WINDOW, arch="sm_90",
                                              features=FEAT_SOFTCAP | FEAT_ALIBI),
                 tuning_bwd.flash_bwd_variant("f16", 256, mask=MASK_CAUSAL, arch="sm_90",
                                              features=FEAT_SOFTCAP)]
    # the Hopper kernel: its lightest and heaviest forms
    forms += [tuning_bwd.flash_bwd_variant("bf16", 64, mask=MASK_NONE, arch="sm_90"),
              tuning_bwd.flash_bwd_variant("f16", 128, mask=MASK_WINDOW, arch="sm_90",
                                           features=FEAT_SOFTCAP | FEAT_ALIBI)]
    assert all(isinstance(v, FlashBwdSm90Variant) for v in forms[-2:])
    assert _within_bounds(forms, "sm_90") == []


def test_backward_row_kernels_and_older_archs_compile():
    rows = tuning_bwd.flash_bwd_row_variants("f16", 256)
    vs = list(rows) + [tuning_bwd.flash_bwd_variant("f16", 64, mask=MASK_CAUSAL, arch="sm_86"),
                       tuning_bwd.flash_bwd_variant("bf16", 128, mask=MASK_NONE, arch="sm_80")]
    for arch in ("sm_80", "sm_86"):
        assert _within_bounds(vs, arch) == [], arch


def test_backward_names_and_knobs():
    v = FlashBwdVariant("bf16", 128, 64, 8, 16, MASK_CAUSAL, FEAT_SOFTCAP)
    assert v.name == "cuattn_flash_bwd__bf16_hd128_bm64_w8_qc16_c1_cap"
    assert v.block_n == 128 and v.num_threads == 256
    for bad in (dict(q_chunk=24), dict(block_m=48), dict(num_warps=6), dict(features=4)):
        args = dict(dtype="bf16", head_dim=128, block_m=64, num_warps=8, q_chunk=16,
                    mask=MASK_NONE, features=0) | bad
        with pytest.raises(ValueError):
            FlashBwdVariant(**args)
    forced = tuning_bwd.FlashBwdTiles(32, 4, 32)
    with tuning.override(flash_bwd_tiles=forced):
        v = tuning_bwd.flash_bwd_variant("bf16", 64, mask=MASK_NONE, arch="sm_90")
        assert (v.block_m, v.num_warps, v.q_chunk) == (32, 4, 32)


def test_hopper_backward_names_knobs_and_path():
    v = FlashBwdSm90Variant("bf16", 128, 64, 2, MASK_CAUSAL, FEAT_SOFTCAP)
    assert v.name == "cuattn_flash_bwd_sm90__bf16_hd128_bm64_wg2_c1_cap"
    assert v.block_n == 128 and v.num_threads == 384 and v.target_arch("sm_90") == "sm_90a"
    assert v.runs_on("sm_90") and not v.runs_on("sm_80")
    for bad in (dict(head_dim=96), dict(block_m=96), dict(num_wg=3, block_m=128),
                dict(head_dim=64, block_m=64), dict(features=4)):
        args = dict(dtype="bf16", head_dim=128, block_m=64, num_wg=2, mask=MASK_NONE,
                    features=0) | bad
        with pytest.raises(ValueError):
            FlashBwdSm90Variant(**args)
    # the path: the forward's rule, at the head dims of FLASH_BWD_SM90_DEFAULT
    assert tuning_bwd.flash_bwd_path("sm_90", 128) == "wgmma"
    assert tuning_bwd.flash_bwd_path("sm_90", 40) == "wgmma"      # compiled as 64
    assert tuning_bwd.flash_bwd_path("sm_90", 32) == "mma"
    assert tuning_bwd.flash_bwd_path("sm_90", 256) == "wgmma"
    assert tuning_bwd.flash_bwd_path("sm_90", 160) == "wgmma"     # compiled as 192
    assert tuning_bwd.flash_bwd_path("sm_80", 128) == "mma"
    v = tuning_bwd.flash_bwd_variant("bf16", 80, mask=MASK_NONE, arch="sm_90")
    assert isinstance(v, FlashBwdSm90Variant) and v.head_dim == 128
    with tuning.override(flash_path="wgmma"):
        assert tuning_bwd.flash_bwd_path("sm_90", 256) == "wgmma"
        assert tuning_bwd.flash_bwd_path("sm_90", 32) == "wgmma"
    with tuning.override(flash_path="mma"):
        assert tuning_bwd.flash_bwd_path("sm_90", 128) == "mma"
    with tuning.override(flash_bwd_tiles=tuning_bwd.FlashBwdTiles(64, 8, 32)):
        assert tuning_bwd.flash_bwd_path("sm_90", 128) == "mma"
    with tuning.override(flash_bwd_sm90_tiles=tuning_bwd.FlashBwdSm90Tiles(128, 2)):
        v = tuning_bwd.flash_bwd_variant("f16", 128, mask=MASK_NONE, arch="sm_90")
        assert (v.block_m, v.num_wg) == (128, 2)


def test_deterministic_slices_rule():
    assert tuning_bwd.flash_bwd_dq_slices(False, 64, 1, 1, 132) == 1
    assert tuning_bwd.flash_bwd_dq_slices(True, 64, 1, 8, 132) == 17
    assert tuning_bwd.flash_bwd_dq_slices(True, 4, 1, 8, 132) == 4        # no more than tiles
    assert tuning_bwd.flash_bwd_dq_slices(True, 64, 16, 16, 132) == 1


def test_causal_schedule_rule():
    """Sections of the causal schedule: a power of two of (KV head, batch) pairs whose query
    rows fit LPT_L2_SHARE of the L2 (at least one); the plain grid (0) unless the call is
    causal with fixed lengths and not deterministic; tuning.override forces either."""
    sm90 = tuning_bwd.flash_bwd_variant("bf16", 128, mask=MASK_CAUSAL, arch="sm_90")
    with tuning.override(flash_path="mma"):
        mma = tuning_bwd.flash_bwd_variant("bf16", 128, mask=MASK_CAUSAL, arch="sm_90")
    kw = dict(kernel=sm90, causal=True, varlen=False, deterministic=False, seqlen_q=4096,
              head_group=1, head_dim=128, elem_bytes=2, l2_bytes=40 << 20)
    pair = 4096 * (128 * 8 + 8)
    fit = int(tuning_bwd.LPT_L2_SHARE * (40 << 20)) // pair
    group = tuning_bwd.flash_bwd_lpt_group(**kw)
    assert group & (group - 1) == 0 and group <= fit < 2 * group
    assert tuning_bwd.flash_bwd_lpt_group(**{**kw, "head_group": 4}) == group // 4
    assert tuning_bwd.flash_bwd_lpt_group(**{**kw, "seqlen_q": 1 << 20}) == 1
    for off in ("kernel", "causal", "varlen", "deterministic"):
        flip = {"kernel": mma, "causal": False, "varlen": True, "deterministic": True}[off]
        assert tuning_bwd.flash_bwd_lpt_group(**{**kw, off: flip}) == 0
    with tuning.override(flash_bwd_lpt=False):
        assert tuning_bwd.flash_bwd_lpt_group(**kw) == 0
    with tuning.override(flash_bwd_lpt=3):
        assert tuning_bwd.flash_bwd_lpt_group(**kw) == 3
        assert tuning_bwd.flash_bwd_lpt_group(**{**kw, "causal": False}) == 0
    for bad in (0, -1, 2.0, True, "x"):
        with pytest.raises(ValueError, match="flash_bwd_lpt"):
            with tuning.override(flash_bwd_lpt=bad):
                pass


# ---- GPU ---------------------------------------------------------------------------------------

def _randn(rng, shape, dtype, scale=1.0):
    import cupy
    return cupy.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(dtype))


def _nan(shape, dtype):
    import cupy
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)


def _floor(dtype):
    return 2e-3 if np.dtype(dtype) == F16 else 1e-2


def check_grads(got, want, lowp, dtype, what="", slack=0.0):
    """FlashAttention's backward rule for one gradient: max |got - ref64| <= 3 max |ref_lowp -
    ref64| + floor, relative to the gradient's scale (+ slack: an error the reference does not
    model, tests/test_fuzz.py's softcap bound); no NaN anywhere."""
    g = got.get().astype(np.float64) if hasattr(got, "get") else np.asarray(got, np.float64)
    assert np.isfinite(g).all(), f"{what}: NaN/inf (an unwritten element, or a bad row)"
    err = np.abs(g - want).max(initial=0)
    err_lp = np.abs(lowp - want).max(initial=0)
    tol = grad_tolerance(err_lp, _floor(dtype) * max(1.0, np.abs(want).max(initial=0))) + slack
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (lowp ref {err_lp:.3g})"


def run_case(rng, *, b=2, sq=97, sk=131, h=4, hkv=2, d=64, dtype=BF16, causal=False,
             window=(-1, -1), softcap=0.0, alibi=False, sinks=False, scale=None,
             deterministic=False, q_scale=1.0):
    """Forward then backward through cuattn on random inputs, every gradient checked against
    the float64 reference per sequence (outputs preallocated and NaN-poisoned). alibi:
    True for (h,) slopes, "batch" for (b, h)."""
    import cupy
    q = _randn(rng, (b, sq, h, d), dtype, q_scale)
    k = _randn(rng, (b, sk, hkv, d), dtype)
    v = _randn(rng, (b, sk, hkv, d), dtype)
    dout = _randn(rng, (b, sq, h, d), dtype)
    slopes = _slopes(rng, alibi, b, h)
    sink = cupy.asarray(rng.standard_normal(h).astype(np.float32)) if sinks else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
              sinks=sink, softmax_scale=scale)
    out, lse = cuattn.flash_forward(q, k, v, return_lse=True, **kw)
    dq, dk, dv = _nan(q.shape, dtype), _nan(k.shape, dtype), _nan(v.shape, dtype)
    res = cuattn.flash_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                dq=dq, dk=dk, dv=dv, **kw)
    assert res[0] is dq and res[1] is dk and res[2] is dv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    ref_kw = dict(causal=causal, window=window, softcap=softcap,
                  sinks=None if sink is None else sink.get())
    host = [x.get() for x in (q, k, v, dout)]
    dsinks_ref = np.zeros(h)
    for bi in range(b):
        args = [x[bi] for x in host]
        ref_kw["alibi"] = _slopes_of(slopes, bi)
        want = attention_backward_reference(*args, scale, **ref_kw)
        lowp = attention_backward_reference(*args, scale, lowp=dtype, **ref_kw)
        for name, got, w, lp in zip(("dq", "dk", "dv"), (dq[bi], dk[bi], dv[bi]), want, lowp):
            check_grads(got, w, lp, dtype, f"{name}[{bi}]")
        if sinks:
            dsinks_ref += want[3]
    if sinks:
        assert len(res) == 4
        got = res[3].get()
        assert np.allclose(got, dsinks_ref, rtol=2e-2, atol=2e-2 * max(1, np.abs(dsinks_ref).max())), \
            (got, dsinks_ref)
    return q, k, v, out, lse, dout, (dq, dk, dv), kw


SHAPES = [(97, 131), (128, 128), (1, 147), (255, 64), (64, 255), (200, 200)]
BWD_HEAD_DIMS = [8, 32, 64, 80, 96, 128, 160, 192, 224, 256]
_SWEEP = [(d, sq, sk, c) for d in BWD_HEAD_DIMS for sq, sk in SHAPES for c in (False, True)]
HEADS = [(4, 4), (6, 2), (4, 1), (8, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,sq,sk,causal", _SWEEP,
                         ids=[f"d{d}-{a}x{b}-{'c' if c else 'nc'}" for d, a, b, c in _SWEEP])
def test_bwd_sweep(rng, d, sq, sk, causal):
    idx = _SWEEP.index((d, sq, sk, causal))
    h, hkv = HEADS[(idx // 2) % len(HEADS)]
    run_case(rng, b=2, sq=sq, sk=sk, h=h, hkv=hkv, d=d, dtype=(F16, BF16)[idx % 2],
             causal=causal)


_FEATURES = [
    dict(softcap=5.0), dict(alibi=True), dict(sinks=True), dict(window=(33, 7)),
    dict(window=(0, 0)), dict(window=(-1, 20)), dict(window=(50, -1)),
    dict(causal=True, softcap=3.0, alibi=True, sinks=True),
    dict(window=(40, 10), softcap=2.0, sinks=True), dict(causal=True, alibi=True, q_scale=3.0),
    dict(scale=0.3, causal=True), dict(softcap=1.0, q_scale=4.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("feat", _FEATURES, ids=[str(i) for i in range(len(_FEATURES))])
def test_bwd_features(rng, d, feat):
    h, hkv = HEADS[_FEATURES.index(feat) % len(HEADS)]
    run_case(rng, b=2, sq=113, sk=177, h=h, hkv=hkv, d=d, dtype=BF16, **feat)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_bwd_gqa_groups(rng, group):
    run_case(rng, b=1, sq=150, sk=90, h=2 * group, hkv=2, d=96, dtype=F16, causal=True)


@pytest.mark.gpu
def test_bwd_rows_that_see_no_key_get_zero_gradients(rng):
    """sq > sk with causal: the first sq - sk query rows see no key (lse = -inf): dq = 0
    there, no NaN anywhere, and the rest as the reference."""
    q, k, v, out, lse, dout, (dq, dk, dv), _ = run_case(rng, b=1, sq=200, sk=60, h=2, hkv=1,
                                                         d=64, causal=True)
    assert bool((lse[:, :, :140] == -np.inf).all())
    assert float(abs(dq[:, :140].astype(np.float32)).max()) == 0.0


@pytest.mark.gpu
def test_bwd_strided_inputs(rng):
    """q, k, v, out, dout as views with row and head strides (a contiguous last dim)."""
    import cupy
    b, s, h, d = 2, 130, 4, 64
    big = _randn(rng, (b, s, 3 * h, d), BF16)
    q, k, v = big[:, :, :h], big[:, :, h:2 * h], big[:, :, 2 * h:]
    dout_big = _randn(rng, (b, s, 2 * h, d), BF16)
    dout = dout_big[:, :, ::2]
    out, lse = cuattn.flash_forward(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuattn.flash_backward(dout, q, k, v, out, lse, causal=True)
    cont = [cupy.ascontiguousarray(x) for x in (q, k, v, dout, out)]
    dq2, dk2, dv2 = cuattn.flash_backward(cont[3], *cont[:3], cont[4], lse, causal=True)
    for a, c in ((dq, dq2), (dk, dk2), (dv, dv2)):
        assert bool(cupy.allclose(a.astype(np.float32), c.astype(np.float32), atol=1e-2))


def _slopes(rng, alibi, b: int, h: int):
    """ALiBi slopes on the device: None (alibi False), (h,) (True) or (b, h) ("batch", a view
    whose rows are h + 3 floats apart)."""
    import cupy
    if not alibi:
        return None
    if alibi == "batch":
        return cupy.asarray(rng.uniform(0.05, 0.5, (b, h + 3)).astype(np.float32))[:, 1:h + 1]
    return cupy.asarray(rng.uniform(0.05, 0.5, h).astype(np.float32))


def _slopes_of(slopes, b: int):
    """The host slopes sequence b sees (None: no ALiBi)."""
    if slopes is None:
        return None
    return slopes.get() if slopes.ndim == 1 else slopes[b].get()


def run_varlen_case(rng, *, lens_q, lens_k, pad=(0, 0), h=6, hkv=2, d=64, dtype=BF16,
                    causal=False, window=(-1, -1), softcap=0.0, alibi=False, sinks=False):
    """flash_varlen_forward then flash_varlen_backward on random packed sequences (pad: rows
    past the last sequence in q and in k), dq / dk / dv preallocated and NaN-poisoned: each
    sequence's gradients and dsinks against the reference, dq = 0 past the last sequence.
    Returns the backward's arguments and options (for another call) and its gradients."""
    import cupy
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]) + pad[0], int(cu_k[-1]) + pad[1]
    q = _randn(rng, (tq, h, d), dtype)
    k = _randn(rng, (tk, hkv, d), dtype)
    v = _randn(rng, (tk, hkv, d), dtype)
    dout = _randn(rng, (tq, h, d), dtype)
    slopes = _slopes(rng, alibi, len(lens_q), h)
    sink = cupy.asarray(rng.standard_normal(h).astype(np.float32)) if sinks else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
              sinks=sink)
    lens = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lens_q), max(lens_k))
    out, lse = cuattn.flash_varlen_forward(q, k, v, *lens, return_lse=True, **kw)
    grads = _nan(q.shape, dtype), _nan(k.shape, dtype), _nan(v.shape, dtype)
    args = (dout, q, k, v, out, lse) + lens
    res = cuattn.flash_varlen_backward(*args, dq=grads[0], dk=grads[1], dv=grads[2], **kw)
    scale = 1.0 / math.sqrt(d)
    host = [x.get() for x in (q, k, v, dout)]
    rk = dict(causal=causal, window=window, softcap=softcap,
              sinks=None if sink is None else sink.get())
    dsinks_ref, dsinks_lowp = np.zeros(h), np.zeros(h)
    for i in range(len(lens_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        seq = (host[0][qs], host[1][ks], host[2][ks], host[3][qs])
        rk["alibi"] = _slopes_of(slopes, i)
        want = attention_backward_reference(*seq, scale, **rk)
        lowp = attention_backward_reference(*seq, scale, lowp=dtype, **rk)
        for name, got, rows, w, lp in zip(("dq", "dk", "dv"), grads, (qs, ks, ks), want, lowp):
            check_grads(got[rows], w, lp, dtype, f"{name} of sequence {i}")
        if sinks:
            dsinks_ref += want[3]
            dsinks_lowp += lowp[3]
    if pad[0]:
        assert float(abs(grads[0][int(cu_q[-1]):].astype(np.float32)).max()) == 0.0
    if sinks:
        # the gradients' rule: dsinks sum P_sink D over every row, D from the kernel's out in
        # the input dtype (an error the lowp reference models: with hooks at hd192 it reached
        # 0.05 on both paths, beyond a fixed 2e-2)
        check_grads(res[3], dsinks_ref, dsinks_lowp, dtype, "dsinks")
    return args, kw, res


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_varlen(rng, d):
    """Packed sequences of lengths 0, 1 and odd ones, GQA, causal with a window: each
    sequence's gradients as the reference's; rows past the last sequence's get dq = 0."""
    run_varlen_case(rng, lens_q=[37, 0, 1, 128, 70], lens_k=[50, 9, 1, 128, 0], pad=(3, 2),
                    d=d, causal=True, window=(60, 0), softcap=4.0, sinks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_alibi_per_batch(rng, d):
    """alibi_slopes (batch, nheads), as flash-attn takes them: sequence b's gradients with
    its own row of slopes, fixed length and varlen (the slopes a view with a row stride)."""
    run_case(rng, b=3, sq=113, sk=177, h=4, hkv=2, d=d, causal=True, alibi="batch")
    run_varlen_case(rng, lens_q=[37, 0, 1, 90], lens_k=[50, 9, 1, 120], h=4, d=d,
                    causal=True, softcap=3.0, alibi="batch")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 192])
def test_bwd_varlen_every_kernel(rng, d):
    """Small enough for scripts/sanitize.sh, and reaching every backward kernel: the
    pre-pass, the main kernel's one-pass (hd 64) or two-pass (hd 192) form with a two-sided
    window and every hook over packed sequences (empty, one-token and odd ones; GQA), the dQ
    convert
    of one dQ slice, then of three in order (deterministic over three key tiles), and the
    sinks' gradient; every element of the deterministic call's fresh outputs written (read
    on the device: initcheck sees an unwritten one) and as the first call's."""
    import cupy
    args, kw, first = run_varlen_case(rng, lens_q=[37, 0, 1, 20, 5], lens_k=[50, 9, 1, 300, 0],
                                      h=4, d=d, window=(40, 7), softcap=2.0, alibi=True,
                                      sinks=True)
    again = cuattn.flash_varlen_backward(*args, deterministic=True, **kw)
    for a, b in zip(first, again):
        a, b = a.astype(np.float32), b.astype(np.float32)
        assert bool(cupy.isfinite(b).all())
        assert bool(cupy.allclose(a, b, atol=2e-2, rtol=2e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_deterministic_is_bit_identical(rng, d):
    """deterministic=True: 20 runs give the same bits; and it agrees with the default mode."""
    import cupy
    b, s, h, hkv = 1, 1000, 8, 2
    q = _randn(rng, (b, s, h, d), BF16)
    k = _randn(rng, (b, s, hkv, d), BF16)
    v = _randn(rng, (b, s, hkv, d), BF16)
    dout = _randn(rng, (b, s, h, d), BF16)
    out, lse = cuattn.flash_forward(q, k, v, causal=True, return_lse=True)
    first = cuattn.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(19):
        again = cuattn.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        for a, c in zip(first, again):
            assert bool((a.view(np.uint16) == c.view(np.uint16)).all())
    free = cuattn.flash_backward(dout, q, k, v, out, lse, causal=True)
    for a, c in zip(first, free):
        assert bool(cupy.allclose(a.astype(np.float32), c.astype(np.float32), atol=2e-2,
                                  rtol=2e-2))


@pytest.mark.gpu
def test_bwd_graph_replay_equals_eager(rng):
    """The whole backward (pre-pass, main kernel, convert, sinks) captured in a CUDA graph:
    a replay on new inputs equals an eager call."""
    import cupy
    b, s, h, d = 2, 300, 4, 128
    q, k, v, dout = (_randn(rng, (b, s, h, d), BF16) for _ in range(4))
    sink = cupy.asarray(rng.standard_normal(h).astype(np.float32))
    out, lse = cuattn.flash_forward(q, k, v, causal=True, sinks=sink, return_lse=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        cuattn.flash_backward(dout, q, k, v, out, lse, causal=True, sinks=sink)   # plan
        stream.begin_capture()
        grads = cuattn.flash_backward(dout, q, k, v, out, lse, causal=True, sinks=sink)
        graph = stream.end_capture()
    new = _randn(rng, (b, s, h, d), BF16)
    dout[...] = new
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    eager = cuattn.flash_backward(dout, q, k, v, out, lse, causal=True, sinks=sink)
    for a, c in zip(grads, eager):
        assert bool(cupy.allclose(a.astype(np.float32), c.astype(np.float32), atol=1e-2,
                                  rtol=1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 4, 16])
def test_bwd_causal_schedule(rng, group, bwd_path):
    """The causal schedule's sections (tuning.override(flash_bwd_lpt=group): 9 (KV head, batch)
    pairs, so a short last section but at 1) give every key tile to one block: gradients
    right (poisoned outputs, reference), and dK, dV the plain grid's bits (dQ's atomics may
    add in another order). The Hopper kernel's schedule: the mma.sync kernel has none."""
    import cupy
    if bwd_path != "wgmma":
        pytest.skip("the causal schedule is the Hopper kernel's (tuning_bwd.flash_bwd_lpt_group)")
    with tuning.override(flash_bwd_lpt=group):
        q, k, v, out, lse, dout, grads, kw = run_case(rng, b=3, sq=300, sk=300, h=6, hkv=3,
                                                      d=128, causal=True)
    with tuning.override(flash_bwd_lpt=False):
        plain = cuattn.flash_backward(dout, q, k, v, out, lse, **kw)
    for name, a, c in zip(("dk", "dv"), grads[1:], plain[1:]):
        assert bool((a.view(np.uint16) == c.view(np.uint16)).all()), name
    assert bool(cupy.allclose(grads[0].astype(np.float32), plain[0].astype(np.float32),
                              atol=1e-2, rtol=1e-2))


@pytest.mark.gpu
def test_bwd_long_and_large(rng):
    """A long causal GQA case: many query tiles per key tile, dQ added by many blocks."""
    run_case(rng, b=1, sq=1500, sk=1500, h=4, hkv=2, d=128, causal=True)
