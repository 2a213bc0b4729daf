"""The shipped set: every variant a default call with a shipped size reaches, for any
architecture: what ``python -m cuattn precompile`` builds (``shipped()``), per op
(``SHIPPED``). The choices themselves are cuattn.tuning's and cuattn.tuning_bwd's.
"""
from __future__ import annotations

from collections.abc import Callable

from . import tuning, tuning_bwd
from .constants import MASK_CAUSAL, MASK_NONE, SM90_ARCH
from .jit import Variant

FLASH_SHIPPED_HEAD_DIMS = (64, 96, 128, 256)
MERGE_SHIPPED_HEAD_SIZES = (64, 128, 256)
# Shipped (precompiled) paged set: 16-bit caches of the activation dtype x these head sizes
# x block 16 x groups x v1 and every v2 partition (what "auto" reaches).
PAGED_SHIPPED_HEAD_SIZES = (64, 128, 256)
PAGED_SHIPPED_BLOCK_SIZES = (16,)
PAGED_SHIPPED_GROUPS = (1, 4, 8)


def _shipped_flash() -> list:
    out = []
    for dt in ("f16", "bf16"):
        for hd in FLASH_SHIPPED_HEAD_DIMS:
            for arch in tuning.FLASH_TABLE_ARCHS:
                for mask in (MASK_NONE, MASK_CAUSAL):
                    for split in (False, True):    # num_splits=0 splits small grids
                        out.append(tuning.flash_forward_variant(dt, hd, mask=mask,
                                                                split=split, arch=arch))
            for mask in (MASK_NONE, MASK_CAUSAL):
                for split in (False, True):
                    # (the cp.async form, for strides no tensor map takes, compiles on use;
                    # seqlen_q 1: the short causal tiles)
                    for seqlen_q in (None, 1):
                        out.append(tuning.flash_sm90_variant(dt, hd, mask=mask, split=split,
                                                             tma=True, seqlen_q=seqlen_q))
            out.append(tuning.flash_combine_variant(dt, hd))
    return out + _shipped_flash_backward()


def _shipped_flash_backward() -> list:
    """flash_backward at head dims 64 and 128, causal or not: the Hopper kernel (sm_90), the
    mma.sync kernel of both tables' tiles (sm_80, sm_86), and its row kernels (a training
    step's defaults)."""
    out = []
    for dt in ("f16", "bf16"):
        for hd in (64, 128):
            out += [tuning_bwd.flash_bwd_variant(dt, hd, mask=mask, arch=arch)
                    for arch in (SM90_ARCH, "sm_80", "sm_86")
                    for mask in (MASK_NONE, MASK_CAUSAL)]
            out += tuning_bwd.flash_bwd_row_variants(dt, hd)
    return out


def _shipped_merge() -> list:
    return [tuning.merge_variant(dt, hs, stacked) for dt in ("f16", "bf16")
            for hs in MERGE_SHIPPED_HEAD_SIZES for stacked in (False, True)]


def _shipped_paged() -> list:
    out = []
    for dt in ("f16", "bf16"):
        for hs in PAGED_SHIPPED_HEAD_SIZES:
            for bs in PAGED_SHIPPED_BLOCK_SIZES:
                for g in PAGED_SHIPPED_GROUPS:
                    for ps in (0,) + tuning.PAGED_PARTITION_SIZES:
                        if tuning.paged_form(dt, hs, g) == "mma":
                            out.append(tuning.paged_mma_variant(dt, hs, bs, g, ps, False))
                        else:
                            out.append(tuning.paged_simt_variant(dt, dt, hs, bs, g, ps, False))
            out.append(tuning.paged_reduce_variant(dt, hs))
        for slot64 in (False, True):
            out.append(tuning.reshape_variant(dt, dt, slot64))
    out.append(tuning.flashinfer_tables_variant())
    return out


SHIPPED: dict[str, Callable[[], list]] = {
    "flash": _shipped_flash,
    "merge": _shipped_merge,
    "paged": _shipped_paged,
}


def shipped(ops: list[str] | None = None, arch: str | None = None) -> list[Variant]:
    """What ``python -m cuattn precompile`` builds: every variant a default call with a
    shipped size reaches (SHIPPED has the lists), for any architecture, or (``arch``) those
    a device of that architecture can run."""
    ops = list(SHIPPED) if not ops else ops
    unknown = [op for op in ops if op not in SHIPPED]
    if unknown:
        raise ValueError(f"--ops: unknown op(s) {unknown}; known: {sorted(SHIPPED)}")
    out: dict[Variant, None] = {}
    for op in ops:
        out.update(dict.fromkeys(SHIPPED[op]()))
    return [v for v in out if arch is None or v.runs_on(arch)]
