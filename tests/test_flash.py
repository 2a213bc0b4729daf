"""flash_forward / flash_varlen_forward.

CPU (CI): every compiled head dim x mask x split form compiles for sm_90 with no spills and
no stack, and so does every knob tile (KNOB_TILES, forced with tuning.override) (marker
slow; the default run compiles the smallest and largest head dims' forms and the first and
last knob tile: tests/compiled.py); a representative few for sm_80 / sm_86 / sm_89; tile
choices fit each architecture's shared memory. (tests/test_jit.py compiles the whole
shipped set.)
GPU (marker ``gpu``): the sweep of issue 3 against a float64 reference (CuPy on the device,
NumPy for a few small shapes) with FlashAttention's tolerance rule, outputs poisoned with
NaN first. Bad inputs: tests/test_bad_inputs.py.
Run the GPU part with: python -m pytest -q -m gpu tests/test_flash.py
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import tuning
from cuattn.flash import _mask_and_bounds
from tests.compiled import compile_reports, unclean
from tests.paths import FLASH_PATHS, forced_flash_path
from cuattn.tuning import FlashTiles
from cuattn.constants import MASK_CAUSAL, MASK_NONE, MASK_WINDOW
from cuattn.keys import FlashFwdVariant

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024,
              "sm_90": 227 * 1024}
MASKS = {"n": MASK_NONE, "c": MASK_CAUSAL, "w": MASK_WINDOW}


# ---- CPU: compilation -----------------------------------------------------------------------

# Every compiled head dim x {none, causal, window} x {final, split}, bf16 (fp16 generates
# the same code but for the mma type), with the sm_90 table: what a user can reach
# compiles cleanly (the shipped set, both dtypes and the sm_86 table too, is compiled by
# tests/test_jit.py).
_ALL_FORMS = [(hd, mode, split) for hd in tuning.FLASH_HEAD_DIMS for mode in "ncw"
              for split in (False, True)]


def _sm90_forms(head_dims) -> list:
    return [tuning.flash_forward_variant("bf16", hd, mask=MASKS[mode], split=split, arch="sm_90")
            for hd, mode, split in _ALL_FORMS if hd in head_dims]


@pytest.mark.slow
def test_every_form_compiles_for_sm90_without_spills():
    assert unclean(compile_reports(_sm90_forms(tuning.FLASH_HEAD_DIMS), "sm_90")) == []


def test_a_few_forms_compile_for_sm90_without_spills():
    ends = (min(tuning.FLASH_HEAD_DIMS), max(tuning.FLASH_HEAD_DIMS))
    assert unclean(compile_reports(_sm90_forms(ends), "sm_90")) == []


_OLDER = [("sm_80", "bf16", 128, "c", False), ("sm_80", "f16", 256, "n", True),
          ("sm_86", "bf16", 128, "w", False), ("sm_86", "f16", 64, "c", True),
          ("sm_89", "bf16", 64, "n", False), ("sm_89", "bf16", 256, "c", False)]


def test_representative_variants_compile_for_older_archs():
    for arch in sorted({c[0] for c in _OLDER}):
        vs = [tuning.flash_forward_variant(dt, hd, mask=MASKS[mode], split=split, arch=arch)
              for a, dt, hd, mode, split in _OLDER if a == arch]
        assert unclean(compile_reports(vs, arch)) == [], arch


@pytest.mark.parametrize("arch", sorted(SMEM_LIMIT))
def test_tiles_fit_shared_memory_and_warp_rows(arch):
    for hd in tuning.FLASH_HEAD_DIMS:
        for mask in (MASK_NONE, MASK_CAUSAL):
            v = tuning.flash_forward_variant("bf16", hd, mask=mask, split=False, arch=arch)
            assert v.dynamic_smem_bytes <= SMEM_LIMIT[arch], (arch, v.name)
            assert v.block_m % (16 * v.num_warps) == 0 and v.block_n % 16 == 0


def test_compiled_head_dim_and_names():
    assert [tuning.compiled_head_dim(d) for d in (8, 32, 40, 64, 80, 96, 120, 128, 136, 256)] == \
        [32, 32, 64, 64, 96, 96, 128, 128, 160, 256]
    v = tuning.flash_forward_variant("bf16", 128, mask=MASK_CAUSAL, split=False, arch="sm_90")
    assert v.name.startswith("cuattn_flash_fwd__bf16_hd128_") and v.name.endswith("_c1")
    with pytest.raises(ValueError):
        FlashFwdVariant("bf16", 128, 128, 64, 8, 2, 3, False, 0, False, 0)   # no mask kind 3


def test_split_rule():
    # A full grid never splits; a few rows against long keys split; short keys never do.
    assert tuning.flash_num_splits(4000, 512, 132, 1) == 1
    assert tuning.flash_num_splits(8, 512, 132, 1) == 132 // 8        # fill one wave, not more
    assert tuning.flash_num_splits(128, 256, 132, 2) == 2               # 3 would start a 2nd wave
    assert tuning.flash_num_splits(200, 256, 132, 1) == 1
    assert tuning.flash_num_splits(8, 3, 132, 1) == 1
    assert tuning.flash_num_splits(1, 10_000, 132, 2) == tuning.FLASH_MAX_SPLITS


# ---- kernel knobs ---------------------------------------------------------------------------
# Tiles outside the tuning table that reach every value of every FlashFwdTraits knob
# (q_smem 0 / 1 / 2, kv_split, softmax bits 0 and 1, 16 and 32 rows per warp, 2 and 3
# stages), forced with tuning.override: the kernel's whole knob space compiles cleanly and
# computes the right thing (test_knobs). bench/lab/flash_sweep.py times its own candidates.
KNOB_TILES = {
    64: [FlashTiles(64, 64, 4, 3, kv_split=True), FlashTiles(64, 64, 4, 3, softmax=1),
         FlashTiles(128, 32, 4, 2), FlashTiles(128, 64, 4, 3, q_smem=1),
         FlashTiles(128, 64, 4, 3, q_smem=1, kv_split=True),
         FlashTiles(128, 128, 4, 2, q_smem=2, softmax=2)],
    128: [FlashTiles(64, 64, 4, 2, kv_split=True), FlashTiles(64, 64, 4, 2, softmax=3),
          FlashTiles(64, 32, 4, 3, q_smem=1), FlashTiles(128, 32, 4, 3, q_smem=1),
          FlashTiles(128, 32, 4, 3, q_smem=1, kv_split=True),
          FlashTiles(128, 32, 4, 3, q_smem=1, softmax=2),
          FlashTiles(128, 64, 4, 2, q_smem=1, kv_split=True, softmax=2)],
}
# Tiles whose masked forms spill (the boundary-tile mask code on top of 192 accumulator
# registers): the tuning table never picks them for a masked form.
FULL_ONLY = {(64, FlashTiles(128, 128, 4, 2, q_smem=2, softmax=2)),
             (128, FlashTiles(128, 64, 4, 2, q_smem=1, kv_split=True, softmax=2))}


def label(t: FlashTiles) -> str:
    s = f"{t.block_m}x{t.block_n}x{t.num_warps}w{t.stages}s"
    s += {0: "", 1: "+qs"}.get(t.q_smem, f"+qs{t.q_smem}")
    return s + ("+kvs" if t.kv_split else "") + (f"+sm{t.softmax}" if t.softmax else "")


_KNOB_FORMS = [(hd, t, causal) for hd, ts in KNOB_TILES.items() for t in ts
               for causal in (False, True) if not (causal and (hd, t) in FULL_ONLY)]


def _knob_variants(knob_forms) -> list:
    forms = []
    for hd, tiles, causal in knob_forms:
        with tuning.override(flash_tiles=tiles):
            v = tuning.flash_forward_variant("bf16", hd, mask=MASK_CAUSAL if causal else MASK_NONE,
                                             split=False, arch="sm_90")
        assert (v.block_m, v.block_n, v.num_warps, v.stages, v.q_smem, v.kv_split, v.softmax) == \
            (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.stages, tiles.q_smem,
             tiles.kv_split, tiles.softmax)
        assert v.dynamic_smem_bytes <= SMEM_LIMIT["sm_90"]
        forms.append(v)
    return forms


@pytest.mark.slow
def test_knob_tiles_compile_for_sm90_without_spills():
    assert unclean(compile_reports(_knob_variants(_KNOB_FORMS), "sm_90")) == []


def test_a_few_knob_tiles_compile_for_sm90_without_spills():
    """The first and last knob forms; every knob tile's smem and knob values (not compiled)."""
    forms = _knob_variants(_KNOB_FORMS)
    assert unclean(compile_reports([forms[0], forms[-1]], "sm_90")) == []


def test_knobs_appear_in_the_names():
    base = FlashFwdVariant("bf16", 128, 64, 64, 4, 2, MASK_NONE, False, 0, False, 0)
    assert base.name == "cuattn_flash_fwd__bf16_hd128_bm64_bn64_w4_st2_c0"
    knob = FlashFwdVariant("bf16", 128, 128, 32, 4, 3, MASK_CAUSAL, True, 1, True, 1)
    assert knob.name == "cuattn_flash_fwd__bf16_hd128_bm128_bn32_w4_st3_c1_qs_kvs_sm1_split"
    assert knob.traits_args()[8:11] == (1, True, 1)
    knob2 = FlashFwdVariant("bf16", 64, 128, 128, 4, 2, MASK_NONE, False, 2, False, 2)
    assert knob2.name == "cuattn_flash_fwd__bf16_hd64_bm128_bn128_w4_st2_c0_qs2_sm2"
    win = FlashFwdVariant("bf16", 64, 64, 64, 4, 2, MASK_WINDOW, False, 0, False, 0)
    assert win.name.endswith("_win")
    for bad in (dict(softmax=4), dict(q_smem=3)):
        fields = dict(q_smem=0, kv_split=False, softmax=0) | bad
        with pytest.raises(ValueError):
            FlashFwdVariant("bf16", 128, 64, 64, 4, 2, MASK_NONE, False, **fields)


def test_override_forces_tiles_and_restores_the_table():
    table = tuning.flash_forward_variant("bf16", 128, mask=MASK_NONE, split=False, arch="sm_90")
    forced = FlashTiles(64, 32, 4, 3, q_smem=1)
    with tuning.override(flash_tiles=forced):
        v = tuning.flash_forward_variant("bf16", 128, mask=MASK_NONE, split=False, arch="sm_90")
        assert (v.block_m, v.block_n, v.stages, v.q_smem) == (64, 32, 3, 1)
    assert tuning.flash_forward_variant("bf16", 128, mask=MASK_NONE, split=False,
                                        arch="sm_90") == table
    with pytest.raises(TypeError, match="override"):
        with tuning.override(flash_tile=forced):
            pass


# ---- GPU: both kernels ---------------------------------------------------------------------------
# Every GPU test of this module runs on both forward kernels: "mma" (mma.sync, every GPU)
# and "wgmma" (the Hopper kernel, sm_90 devices only; skipped elsewhere). test_knobs forces
# mma.sync tiles and runs once.

def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("gpu") is not None and \
            metafunc.definition.originalname != "test_knobs":
        metafunc.parametrize("flash_path", FLASH_PATHS, indirect=True)


@pytest.fixture(autouse=True)
def flash_path(request):
    path = getattr(request, "param", None)
    if path is None:
        yield None
        return
    with forced_flash_path(path):
        yield path


# ---- references -------------------------------------------------------------------------------

def _round(x, dtype, xp):
    """Round float64 values to ``dtype`` (fp16 / bf16, nearest even) and back to float64."""
    if np.dtype(dtype) == F16:
        return x.astype(np.float16).astype(np.float64)
    u = x.astype(np.float32).view(np.uint32)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return u.view(np.float32).astype(np.float64)


def _visible(xp, sq, sk, causal, window):
    left, right = window
    if causal:
        right = 0
    i = xp.arange(sq)[:, None]
    j = xp.arange(sk)[None, :]
    ok = xp.ones((sq, sk), dtype=bool)
    if left >= 0:
        ok &= j >= i + sk - sq - left
    if right >= 0:
        ok &= j <= i + sk - sq + right
    return ok


def test_mask_and_bounds_drop_only_sides_that_exclude_no_key():
    """The host's mask kind and bounds (cuattn.flash._mask_and_bounds) see the same keys as
    the window asked for, at every length up to the bounds it is given (varlen: max_seqlen
    bounds each sequence), and a window covering every key runs the causal or unmasked
    kernel."""
    kernel_window = {MASK_NONE: lambda lb, rb: (-1, -1), MASK_CAUSAL: lambda lb, rb: (-1, 0),
                     MASK_WINDOW: lambda lb, rb: (lb, rb)}
    for max_sq, max_sk in ((1, 1), (1, 9), (6, 9), (9, 6), (7, 7)):
        for left in range(-1, max_sk + 3):
            for right in range(-1, max_sq + 3):
                mask, lb, rb = _mask_and_bounds(left, right, max_sq, max_sk)
                for sq in range(1, max_sq + 1):
                    for sk in range(0, max_sk + 1):
                        want = _visible(np, sq, sk, False, (left, right))
                        got = _visible(np, sq, sk, False, kernel_window[mask](lb, rb))
                        assert (got == want).all(), (max_sq, max_sk, left, right, sq, sk)
    assert _mask_and_bounds(4095, 0, 4096, 4096)[0] == MASK_CAUSAL     # causal, every key
    assert _mask_and_bounds(4094, 0, 4096, 4096)[0] == MASK_WINDOW     # all keys but one
    assert _mask_and_bounds(-1, 0, 1, 4096)[0] == MASK_NONE            # causal decode
    assert _mask_and_bounds(9000, 4095, 4096, 8192) == (MASK_NONE, 12289, 12289)
    assert _mask_and_bounds(100, -1, 4096, 8192) == (MASK_WINDOW, 100, 12289)


def attention_ref(q, k, v, *, causal=False, window=(-1, -1), scale=None, lowp=None):
    """q (B, Sq, H, D), k/v (B, Sk, Hkv, D) -> float64 out (B, Sq, H, D), lse (B, H, Sq).

    lowp: the same math in the input precision: P = exp(S - max) rounded to that dtype
    before P V, and the output rounded to it (FlashAttention's ``ref_same_precision``).
    Works on NumPy or CuPy arrays (float64 either way).
    """
    xp = _xp(q)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = q.shape[2] // k.shape[2]
    qf = q.astype(np.float64)
    kf = xp.repeat(k.astype(np.float64), group, axis=2)
    vf = xp.repeat(v.astype(np.float64), group, axis=2)
    s = xp.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    ok = _visible(xp, q.shape[1], k.shape[1], causal, window)
    s = xp.where(ok, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else xp.full(s.shape[:-1] + (1,), -xp.inf)
    m_safe = xp.where(xp.isinf(m), 0.0, m)
    p = xp.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    if lowp is not None:
        p = _round(p, lowp, xp)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = xp.einsum("bhqk,bkhd->bhqd", p, vf) / xp.where(l > 0, l, 1.0)
        lse = xp.where(l > 0, m_safe + xp.log(xp.where(l > 0, l, 1.0)), -xp.inf)[..., 0]
    out = xp.where(l > 0, out, 0.0).transpose(0, 2, 1, 3)
    if lowp is not None:
        out = _round(out, lowp, xp)
    return out, lse


def _xp(x):
    import cupy
    return cupy.get_array_module(x)


def _floor(dtype):
    return 1e-3 if np.dtype(dtype) == F16 else 5e-3


def check_close(out, lse, q, k, v, *, causal=False, window=(-1, -1), scale=None, on_host=False):
    """FlashAttention's rule: max|out - ref64| <= 2 max|ref_lowp - ref64| + floor; lse too."""
    import cupy
    conv = cupy.asnumpy if on_host else (lambda a: a)
    qq, kk, vv = (conv(x) for x in (q, k, v))
    ref, ref_lse = attention_ref(qq, kk, vv, causal=causal, window=window, scale=scale)
    ref_lp, _ = attention_ref(qq, kk, vv, causal=causal, window=window, scale=scale,
                              lowp=q.dtype)
    got = cupy.asarray(out).astype(np.float64)
    ref, ref_lp = cupy.asarray(ref), cupy.asarray(ref_lp)
    assert not bool(cupy.isnan(got).any()), "an output element was not written (NaN poison)"
    err = float(cupy.abs(got - ref).max()) if got.size else 0.0
    err_lp = float(cupy.abs(ref_lp - ref).max()) if got.size else 0.0
    assert err <= 2 * err_lp + _floor(q.dtype), f"out error {err:.3g} vs lowp ref {err_lp:.3g}"
    if lse is not None:
        ref_lse = cupy.asarray(ref_lse)
        got_lse = cupy.asarray(lse).astype(np.float64)
        assert got_lse.shape == ref_lse.shape
        empty = cupy.isinf(ref_lse)
        assert bool((cupy.isneginf(got_lse) == empty).all()), "empty rows must have lse = -inf"
        if bool((~empty).any()):
            lse_err = float(cupy.abs(got_lse - ref_lse)[~empty].max())
            assert lse_err <= 2e-3 * max(1.0, float(cupy.abs(ref_lse[~empty]).max())), lse_err
    return err, err_lp


def _randn(rng, shape, dtype):
    import cupy
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def _poisoned(shape, dtype):
    import cupy
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)


HEAD_CONFIGS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


# ---- GPU: the sweep ----------------------------------------------------------------------------

SHAPES = [(113, 203), (128, 217), (1, 147), (1023, 1024), (1024, 1023), (512, 256), (2048, 2048)]
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
_SWEEP = [(hd, sq, sk, causal) for hd in HEAD_DIMS for sq, sk in SHAPES for causal in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("hd,sq,sk,causal", _SWEEP,
                         ids=[f"d{h}-{a}x{b}-{'c' if c else 'nc'}" for h, a, b, c in _SWEEP])
def test_sweep(rng, hd, sq, sk, causal):
    # dtype and head layout rotate through the cases so that every head dim meets both
    # dtypes and all of MHA / GQA / MQA without the full cartesian product.
    idx = _SWEEP.index((hd, sq, sk, causal))
    dtype = (F16, BF16)[idx % 2]
    h, hkv = list(HEAD_CONFIGS.values())[(idx // 2) % 3]
    batch = 1 if sq * sk > 1 << 20 else 2
    q = _randn(rng, (batch, sq, h, hd), dtype)
    k = _randn(rng, (batch, sk, hkv, hd), dtype)
    v = _randn(rng, (batch, sk, hkv, hd), dtype)
    out = _poisoned(q.shape, dtype)
    res, lse = cuattn.flash_forward(q, k, v, causal=causal, return_lse=True, out=out)
    assert res is out
    check_close(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_small_against_numpy_float64(rng, dtype):
    q = _randn(rng, (2, 37, 4, 64), dtype)
    k = _randn(rng, (2, 91, 2, 64), dtype)
    v = _randn(rng, (2, 91, 2, 64), dtype)
    out, lse = cuattn.flash_forward(q, k, v, causal=True, return_lse=True)
    check_close(out, lse, q, k, v, causal=True, on_host=True)


_WINDOWS = [((32, -1), False), ((16, 8), False), ((0, 0), False), ((40, 0), True),
            ((100, 300), False), ((-1, 5), False)]


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(113, 203), (1024, 1023), (1, 147)])
@pytest.mark.parametrize("window,causal", _WINDOWS, ids=[f"w{w[0]}_{w[1]}{'c' if c else ''}"
                                                         for w, c in _WINDOWS])
def test_window(rng, hd, sq, sk, window, causal):
    dtype = BF16 if hd != 128 else F16
    q = _randn(rng, (2, sq, 4, hd), dtype)
    k = _randn(rng, (2, sk, 2, hd), dtype)
    v = _randn(rng, (2, sk, 2, hd), dtype)
    out = _poisoned(q.shape, dtype)
    _, lse = cuattn.flash_forward(q, k, v, causal=causal, window_size=window, return_lse=True,
                                  out=out)
    check_close(out, lse, q, k, v, causal=causal, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [64, 128])
def test_strided_bhsd_views_and_scale(rng, hd):
    import cupy
    dtype = BF16
    qb = _randn(rng, (2, 4, 300, hd), dtype)          # (B, H, S, D) storage
    kb = _randn(rng, (2, 2, 257, hd), dtype)
    vb = _randn(rng, (2, 2, 257, hd), dtype)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (qb, kb, vb))
    out_store = _poisoned((2, 4, 300, hd), dtype)
    out = out_store.transpose(0, 2, 1, 3)
    _, lse = cuattn.flash_forward(q, k, v, causal=True, softmax_scale=0.3, return_lse=True,
                                  out=out)
    check_close(out, lse, cupy.ascontiguousarray(q), k, v, causal=True, scale=0.3)


@pytest.mark.gpu
def test_tma_and_cp_async_loads(rng, flash_path):
    """The Hopper kernel loads Q / K / V by TMA where a tensor map describes them, by
    cp.async where not (a negative or zero stride); fresh buffers of one signature get
    their own maps (the plan is reused, its maps are not); varlen keeps its sequences apart."""
    if flash_path != "wgmma":
        pytest.skip("the Hopper kernel's two producers")
    import cupy
    from cuattn import _tma, flash

    def kernel_loads_by_tma():
        return isinstance(list(flash._plans.values())[-1].launches[0].extra, _tma.FlashMaps)

    q = _randn(rng, (2, 77, 4, 96), BF16)
    kb = _randn(rng, (2, 150, 2, 96), BF16)
    vb = _randn(rng, (2, 150, 2, 96), BF16)
    views = {"contiguous": (kb, vb, True), "keys reversed": (kb[:, ::-1], vb[:, ::-1], False),
             "one batch broadcast": (cupy.broadcast_to(kb[:1], kb.shape),
                                     cupy.broadcast_to(vb[:1], vb.shape), False)}
    for name, (k, v, by_tma) in views.items():
        flash._plans.clear()
        out, lse = cuattn.flash_forward(q, k, v, causal=True, return_lse=True,
                                        out=_poisoned(q.shape, BF16))
        assert kernel_loads_by_tma() == by_tma, name
        check_close(out, lse, q, cupy.ascontiguousarray(k), cupy.ascontiguousarray(v),
                    causal=True)
    for _ in range(2):                       # new buffers, the same plan
        q2, k2, v2 = (_randn(rng, x.shape, BF16) for x in (q, kb, vb))
        out = cuattn.flash_forward(q2, k2, v2, out=_poisoned(q.shape, BF16))
        check_close(out, None, q2, k2, v2)
    # varlen by TMA: a V tile crossing a sequence's end must not read the next sequence's
    # rows (an inf there) nor the rows past the last one (NaN)
    lens_q, lens_k = [77, 5, 130], [150, 3, 300]
    q, k, v, cu_q, cu_k, dcu_q, dcu_k = _pack_varlen(rng, lens_q, lens_k, 4, 2, 128, BF16)
    tail = _poisoned((40, 2, 128), BF16)
    k, v = cupy.concatenate([k, tail]), cupy.concatenate([v, tail])
    v[int(cu_k[1])] = np.inf
    flash._plans.clear()
    out, lse = cuattn.flash_varlen_forward(q, k, v, dcu_q, dcu_k, 130, 300, return_lse=True,
                                           out=_poisoned(q.shape, BF16))
    assert kernel_loads_by_tma()
    for b in (0, 2):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        check_close(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe], k[None, ks:ke],
                    v[None, ks:ke])


@pytest.mark.gpu
def test_seqlen_k_zero_and_no_key_rows(rng):
    import cupy
    q = _randn(rng, (1, 16, 2, 64), F16)
    k = _randn(rng, (1, 0, 2, 64), F16)
    out, lse = cuattn.flash_forward(q, k, k, return_lse=True, out=_poisoned(q.shape, F16))
    assert bool((out == 0).all()) and bool(cupy.isneginf(lse).all())
    # causal with sq > sk: the first sq - sk rows see no key
    k = _randn(rng, (1, 5, 2, 64), F16)
    v = _randn(rng, (1, 5, 2, 64), F16)
    out, lse = cuattn.flash_forward(q, k, v, causal=True, return_lse=True,
                                    out=_poisoned(q.shape, F16))
    assert bool((out[:, :11] == 0).all()) and bool(cupy.isneginf(lse[:, :, :11]).all())
    check_close(out, lse, q, k, v, causal=True)


def _pack_varlen(rng, lens_q, lens_k, h, hkv, hd, dtype):
    import cupy
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _randn(rng, (int(cu_q[-1]), h, hd), dtype)
    k = _randn(rng, (int(cu_k[-1]), hkv, hd), dtype)
    v = _randn(rng, (int(cu_k[-1]), hkv, hd), dtype)
    return q, k, v, cu_q, cu_k, cupy.asarray(cu_q), cupy.asarray(cu_k)


_VARLEN = [([0, 1, 77, 300, 5], [0, 130, 1, 300, 700]), ([1, 1, 1], [1000, 0, 2049]),
           ([513, 0, 64], [513, 9, 64])]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", _VARLEN, ids=["mixed", "decode-like", "with-empty"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_varlen(rng, lens, causal, num_splits):
    import cupy
    lens_q, lens_k = lens
    dtype = BF16 if causal else F16
    h, hkv, hd = 4, 2, 96
    q, k, v, cu_q, cu_k, dcu_q, dcu_k = _pack_varlen(rng, lens_q, lens_k, h, hkv, hd, dtype)
    out = _poisoned(q.shape, dtype)
    _, lse = cuattn.flash_varlen_forward(q, k, v, dcu_q, dcu_k, max(lens_q), max(lens_k),
                                         causal=causal, return_lse=True, out=out,
                                         num_splits=num_splits)
    assert lse.shape == (h, q.shape[0])
    for b in range(len(lens_q)):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        check_close(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe], k[None, ks:ke],
                    v[None, ks:ke], causal=causal)
    assert not bool(cupy.isnan(out).any())


@pytest.mark.gpu
@pytest.mark.parametrize("hd,sq,sk,causal", [(128, 1, 8192, False), (64, 16, 5000, True),
                                             (256, 3, 3000, False), (96, 200, 4096, True)])
def test_num_splits_match_unsplit(rng, hd, sq, sk, causal):
    import cupy
    dtype = BF16
    q = _randn(rng, (2, sq, 8, hd), dtype)
    k = _randn(rng, (2, sk, 2, hd), dtype)
    v = _randn(rng, (2, sk, 2, hd), dtype)
    base, base_lse = cuattn.flash_forward(q, k, v, causal=causal, num_splits=1, return_lse=True)
    for n in (0, 2, 7):
        out = _poisoned(q.shape, dtype)
        _, lse = cuattn.flash_forward(q, k, v, causal=causal, num_splits=n, return_lse=True,
                                      out=out)
        diff = float(cupy.abs(out.astype(np.float32) - base.astype(np.float32)).max())
        assert diff <= 2 * _floor(dtype), (n, diff)
        assert float(cupy.abs(lse - base_lse).max()) <= 1e-3
    check_close(out, lse, q, k, v, causal=causal)


# More row tiles than an H200 has SMs: the Hopper kernel's blocks each walk several of them
# (under a causal or window mask in heavy + light pairs; an odd count per head leaves a
# middle tile alone), across heads and batch entries; sq != sk moves the diagonal. The
# window bounds both sides and excludes keys on each ("w").
_MANY_TILES = [(64, 1200, 1300), (128, 1100, 900), (256, 600, 1400)]
_MANY_TILES_MASKS = {"nc": (False, (-1, -1)), "c": (True, (-1, -1)), "w": (False, (300, 17))}


@pytest.mark.gpu
@pytest.mark.parametrize("hd,sq,sk", _MANY_TILES, ids=[f"d{h}-{a}x{b}" for h, a, b in _MANY_TILES])
@pytest.mark.parametrize("mask", list(_MANY_TILES_MASKS))
@pytest.mark.parametrize("num_splits", [1, 2])
def test_more_row_tiles_than_sms(rng, flash_path, hd, sq, sk, mask, num_splits):
    import cupy
    causal, window = _MANY_TILES_MASKS[mask]
    batch, h, hkv = 4, 16, 4
    if flash_path == "wgmma":
        kind = _mask_and_bounds(window[0], 0 if causal else window[1], sq, sk)[0]
        v = tuning.flash_kernel_variant("bf16", hd, mask=kind, split=num_splits > 1,
                                        arch="sm_90", features=0, tma=True, seqlen_q=sq)
        m_blocks = -(-sq // v.block_m)
        # (hd64's window form takes 128-row tiles, an even count: pairs alone)
        assert m_blocks % 2 == 1 or (mask, hd) == ("w", 64), "a pair's middle tile alone"
        assert v.pairs_tiles == (mask != "nc")
        items = (-(-m_blocks // 2) if v.pairs_tiles else m_blocks) * h * batch * num_splits
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        assert items > sms, (items, sms)
    q = _randn(rng, (batch, sq, h, hd), BF16)
    k = _randn(rng, (batch, sk, hkv, hd), BF16)
    v = _randn(rng, (batch, sk, hkv, hd), BF16)
    out = _poisoned(q.shape, BF16)
    _, lse = cuattn.flash_forward(q, k, v, causal=causal, window_size=window,
                                  num_splits=num_splits, return_lse=True, out=out)
    check_close(out, lse, q, k, v, causal=causal, window=window)


# Varlen calls with more row tiles than an H200 has SMs, odd lengths and empty sequences,
# called twice on a cold L2: the Hopper kernel's TMA forms of two consumer warpgroups run
# them on a persistent grid whose blocks fetch the tiles from a counter (every call zeroes
# it), three-warpgroup forms (hd64) one block per tile. Causal masks with key tiles smaller
# than the row tiles put the sequence's edge tile late in a tile's walk, where a producer
# thread that skipped the V ring's earlier phases once took a stale one (bench/NOTES.md).
_MANY_VARLEN_Q = [0, 700, 1, 2100, 37, 0, 1500, 129, 513, 1023, 64, 300]
_MANY_VARLEN_K = [5, 800, 1, 2100, 237, 0, 1500, 329, 513, 1123, 264, 300]


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["nc", "c"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_varlen_more_row_tiles_than_sms(rng, flash_path, hd, causal, num_splits):
    import cupy
    h, hkv = 4, 2
    lens_q, lens_k = _MANY_VARLEN_Q, _MANY_VARLEN_K
    if flash_path == "wgmma":
        v = tuning.flash_kernel_variant("bf16", hd, mask=MASK_CAUSAL if causal else MASK_NONE,
                                        split=num_splits > 1, arch="sm_90", features=0, tma=True,
                                        seqlen_q=max(lens_q))
        assert v.fetches_varlen == (v.block_m == 128)
        tiles = sum(-(-n // v.block_m) for n in lens_q) * h * num_splits
        assert tiles > cupy.cuda.Device().attributes["MultiProcessorCount"], tiles
    q, k, v, cu_q, cu_k, dcu_q, dcu_k = _pack_varlen(rng, lens_q, lens_k, h, hkv, hd, BF16)
    l2 = cupy.empty(256 << 20, dtype=np.uint8)
    for i in range(2):
        l2.fill(i)   # a cold L2 for each call (the failure above needed slow first loads)
        out = _poisoned(q.shape, BF16)
        _, lse = cuattn.flash_varlen_forward(q, k, v, dcu_q, dcu_k, max(lens_q), max(lens_k),
                                             causal=causal, return_lse=True, out=out,
                                             num_splits=num_splits)
        for b in range(len(lens_q)):
            qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
            if qe > qs:
                check_close(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe],
                            k[None, ks:ke], v[None, ks:ke], causal=causal)
        assert not bool(cupy.isnan(out).any())


# Varlen windows with narrow key tiles (hd 192: 64 keys, hd 256: 48 keys per tile): the
# visiting order puts a sequence's edge tile (crossing its end) after the left and right
# boundary tiles, 2 x STAGES or more steps into the walk of its last row tile (these
# lengths), where a producer thread copying that V tile must not take a stale phase of the
# V ring for its own (flash_fwd_sm90.cuh tma_produce).
_EDGE_LATE = [499, 1206, 77, 1157]


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [192, 256])
@pytest.mark.parametrize("window", [(300, 0), (1000, 50)], ids=["w300_0", "w1000_50"])
def test_varlen_windows_with_narrow_key_tiles(rng, flash_path, hd, window):
    import cupy
    h, hkv = 4, 2
    q, k, v, cu_q, cu_k, dcu_q, dcu_k = _pack_varlen(rng, _EDGE_LATE, _EDGE_LATE, h, hkv, hd,
                                                     BF16)
    l2 = cupy.empty(256 << 20, dtype=np.uint8)
    for i in range(2):
        l2.fill(i)   # a cold L2: slow first loads leave the consumers behind the producer
        out = _poisoned(q.shape, BF16)
        _, lse = cuattn.flash_varlen_forward(q, k, v, dcu_q, dcu_k, max(_EDGE_LATE),
                                             max(_EDGE_LATE), window_size=window,
                                             return_lse=True, out=out)
        for b in range(len(_EDGE_LATE)):
            qs, qe = cu_q[b], cu_q[b + 1]
            check_close(out[None, qs:qe], lse[None, :, qs:qe], q[None, qs:qe], k[None, qs:qe],
                        v[None, qs:qe], window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_two_identical_calls_are_bit_identical(rng, num_splits):
    q = _randn(rng, (2, 333, 4, 128), BF16)
    k = _randn(rng, (2, 1500, 4, 128), BF16)
    v = _randn(rng, (2, 1500, 4, 128), BF16)
    a, la = cuattn.flash_forward(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    b, lb = cuattn.flash_forward(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    assert bool((a.view(np.uint16) == b.view(np.uint16)).all())
    assert bool((la.view(np.uint32) == lb.view(np.uint32)).all())


@pytest.mark.gpu
def test_stream_argument_and_empty_batch(rng):
    import cupy
    q = _randn(rng, (1, 64, 2, 64), F16)
    s = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()   # (q's copy: a non-blocking stream does not wait for it)
    out = cuattn.flash_forward(q, q, q, stream=s)
    s.synchronize()
    check_close(out, None, q, q, q)
    empty = cupy.empty((0, 10, 2, 64), F16)
    assert cuattn.flash_forward(empty, empty, empty).shape == (0, 10, 2, 64)


# ---- GPU: every knob tile, against the reference -----------------------------------------------

# Every KNOB_TILES entry through a few shapes: odd lengths, causal (bottom-right, sq != sk), a
# window, split-KV, a head dim below the compiled one (zero-filled tail columns), GQA; fp16
# and bf16. (seqlen_q, seqlen_k, causal, window, num_splits, head dim below the compiled one)
_KNOB_CASES = [(113, 203, False, (-1, -1), 1, 0), (113, 203, True, (-1, -1), 1, 0),
               (1024, 1023, True, (-1, -1), 1, 8), (2048, 2048, False, (-1, -1), 1, 0),
               (300, 777, False, (64, 32), 1, 0), (77, 3000, True, (-1, -1), 3, 0)]
_KNOB_SWEEP = [(hd, t, case) for hd, ts in KNOB_TILES.items() for t in ts
               for case in _KNOB_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hd,tiles,case", _KNOB_SWEEP,
    ids=[f"hd{h}-{label(t)}-{c[0]}x{c[1]}{'-c' if c[2] else ''}"
         f"{'-win' if c[3] != (-1, -1) else ''}{f'-split{c[4]}' if c[4] > 1 else ''}"
         f"{f'-d{h - c[5]}' if c[5] else ''}" for h, t, c in _KNOB_SWEEP])
def test_knobs(rng, hd, tiles, case):
    sq, sk, causal, window, num_splits, short = case
    idx = _KNOB_SWEEP.index((hd, tiles, case))
    dtype = (BF16, F16)[idx % 2]
    d = hd - short
    batch = 1 if sq * sk > 1 << 20 else 2
    q = _randn(rng, (batch, sq, 4, d), dtype)
    k = _randn(rng, (batch, sk, 2, d), dtype)
    v = _randn(rng, (batch, sk, 2, d), dtype)
    out = _poisoned(q.shape, dtype)
    with tuning.override(flash_tiles=tiles):
        _, lse = cuattn.flash_forward(q, k, v, causal=causal, window_size=window,
                                      return_lse=True, num_splits=num_splits, out=out)
    check_close(out, lse, q, k, v, causal=causal, window=window)
