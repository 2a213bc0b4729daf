"""The Hopper forward kernel (cuda_src/flash_fwd_sm90.cuh, wgmma, sm_90a): CPU checks.

Its GPU tests are tests/test_flash.py's (every GPU test there runs on both kernels) and the
flash hook tests of tests/test_prefill.py; the fuzz of flash_forward / flash_varlen_forward
runs on whatever kernel the device takes (this one on an H200).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cuattn import tuning
from cuattn.tuning import FlashSm90Tiles
from cuattn.constants import (FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, MASK_CAUSAL, MASK_NONE,
                              MASK_WINDOW)
from cuattn.keys import FlashFwdSm90Variant, FlashFwdVariant
from tests.compiled import compile_reports, unclean

ROOT = Path(__file__).resolve().parent.parent
HOOKS = FEAT_SOFTCAP | FEAT_ALIBI | FEAT_SINKS


def test_wgmma_header_is_the_generators_output():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "scripts" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEADER.read_text() == gen.render(), "run python scripts/gen_wgmma.py"
    assert gen.FP8_HEADER.read_text() == gen.render_fp8(), "run python scripts/gen_wgmma.py"


# Every mask and split of the TMA forms (what calls reach; the tile rule gives hooked,
# windowed and cp.async forms their own tiles), each without hooks, with each hook alone and
# with all three (the pairs lie between: left out to keep CI's compile time in bounds), and
# the cp.async forms without and with every hook.
_HOOK_SETS = (0, FEAT_SOFTCAP, FEAT_ALIBI, FEAT_SINKS, HOOKS)
_FORMS = [(dt, hd, mask, split, features, True)
          for hd in sorted(tuning.FLASH_SM90_TILES) for mask in (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
          for split in (False, True) for features in _HOOK_SETS for dt in ("bf16",)] + \
         [(dt, hd, mask, split, features, False)
          for hd in sorted(tuning.FLASH_SM90_TILES) for mask in (MASK_NONE, MASK_CAUSAL)
          for split in (False, True) for features in (0, HOOKS) for dt in ("bf16",)]


def _variants(forms) -> list:
    return [tuning.flash_sm90_variant(dt, hd, mask=mask, split=split, features=f, tma=tma)
            for dt, hd, mask, split, f, tma in forms]


def _check_clean(variants) -> None:
    reports = compile_reports(variants, "sm_90")
    assert unclean(reports) == []
    # setmaxnreg moves registers within the block's launch allocation: the traits' split
    # (static_assert) counts on every thread launching with all 65536 / threads of them
    assert [v.name for v, r in reports if r.registers != 65536 // v.num_threads // 8 * 8] == []


@pytest.mark.slow
def test_every_form_compiles_for_sm90a_without_spills():
    forms = _variants(_FORMS)
    forms.append(tuning.flash_sm90_variant("f16", 128, mask=MASK_CAUSAL, split=False, tma=True))
    forms += [tuning.flash_sm90_variant("bf16", hd, mask=MASK_CAUSAL, split=split, tma=True,
                                        seqlen_q=1)
              for hd in tuning.FLASH_SM90_SHORT_CAUSAL for split in (False, True)]
    _check_clean(forms)


def test_a_few_forms_compile_for_sm90a_without_spills():
    """The default run's share of the sweep above: at the smallest and largest head dims,
    the plain unmasked form and the split causal and window forms with every hook, loading
    by TMA and by cp.async (whose forms have no window)."""
    ends = (min(tuning.FLASH_SM90_TILES), max(tuning.FLASH_SM90_TILES))
    _check_clean(_variants([(dt, hd, mask, split, f, tma) for dt, hd, mask, split, f, tma in _FORMS
                            if hd in ends and (mask, split, f) in
                            ((MASK_NONE, False, 0), (MASK_WINDOW, True, HOOKS),
                             (MASK_CAUSAL, True, HOOKS))]))


def test_tma_forms_take_the_tensor_maps():
    """Every Hopper form takes FlashTmaMaps and FlashSm90Schedule after its params (zeros
    for cp.async forms and calls without a fetched schedule), and the TMA form's name says
    so."""
    v = tuning.flash_sm90_variant("bf16", 128, mask=MASK_CAUSAL, split=False, tma=True)
    assert v.name == "cuattn_flash_fwd_sm90__bf16_hd128_bm128_bn128_st2_tma_c1"
    for form in (v, tuning.flash_sm90_variant("bf16", 128, mask=MASK_CAUSAL, split=False)):
        src = form.source()
        assert "const __grid_constant__ cuattn::FlashTmaMaps maps" in src
        assert "const __grid_constant__ cuattn::FlashSm90Schedule sched" in src
        assert "flash_fwd_sm90_kernel<Traits>(params, maps, sched);" in src
        assert f"Traits::FETCH_VARLEN == {str(form.fetches_varlen).lower()}" in src
    from cuattn import _tma
    assert _tma.MAPS_DTYPE.itemsize == 3 * 128 and _tma.no_maps([])[0].tobytes() == bytes(384)
    assert _tma.no_maps([])[1].nbytes == 8 and int(_tma.no_maps([])[1]) == 0
    # the driver's enumerators, spelled by hand for the ctypes call
    from cuda.bindings import driver as d
    assert _tma.DATA_TYPE == {"f16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                              "bf16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                              "e4m3": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8}
    swizzles = d.CUtensorMapSwizzle
    assert (_tma.SWIZZLE_NONE, _tma.SWIZZLE_32B, _tma.SWIZZLE_128B) == (
        swizzles.CU_TENSOR_MAP_SWIZZLE_NONE, swizzles.CU_TENSOR_MAP_SWIZZLE_32B,
        swizzles.CU_TENSOR_MAP_SWIZZLE_128B)
    assert (_tma.INTERLEAVE_NONE, _tma.L2_PROMOTION_256B,
            _tma.OOB_FILL_ZERO) == (d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def test_tensor_map_rule_and_dims():
    """fits(): positive strides below 2**40 bytes on every dimension longer than one; the map
    of a (batch, rows, heads, head dim) view lists the dims innermost first, byte strides of
    rows, heads, batch (16 where a dimension of one is never stepped), 64-column boxes."""
    import numpy as np
    from cuattn import _tma
    x = np.zeros((2, 100, 8, 96), np.float16)
    assert _tma.fits(x)
    t = _tma._Tensor.of(x, 128)
    assert t.dims == (96, 100, 8, 2) and t.strides == (8 * 96 * 2, 96 * 2, 100 * 8 * 96 * 2)
    assert t.box == (64, 128, 1, 1)
    view = np.zeros((1, 50, 3, 64), np.float16)[:, :, ::2]         # heads 0 and 2
    assert _tma._Tensor.of(view, 64).strides == (3 * 64 * 2, 2 * 64 * 2, 16)
    assert not _tma.fits(np.zeros((2, 9, 4, 64), np.float16)[:, ::-1])     # negative stride
    assert not _tma.fits(np.broadcast_to(np.zeros((1, 9, 4, 64), np.float16), (3, 9, 4, 64)))
    assert _tma.fits(np.broadcast_to(np.zeros((1, 9, 4, 64), np.float16), (1, 9, 4, 64)))


def test_vllm_tensor_maps():
    """vLLM's paged K (num_blocks, kvh, hd / 8, block, 8) and V (num_blocks, kvh, hd, block)
    as 5-d maps: K's dims (8 tokens x 8 columns, chunk, token group, KV head, cache block)
    with the chunk's stride before the group's, no swizzle; V's (16 tokens, dim, 16-token
    group, KV head, cache block) with 32-byte swizzle, or for blocks of 8 (8 dims x 8 tokens,
    8-dim group, 1, KV head, cache block) without; boxes of the compiled head dim and a cache
    block's tokens (V: at most 16). A K cache whose tokens are not 16 bytes apart is not
    described (_fits_vllm)."""
    import numpy as np
    from cuattn import _tma
    k = np.zeros((10, 2, 112 // 8, 32, 8), np.float16)
    v = np.zeros((10, 2, 112, 32), np.float16)
    tk, tv = _tma._Tensor.vllm_k(k, 32, 128), _tma._Tensor.vllm_v(v, 16, 128)
    assert tk.dims == (64, 14, 4, 2, 10) and tk.box == (64, 16, 4, 1, 1)
    assert tk.strides == (32 * 16, 128, 14 * 32 * 16, 2 * 14 * 32 * 16)
    assert tk.swizzle == _tma.SWIZZLE_NONE
    assert tv.dims == (16, 112, 2, 2, 10) and tv.box == (16, 128, 1, 1, 1)
    assert tv.strides == (32 * 2, 32, 112 * 32 * 2, 2 * 112 * 32 * 2)
    assert tv.swizzle == _tma.SWIZZLE_32B
    v8 = np.zeros((10, 2, 112, 8), np.float16)
    t8 = _tma._Tensor.vllm_v(v8, 8, 128)
    assert t8.dims == (64, 14, 1, 2, 10) and t8.box == (64, 16, 1, 1, 1)
    assert t8.strides == (128, 16, 112 * 8 * 2, 2 * 112 * 8 * 2)
    assert t8.swizzle == _tma.SWIZZLE_NONE
    assert _tma._Tensor.vllm_k(k[:, :1], 8, 128).strides[2] == 16    # one KV head: never stepped
    assert _tma._fits_vllm(k, v)
    wide = np.zeros((10, 2, 14, 32, 16), np.float16)[..., :8]          # tokens 32 bytes apart
    assert not _tma._fits_vllm(wide, v)
    # the tensor maps' V box and the kernel's rule (v_box_rows) agree
    assert "VLLM_V_BOX = 16;" in (ROOT / "cuda_src" / "flash_fwd_sm90.cuh").read_text()
    assert _tma.VLLM_V_BOX == 16


def test_tiles_fit_shared_memory_and_the_heavy_rule():
    for hd, t in tuning.FLASH_SM90_TILES.items():
        heavy = tuning.FLASH_SM90_TILES_HEAVY.get(hd, t)
        for mask, features, tma, want in (
                (MASK_NONE, 0, True, t), (MASK_CAUSAL, FEAT_SINKS, True, t),
                (MASK_WINDOW, 0, True, heavy), (MASK_CAUSAL, FEAT_SOFTCAP, True, heavy),
                (MASK_NONE, FEAT_ALIBI, True, heavy), (MASK_NONE, 0, False, heavy)):
            v = tuning.flash_sm90_variant("bf16", hd, mask=mask, split=False, features=features,
                                          tma=tma)
            assert v.dynamic_smem_bytes <= 227 * 1024, hd
            assert v.num_threads == 128 * (1 + v.block_m // 64) <= 512, hd
            assert (v.block_m, v.block_n, v.stages) == (want.block_m, want.block_n, want.stages)


def test_the_short_causal_rule():
    """Causal calls up to FLASH_SM90_SHORT_CAUSAL's query length take the heavy tiles at its
    head dims; longer ones, unmasked ones and other head dims the default tiles."""
    for hd, longest in tuning.FLASH_SM90_SHORT_CAUSAL.items():
        heavy, default = tuning.FLASH_SM90_TILES_HEAVY[hd], tuning.FLASH_SM90_TILES[hd]
        for seqlen_q, mask, want in ((longest, MASK_CAUSAL, heavy), (1, MASK_CAUSAL, heavy),
                                     (longest + 1, MASK_CAUSAL, default),
                                     (None, MASK_CAUSAL, default), (1, MASK_NONE, default)):
            v = tuning.flash_kernel_variant("bf16", hd, mask=mask, split=False, arch="sm_90",
                                            tma=True, seqlen_q=seqlen_q)
            assert (v.block_m, v.block_n, v.stages) == \
                (want.block_m, want.block_n, want.stages), (hd, seqlen_q, mask)
    assert 128 not in tuning.FLASH_SM90_SHORT_CAUSAL
    v = tuning.flash_kernel_variant("bf16", 128, mask=MASK_CAUSAL, split=False, arch="sm_90",
                                    tma=True, seqlen_q=1)
    assert v.block_m == tuning.FLASH_SM90_TILES[128].block_m


def test_the_grid_rule():
    """Dense calls: one block per SM at most, over items that pair row tiles under a causal
    mask (9 tiles: 4 pairs and a middle one); varlen calls of TMA forms with two consumer
    warpgroups: one block per SM at most over the row tiles (fetched); other varlen calls
    one block per row tile."""
    causal = tuning.flash_sm90_variant("bf16", 128, mask=MASK_CAUSAL, split=False, tma=True)
    full = tuning.flash_sm90_variant("bf16", 128, mask=MASK_NONE, split=False, tma=True)
    assert causal.grid(9, 1, 1, varlen=False, sm_count=132) == (5,)
    assert full.grid(9, 1, 1, varlen=False, sm_count=132) == (9,)
    assert causal.grid(9, 16, 4, varlen=False, sm_count=132) == (132,)
    assert causal.grid(9, 16, 4, varlen=True, sm_count=132) == (132,)
    assert causal.grid(9, 1, 4, varlen=True, sm_count=132) == (36,)
    cp_async = tuning.flash_sm90_variant("bf16", 128, mask=MASK_CAUSAL, split=False)
    assert cp_async.grid(9, 16, 4, varlen=True, sm_count=132) == (9, 16, 4)
    three = FlashFwdSm90Variant("bf16", 64, 192, 128, 2, MASK_CAUSAL, False, 0, True)
    assert causal.fetches_varlen and not cp_async.fetches_varlen and not three.fetches_varlen
    assert three.grid(9, 16, 4, varlen=True, sm_count=132) == (9, 16, 4)


def test_the_path_rule():
    assert tuning.flash_path("sm_90", 128) == "wgmma"
    assert tuning.flash_path("sm_90", 64) == "wgmma"
    assert tuning.flash_path("sm_90", 32) == "mma"      # hd <= 32 stays on mma.sync
    assert tuning.flash_path("sm_80", 128) == "mma"
    assert tuning.flash_path("sm_89", 256) == "mma"
    assert tuning.sm90_head_dim(96) == 128 and tuning.sm90_head_dim(200) == 256
    with tuning.override(flash_path="mma"):
        assert tuning.flash_path("sm_90", 128) == "mma"
    with tuning.override(flash_tiles=tuning.FlashTiles(64, 64, 4, 2)):
        assert tuning.flash_path("sm_90", 128) == "mma"   # forced mma.sync tiles
    with tuning.override(flash_path="wgmma"):
        assert tuning.flash_path("sm_90", 32) == "wgmma"
        with pytest.raises(ValueError, match="sm_90"):
            tuning.flash_path("sm_86", 128)
    with pytest.raises(ValueError, match="flash_path"):
        with tuning.override(flash_path="tensor"):
            pass


def test_variant_names_targets_and_the_shipped_set():
    v = tuning.flash_sm90_variant("bf16", 96, mask=MASK_CAUSAL, split=True, features=HOOKS)
    assert v.name == "cuattn_flash_fwd_sm90__bf16_hd128_bm128_bn128_st2_c1_split_cap_alibi_sink"
    assert v.target_arch("sm_90") == "sm_90a" and v.runs_on("sm_90") and not v.runs_on("sm_80")
    with tuning.override(flash_sm90_tiles=FlashSm90Tiles(64, 64, 3)):
        assert tuning.flash_sm90_variant("f16", 64, mask=MASK_NONE, split=False).block_m == 64
    from cuattn import shipped as shipped_set
    on_80 = shipped_set.shipped(["flash"], "sm_80")
    on_90 = shipped_set.shipped(["flash"], "sm_90")
    assert not any(isinstance(x, FlashFwdSm90Variant) for x in on_80)
    assert any(isinstance(x, FlashFwdSm90Variant) for x in on_90)
    assert any(isinstance(x, FlashFwdVariant) for x in on_90)   # forced mma.sync, hd32
    with pytest.raises(ValueError, match="FlashFwdSm90Variant"):
        FlashFwdSm90Variant("bf16", 96, 128, 64, 2, MASK_NONE, False)
