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
from cuattn.variants import (FEAT_ALIBI, FEAT_SINKS, FEAT_SOFTCAP, MASK_CAUSAL, MASK_NONE,
                             MASK_WINDOW, FlashFwdSm90Variant, FlashFwdVariant)
from tests.compiled import compile_reports, unclean

ROOT = Path(__file__).resolve().parent.parent
HOOKS = FEAT_SOFTCAP | FEAT_ALIBI | FEAT_SINKS


def test_wgmma_header_is_the_generators_output():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "scripts" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEADER.read_text() == gen.render(), "run python scripts/gen_wgmma.py"


_FORMS = [(dt, hd, mask, split, features)
          for hd in sorted(tuning.FLASH_SM90_TILES) for mask in (MASK_NONE, MASK_CAUSAL, MASK_WINDOW)
          for split in (False, True) for features in (0, HOOKS) for dt in ("bf16",)]


@pytest.mark.slow
def test_every_form_compiles_for_sm90a_without_spills():
    forms = [tuning.flash_sm90_variant(dt, hd, mask=mask, split=split, features=f)
             for dt, hd, mask, split, f in _FORMS]
    forms.append(tuning.flash_sm90_variant("f16", 128, mask=MASK_CAUSAL, split=False))
    assert unclean(compile_reports(forms, "sm_90")) == []


def test_tiles_fit_shared_memory_and_registers():
    for hd, t in tuning.FLASH_SM90_TILES.items():
        v = tuning.flash_sm90_variant("bf16", hd, mask=MASK_NONE, split=False)
        assert v.dynamic_smem_bytes <= 227 * 1024, hd
        assert v.num_threads * 168 <= 65536 or v.num_threads <= 256, hd
        assert (v.block_m, v.block_n, v.stages) == (t.block_m, t.block_n, t.stages)


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
    from cuattn import variants
    on_80 = variants.shipped(["flash"], "sm_80")
    on_90 = variants.shipped(["flash"], "sm_90")
    assert not any(isinstance(x, FlashFwdSm90Variant) for x in on_80)
    assert any(isinstance(x, FlashFwdSm90Variant) for x in on_90)
    assert any(isinstance(x, FlashFwdVariant) for x in on_90)   # forced mma.sync, hd32
    with pytest.raises(ValueError, match="FlashFwdSm90Variant"):
        FlashFwdSm90Variant("bf16", 96, 128, 64, 2, MASK_NONE, False)
