"""The backward's launch-shape choices (flash_backward / flash_varlen_backward), beside
cuattn.tuning (the forward's and the other ops'), whose ``override`` forces them too
(``flash_bwd_tiles``; cuattn._overrides holds what it forces). Each choice carries its
measurement, or says it is a first guess.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _overrides, tuning
from .constants import FEAT_ALIBI, FEAT_SOFTCAP, SM90_ARCH
from .keys import (FlashBwdDqVariant, FlashBwdDsinksVariant, FlashBwdPrepVariant,
                   FlashBwdSm90Variant, FlashBwdVariant)
from .tuning import compiled_head_dim, sm90_head_dim


@dataclass(frozen=True)
class FlashBwdTiles:
    block_m: int      # query rows per tile (a multiple of 32)
    num_warps: int    # 16 keys per warp: BLOCK_N = 16 x num_warps
    q_chunk: int      # queries whose S^T and dP^T a warp holds at once (divides block_m)


# (compiled head dim) -> FlashBwdTiles, by shared memory per block. Shared memory = K and V
# tiles + 2 x (Q and dO tiles) + the dS^T tile (FlashBwdVariant.dynamic_smem_bytes);
# registers: dK and dV of a warp's 16 keys (HEAD_DIM / 2 each) + two q_chunk / 2 score tiles
# within 255 (above head dim 128 the kernel walks the query tiles twice, dV then dK). First
# guesses from the ptxas report at sm_90 and each family's limit (sm_90 227 KB, sm_80 163 KB,
# sm_86 / sm_89 99 KB per block).
_BWD_BIG_SMEM = {          # sm_90 (and sm_80 but hd256)
    32: FlashBwdTiles(64, 8, 64),
    64: FlashBwdTiles(128, 8, 32),
    96: FlashBwdTiles(64, 8, 32),
    128: FlashBwdTiles(64, 8, 32),
    160: FlashBwdTiles(32, 4, 32),
    192: FlashBwdTiles(32, 8, 32),
    256: FlashBwdTiles(32, 8, 16),
}
_BWD_SM80 = dict(_BWD_BIG_SMEM)
_BWD_SM80[256] = FlashBwdTiles(32, 4, 16)    # 200 KB at sm_90's tiles
_BWD_SMALL_SMEM = {        # sm_86, sm_89
    32: FlashBwdTiles(64, 4, 64),
    64: FlashBwdTiles(64, 4, 32),
    96: FlashBwdTiles(32, 4, 16),
    128: FlashBwdTiles(32, 4, 16),
    160: FlashBwdTiles(32, 2, 32),
    192: FlashBwdTiles(32, 2, 32),
    256: FlashBwdTiles(32, 2, 16),
}


# Head dims the backward is compiled for: the forward's (multiples of 32) but 224, which runs
# as 256: its 28-chunk rows split into neither the dQ column groups of 8 warps nor two
# groups' registers of 4 (168 B of spills at 32 x 4 warps).
BWD_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)


def bwd_head_dim(head_dim: int) -> int:
    """The head dim the backward kernels are compiled for (a real one rounded up)."""
    return next(hd for hd in BWD_HEAD_DIMS if hd >= compiled_head_dim(head_dim))


def flash_bwd_tiles(arch: str, head_dim: int) -> FlashBwdTiles:
    forced = _overrides.get("flash_bwd_tiles")
    if forced is not None:
        return forced
    if arch in ("sm_86", "sm_87", "sm_89"):
        table = _BWD_SMALL_SMEM
    else:
        table = _BWD_BIG_SMEM if arch == SM90_ARCH else _BWD_SM80
    return table[head_dim]


# ---- the Hopper backward kernel (cuda_src/flash_bwd_sm90.cuh, sm_90a) ---------------------------
# sm_90 devices run it where the forward runs its Hopper kernel (tuning.flash_path: head dims
# above 32, compiled rounded up to a multiple of 64); override(flash_bwd_tiles=...) forces the
# mma.sync kernel.
@dataclass(frozen=True)
class FlashBwdSm90Tiles:
    block_m: int      # query rows per tile (a multiple of 64)
    num_wg: int       # warpgroups of 64 keys: BLOCK_N = 64 x num_wg


# FlashAttention-3's tile shapes where a consumer warpgroup's registers hold them (dK and dV
# of 64 keys: HEAD_DIM / 2 accumulators each, S^T and dP^T BLOCK_M / 2 each); above head dim
# 128 one consumer warpgroup of 64 keys walks the query tiles twice (dV, then dK and dQ), in
# 227 KB of shared memory. At hd64 (128, 2) beat (64, 1) by 1.4-1.5x (bench/lab/
# bwd_sm90_sweep.py, bench/NOTES.md "Hopper backward").
FLASH_BWD_SM90_TILES = {
    64: FlashBwdSm90Tiles(128, 2),
    128: FlashBwdSm90Tiles(64, 2),
    192: FlashBwdSm90Tiles(64, 1),
    256: FlashBwdSm90Tiles(64, 1),
}


# The compiled head dims the Hopper kernel runs by default: all of them (the two-pass forms at
# 192 and 256 beat mma.sync's too: bench/lab/bwd_sm90_sweep.py, bench/NOTES.md).
FLASH_BWD_SM90_DEFAULT = (64, 128, 192, 256)


def flash_bwd_path(arch: str, head_dim: int) -> str:
    """"wgmma" (the Hopper kernel) or "mma" (mma.sync) for the backward of a real head dim on
    a device of ``arch``: override(flash_path=...) forces either (override(flash_bwd_tiles=...)
    "mma"); else the forward's path (tuning.flash_path) at FLASH_BWD_SM90_DEFAULT's head
    dims."""
    forced = _overrides.get("flash_path")
    if forced is None and _overrides.has("flash_bwd_tiles"):
        return "mma"
    path = tuning.flash_path(arch, head_dim)
    if forced is None and sm90_head_dim(head_dim) not in FLASH_BWD_SM90_DEFAULT:
        return "mma"
    return path


def flash_bwd_variant(dtype: str, head_dim: int, *, mask: int, arch: str,
                      features: int = 0) -> FlashBwdVariant | FlashBwdSm90Variant:
    """The backward's main kernel for a real head dim, a mask kind, an arch and the call's
    FEAT_* bits (sinks need nothing of it: their gradient is flash_bwd_dsinks_kernel's)."""
    features &= FEAT_SOFTCAP | FEAT_ALIBI
    if flash_bwd_path(arch, head_dim) == "wgmma":
        hd = sm90_head_dim(head_dim)
        t = _overrides.get("flash_bwd_sm90_tiles") or FLASH_BWD_SM90_TILES[hd]
        return FlashBwdSm90Variant(dtype, hd, t.block_m, t.num_wg, mask, features)
    hd = bwd_head_dim(head_dim)
    t = flash_bwd_tiles(arch, hd)
    return FlashBwdVariant(dtype, hd, t.block_m, t.num_warps, t.q_chunk, mask, features)


# The row kernels (pre-pass, dQ convert, sinks): one warp per (token, head) row.
FLASH_BWD_ROWS_THREADS = 256


def flash_bwd_row_variants(dtype: str, head_dim: int):
    """(pre-pass, dQ convert, sinks' gradient) kernels for a real head dim."""
    hd = bwd_head_dim(head_dim)
    return (FlashBwdPrepVariant(dtype, hd, FLASH_BWD_ROWS_THREADS),
            FlashBwdDqVariant(dtype, hd, FLASH_BWD_ROWS_THREADS),
            FlashBwdDsinksVariant(dtype, hd, FLASH_BWD_ROWS_THREADS))


# The causal schedule of the main kernels (FlashAttention-3's SingleTileBwdLPTScheduler): a
# causal call's first key tiles see the most query tiles, so its blocks run in sections of a
# few (KV head, batch) pairs, key tile-major within each: every section's heavy tiles start
# before its light ones (the longest-first rule: a light tile ends the kernel, not a heavy one
# started last), and the blocks running together stream the Q, dO and dQ rows of the few pairs
# of a section, which fit in a share of the L2 (FA3's 40 MB of 50 on an H100).
LPT_L2_SHARE = 0.8


def flash_bwd_lpt_group(*, kernel, causal: bool, varlen: bool, deterministic: bool,
                        seqlen_q: int, head_group: int, head_dim: int, elem_bytes: int,
                        l2_bytes: int) -> int:
    """(KV head, batch) pairs per section of the causal schedule (the params' lpt_group), 0
    for the plain grid: the mma.sync kernel (FlashBwdVariant: its traits' CAUSAL_SCHEDULE is
    false), non-causal, windowed or varlen calls (tiles of about equal work, or lengths the
    host does not know) and deterministic ones (their block columns walk tiles in a fixed
    order). A pair's blocks stream head_group query heads of seqlen_q rows: Q and dO
    (elem_bytes each), dQ's fp32 workspace, lse2 and D; sections hold a power of two of pairs
    whose rows fit LPT_L2_SHARE of the L2 (at least one). tuning.override(flash_bwd_lpt=...):
    False for the plain grid, a positive int for that many pairs per section."""
    forced = _overrides.get("flash_bwd_lpt")
    if not isinstance(kernel, FlashBwdSm90Variant) or not causal or varlen or deterministic \
            or forced is False:
        return 0
    if forced is not None:
        return int(forced)
    pair_bytes = head_group * seqlen_q * (head_dim * (2 * elem_bytes + 4) + 8)
    fit = int(LPT_L2_SHARE * l2_bytes) // max(pair_bytes, 1)
    return 1 << (fit.bit_length() - 1) if fit >= 1 else 1


def flash_bwd_dq_slices(deterministic: bool, n_key_tiles: int, batch: int, nheads_kv: int,
                        sm_count: int) -> int:
    """Slices of the dQ workspace (the main kernel's grid x): 1 for atomics from every key
    tile's block; deterministically, enough block columns to fill the SMs once (each walks
    its key tiles in order and adds into its own slice; the convert sums the slices in
    order), FlashAttention-2's rule."""
    if not deterministic:
        return 1
    return max(1, min(n_key_tiles, -(-sm_count // max(1, batch * nheads_kv))))
