"""The one tuning table: every launch-shape choice of every kernel, with the measurement
behind it, and one function per kernel that turns a problem and an architecture into a
complete variant key (cuattn.keys). C++ receives the choice as its traits and derives
everything else.

Sweeps and tests force a choice with ``override(...)``, a context manager (cuattn._overrides
holds what it forces), never by patching this module. The shipped set (what ``python -m
cuattn precompile`` builds) is cuattn.shipped's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import _overrides
from ._overrides import override  # noqa: F401  (the public name: tuning.override)
from .constants import (FEAT_ALIBI, FEAT_PACK_GQA, FEAT_SOFTCAP, KV_DENSE, MASK_CAUSAL,
                        MASK_NONE, MASK_WINDOW, SM90_ARCH)
from .keys import (FlashCombineVariant, FlashFwdSm90Variant, FlashFwdVariant,
                   FlashInferTablesVariant, KvCacheAppendVariant, MergeVariant,
                   PagedMmaVariant, PagedReduceVariant, PagedSimtVariant, QuantizeE4m3Variant,
                   ReshapeCacheVariant)

# ---- merge_attn_states / merge_states -----------------------------------------------------------
# One thread per 16-byte vector; 256 threads per block. H200, bf16, 16384 tokens x 32 heads
# x 128: see bench/NOTES.md (merge v1) for the measured bandwidth.
MERGE_NUM_THREADS = 256


def merge_variant(dtype: str, head_size: int, stacked: bool) -> MergeVariant:
    return MergeVariant(dtype, head_size, stacked, MERGE_NUM_THREADS)


# ---- flash (flash_forward / flash_varlen_forward) -----------------------------------------------
# (arch family, compiled head dim, masked) -> FlashTiles. A warp owns BLOCK_M / NUM_WARPS
# query rows: 16 (Q fragments resident in registers) or 32 with q_smem (Q re-read from
# shared memory at each k16 step, which halves the K/V ldmatrix bytes per MMA: the shipped
# hd64 and hd128 plain forms). bench/NOTES.md (flash) has the measurements.
# Shared memory = Q tile + STAGES x (K tile + V tile) = 2 bytes x HEAD_DIM x
# (BLOCK_M + 2 x STAGES x BLOCK_N); limits per block: sm_90 227 KB, sm_80 163 KB,
# sm_86/sm_89 99 KB (and 228 / 164 / 100 KB per SM).
# The shape follows FlashAttention-2's occupancy: blocks of 4 warps at <= 255 registers,
# so two blocks (8 warps) are resident per SM and one block's __syncthreads / softmax
# overlaps the other's MMAs. hd64 and hd128 are MEASURED on the H200 (bench/lab/
# flash_sweep.py, bf16, TFLOP/s at S=4096 / 16384, full | causal; bench/NOTES.md):
#   hd64:  64x128x4w2s 280/286 | 267/304   64x64x4w2s 282/301 | 278/306
#          64x64x4w3s  302/313 | 280/308   128x64x8w2s 240/250 | 222/251
#   hd128: 64x64x4w2s  319/353 | 308/358   64x64x4w3s 331/350 | 306/356
#          128x64x8w2s 305/313 | 274/317   64x32x4w2s 296/306 | 273/314
# 8 warps x 128 rows (one block per SM) lost everywhere. The other head dims are first
# guesses from the ptxas report (registers <= 255 with zero spills at sm_90, shared
# memory under each architecture's limit). Registers per thread at sm_90 (bf16;
# none / causal / window) are noted per line.


@dataclass(frozen=True)
class FlashTiles:
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    # Kernel knobs (cuda_src/flash_fwd.cuh FlashFwdTraits); bench/lab/flash_sweep.py times
    # them, bench/NOTES.md (flash) has what each is predicted to do.
    q_smem: int = 0          # 1: Q re-read from smem per k16 step (32 rows per warp fit);
                             # 2: and compact ldmatrix offsets
    kv_split: bool = False   # separate cp.async groups for K and V (Q K^T waits for K only)
    softmax: int = 0         # bit 0: branch-free rescale of O; bit 1: P packed right after exp


# Head dims the flash kernel is compiled for: the real head dim rounded up to a multiple
# of 32 (the tail columns are zero-filled on load and never stored).
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

# sm_90 / sm_80 (>= 163 KB of shared memory per block, 2 blocks per SM fit).
_FLASH_BIG_SMEM = {
    32: FlashTiles(64, 128, 4, 2),     # smem 36 KB
    # 32 rows per warp, Q re-read from shared memory (halves the K/V ldmatrix traffic per
    # FLOP): hd64 334 / 345 TFLOP/s at S 4096 / 16384 against 297 / 309 for 64x64x4w3s
    # (bench/lab/flash_sweep.py, H200, 2026-11-29). Its masked and split forms spill: below.
    64: FlashTiles(128, 128, 4, 2, q_smem=2, softmax=2),   # smem 80 KB
    96: FlashTiles(64, 64, 4, 2),      # smem 60 KB
    # hd128: 379 / 401 TFLOP/s against 322 / 355 for 64x64x4w2s. Without kv_split it
    # measured 388 / 408 but its split-KV form spills 52 B; with it nothing spills.
    128: FlashTiles(128, 64, 4, 2, q_smem=1, kv_split=True, softmax=2),   # smem 96 KB
    # Above 128, Q fragments are re-read from shared memory each k16 step (Q + O would
    # not fit in registers) and the key loop is one loop with a uniform mask branch.
    160: FlashTiles(64, 64, 4, 2),     # smem 100 KB (1 block/SM on sm_80)
    192: FlashTiles(64, 16, 4, 2),     # (BN 32 spilled 12 B), smem 48 KB
    224: FlashTiles(64, 16, 4, 2),     # (BN 32 spilled 24 bytes), smem 56 KB
    256: FlashTiles(64, 32, 4, 2),     # smem 96 KB
}
# sm_86 / sm_89 (99 KB per block, 100 KB per SM): key tiles trimmed so that two blocks
# fit per SM up to hd128.
_FLASH_SMALL_SMEM = dict(_FLASH_BIG_SMEM)
_FLASH_SMALL_SMEM.update({
    64: FlashTiles(64, 64, 4, 2),      # smem 40 KB
    96: FlashTiles(64, 32, 4, 2),      # smem 36 KB
    128: FlashTiles(64, 32, 4, 2),     # smem 48 KB
    160: FlashTiles(64, 32, 4, 2),     # smem 60 KB
})
# Masked forms (causal, window) and split-KV forms of the sm_90 / sm_80 table, where they
# differ from the plain one: the 32-rows-per-warp shapes above fit 255 registers only
# without the mask code (and, at hd64, without the split epilogue). Measured (TFLOP/s,
# causal, S 4096 / 16384): hd64 64x64x4w3s+sm1 287 / 302 (64x64x4w3s 277 / 301);
# hd128 64x64x4w2s 305 / 359 (+sm1 311 / 354).
_FLASH_BIG_SMEM_MASKED: dict[int, FlashTiles] = {
    64: FlashTiles(64, 64, 4, 3, softmax=1),
    128: FlashTiles(64, 64, 4, 2),
}
# Tiles for the architecture families of the tables above: one representative each.
FLASH_TABLE_ARCHS = ("sm_90", "sm_86")


def compiled_head_dim(head_dim: int) -> int:
    """The head dim a kernel is compiled for: the real one rounded up to a multiple of 32."""
    return max(32, -(-head_dim // 32) * 32)


def flash_tiles(arch: str, head_dim: int, masked: bool, hooked: bool = False) -> FlashTiles:
    """Tiles for ``arch`` (``sm_XY``), a compiled head dim, and whether the form is masked
    (causal or window) or split-KV, which use _FLASH_BIG_SMEM_MASKED where it has an entry,
    and whether it has hooks or sinks (_FLASH_HOOKED_TILES, below)."""
    forced = _overrides.get("flash_tiles")
    if forced is not None:
        return forced
    if hooked and head_dim in _FLASH_HOOKED_TILES:
        return _FLASH_HOOKED_TILES[head_dim]
    if arch in ("sm_86", "sm_87", "sm_89"):
        return _FLASH_SMALL_SMEM[head_dim]
    if masked and head_dim in _FLASH_BIG_SMEM_MASKED:
        return _FLASH_BIG_SMEM_MASKED[head_dim]
    return _FLASH_BIG_SMEM[head_dim]


# Calls with logits hooks or sinks (FEAT_* bits): the extra registers (a slope per row, the
# softcap constants, the per-element hook) do not fit the 32-rows-per-warp shapes at hd64
# (16-176 B of spills) nor their masked / split forms at hd128 (40-60 B), so those take the
# masked table's tiles; hd128's plain full form stays clean and keeps its tiles. At hd256
# ptxas (NVRTC 13.0) spills 20-68 B in the hooked none / causal forms of every tile tried
# (64x32, 64x16, 16x32, 16x64, softmax and kv_split knobs) and none in the window form, so
# those calls run as the window form with unbounded bounds: the same keys, the same result.
# hd32's 64x128 tiles spill 20-36 B in the hooked split forms: 64x64 there.
FLASH_HOOKED_PLAIN_HEAD_DIMS = (128,)
FLASH_HOOKED_AS_WINDOW_MIN_HEAD_DIM = 256
_FLASH_HOOKED_TILES = {32: FlashTiles(64, 64, 4, 2)}


def flash_forward_variant(dtype: str, head_dim: int, *, mask: int, split: bool,
                          arch: str, features: int = 0) -> FlashFwdVariant:
    """The forward kernel for a real head dim, a mask kind, split-KV or not, an arch, and
    the call's FEAT_* bits."""
    hd = compiled_head_dim(head_dim)
    masked = mask != MASK_NONE or split
    if features:
        masked = masked or hd not in FLASH_HOOKED_PLAIN_HEAD_DIMS
        if hd >= FLASH_HOOKED_AS_WINDOW_MIN_HEAD_DIM and not split:
            mask = MASK_WINDOW
    t = flash_tiles(arch, hd, masked=masked, hooked=features != 0)
    return _flash_variant(dtype, hd, t, mask, split, KV_DENSE, features)


def _flash_variant(dtype, hd, t, mask, split, kv, features, fp8=False) -> FlashFwdVariant:
    return FlashFwdVariant(dtype, hd, t.block_m, t.block_n, t.num_warps, t.stages, mask, split,
                           int(t.q_smem), bool(t.kv_split), int(t.softmax), kv, features, fp8)


# ---- the Hopper forward kernel (cuda_src/flash_fwd_sm90.cuh, sm_90a) ----------------------------
# flash_forward / flash_varlen_forward on sm_90 devices run the wgmma kernel for head dims
# above 32 (compiled rounded up to a multiple of 64: its tiles are whole 128-byte column
# blocks, and the tail columns are zero-filled on load and never stored); hd <= 32, and
# every other architecture, run the mma.sync kernel above.
@dataclass(frozen=True)
class FlashSm90Tiles:
    block_m: int      # 64 query rows per warpgroup
    block_n: int
    stages: int


# Three consumer warpgroups (192 rows) at hd64, two (128 rows) at the others (three leave
# 160 registers each: too few for O at hd128; one is 35-40% slower). MEASURED on the H200
# with TMA loads (bench/lab/flash_sm90_sweep.py, bf16, TFLOP/s at S 2048 / 8192, full |
# causal; bench/NOTES.md "Hopper kernel"):
#   hd64:  192x128x2 432/455 | 343/431  192x128x3 423/461 | 339/428  128x128x2 372/400 | 308/376
#          192x96x2 390/423 | 332/398   128x176x2 361/398 | 297/376
#   hd128: 128x128x2 601/609 | 464/564  128x128x3 591/597 | 464/558  128x160x2 554/601 | 458/546
#          192x80x2 560/587 | 459/542   192x64x2 543/540 | 446/505
#   hd256: 128x80x2 676/686 | 521/601   128x64x2 560/663 | 503/570  128x48x3 515/548 | 451/481
# hd192 is a first guess (BN 96 spilled in the hooked forms of stage 1).
FLASH_SM90_TILES = {               # (smem with the O tile of the non-split forms)
    64: FlashSm90Tiles(192, 128, 2),    # smem 113 KB
    128: FlashSm90Tiles(128, 128, 2),   # smem 193 KB
    192: FlashSm90Tiles(128, 64, 2),    # smem 193 KB
    256: FlashSm90Tiles(128, 80, 2),    # smem 225 KB (no O tile: O staged in the Q tiles)
}
# Forms that need more registers than those tiles leave them: a logits hook (softcap, ALiBi)
# or a window (more per score: 12-56 B of spills at the tiles above), or the cp.async
# producer (its 40 registers leave three consumers 152: spills). They take tiles where no
# form spills (at hd256 128x64x2 spilled too, in causal ALiBi); so do short causal calls
# (FLASH_SM90_SHORT_CAUSAL).
FLASH_SM90_TILES_HEAVY = {
    64: FlashSm90Tiles(128, 128, 2),
    256: FlashSm90Tiles(128, 48, 3),    # smem 209 KB
}
# Causal calls of at most this many query rows take the heavy tiles at these head dims: at
# hd64 the 192-row tiles cut the diagonal coarsely (S 512: 70% of the visited scores are
# needed, against 80% with 128 rows). MEASURED (bench/NOTES.md "Stage 5", time of 128x128x2
# over 192x128x2): S512 0.89, S1024 0.86, S2048 1.06, S4096 1.10; full: 1.09-1.22.
FLASH_SM90_SHORT_CAUSAL = {64: 1024}


# The FP8 form (e4m3 Q / K / V, flash_fwd_sm90.cuh's Traits::E4M3), compiled for head dims of
# whole 128-byte rows (128, 256: hd64 runs as 128, its tail columns zero). First choice (not
# swept): 128 x 128 x 2 at hd128, as the 16-bit form; at hd256 a 64-key tile, the widest
# whose V^T ring (128-key rows) leaves room for the 16-bit O tile (O cannot be staged in
# the 1-byte Q tiles).
FLASH_SM90_TILES_FP8 = {
    128: FlashSm90Tiles(128, 128, 2),   # smem 145 KB
    256: FlashSm90Tiles(128, 64, 2),    # smem 225 KB
}


def sm90_head_dim(head_dim: int, dtype: str = "bf16") -> int:
    """The head dim the Hopper kernel is compiled for: the real one rounded up to 64 (e4m3:
    to 128)."""
    unit = 128 if dtype == "e4m3" else 64
    return max(unit, -(-head_dim // unit) * unit)


def flash_path(arch: str, head_dim: int) -> str:
    """"wgmma" (the Hopper kernel) or "mma" (mma.sync) for a device of ``arch`` and a real
    head dim. Forced by override(flash_path=...), and to "mma" by override(flash_tiles=...)."""
    forced = _overrides.get("flash_path")
    if forced == "wgmma" and arch != SM90_ARCH:
        raise ValueError(f"override: flash_path 'wgmma' needs an sm_90 device, this is {arch}")
    if forced is not None:
        return forced
    if _overrides.has("flash_tiles") or arch != SM90_ARCH or compiled_head_dim(head_dim) < 64:
        return "mma"
    return "wgmma"


def flash_sm90_variant(dtype: str, head_dim: int, *, mask: int, split: bool,
                       features: int = 0, tma: bool = False,
                       seqlen_q: int | None = None, kv: int = KV_DENSE,
                       out: str = "") -> FlashFwdSm90Variant:
    """The Hopper forward kernel for a real head dim, a mask kind, split-KV or not, the
    call's FEAT_* bits, whether its producer loads by TMA (a call whose Q / K / V tensor
    maps describe, cuattn._tma.encodable) or by cp.async, and the call's (longest) query
    length (None: long). kv: dense K / V, or a paged cache (KV_PAGED_NHD / KV_PAGED_VLLM:
    paged_prefill, by TMA) with the tiles of a dense call. dtype e4m3 (the FP8 form, dense
    or NHD-paged, by TMA): ``out`` names the output's dtype (f16 / bf16)."""
    hd = sm90_head_dim(head_dim, dtype)
    if dtype == "e4m3":
        t = _overrides.get("flash_sm90_tiles") or FLASH_SM90_TILES_FP8[hd]
        return FlashFwdSm90Variant(dtype, hd, t.block_m, t.block_n, t.stages, mask, split,
                                   features, tma, kv, out)
    short_causal = mask == MASK_CAUSAL and seqlen_q is not None and \
        seqlen_q <= FLASH_SM90_SHORT_CAUSAL.get(hd, 0)
    heavy = not tma or mask == MASK_WINDOW or features & (FEAT_SOFTCAP | FEAT_ALIBI) or \
        short_causal
    t = _overrides.get("flash_sm90_tiles") or \
        (FLASH_SM90_TILES_HEAVY if heavy else FLASH_SM90_TILES).get(hd, FLASH_SM90_TILES[hd])
    return FlashFwdSm90Variant(dtype, hd, t.block_m, t.block_n, t.stages, mask, split, features,
                               tma, kv)


def flash_kernel_variant(dtype: str, head_dim: int, *, mask: int, split: bool, arch: str,
                         features: int = 0, tma: bool = False, seqlen_q: int | None = None,
                         out: str = ""):
    """The kernel of a dense flash_forward / flash_varlen_forward call (its longest query
    length seqlen_q): the Hopper one where flash_path picks it (by TMA where ``tma``), and
    for every e4m3 call (its FP8 form, output ``out``), else the mma.sync one."""
    if dtype == "e4m3" or flash_path(arch, head_dim) == "wgmma":
        return flash_sm90_variant(dtype, head_dim, mask=mask, split=split, features=features,
                                  tma=tma, seqlen_q=seqlen_q, out=out)
    return flash_forward_variant(dtype, head_dim, mask=mask, split=split, arch=arch,
                                 features=features)


# Split-KV combine: one warp per (token, head) row.
FLASH_COMBINE_NUM_THREADS = 128


def flash_combine_variant(dtype: str, head_dim: int, sinks: bool = False) -> FlashCombineVariant:
    return FlashCombineVariant(dtype, compiled_head_dim(head_dim), FLASH_COMBINE_NUM_THREADS,
                               sinks)


# Split-KV rule for num_splits=0 (flash_num_splits): as many splits as keep the whole grid
# within ONE wave of (SMs x resident blocks), each split keeping at least
# FLASH_MIN_TILES_PER_SPLIT key tiles, at most FLASH_MAX_SPLITS. Measured on the H200
# (bench/lab/flash_splits.py, causal bf16 hd128, microseconds by split count): a partial
# second wave costs a whole one, e.g. batch 4 x 1 query x 16384 keys x 32 heads (128
# blocks, 264 slots): 1: 280, 2: 211, 3 (the old round-up rule): 279, 4: 212;
# 1 x 1 x 65536 x 32 heads: 1: 1096, 8: 211 (best; one wave), 16: 217, 64: 251;
# 1 x 64 x 16384 x 16 heads: 16 splits 47 us, best.
FLASH_MIN_TILES_PER_SPLIT = 4
FLASH_MAX_SPLITS = 64


def flash_num_splits(blocks: int, n_key_tiles: int, num_sms: int, blocks_per_sm: int) -> int:
    """num_splits=0: the most splits that keep the grid within one wave of resident blocks
    (a partial extra wave costs a whole one), each split keeping at least
    FLASH_MIN_TILES_PER_SPLIT key tiles."""
    slots = num_sms * max(1, blocks_per_sm)
    if blocks <= 0:
        return 1
    by_fill = slots // blocks
    by_length = n_key_tiles // FLASH_MIN_TILES_PER_SPLIT
    return max(1, min(by_fill, by_length, FLASH_MAX_SPLITS))


# ---- paged prefill (cuattn.paged_prefill) ---------------------------------------------------------
# The flash kernel over a paged cache, the query heads of one KV head packed into a block's
# rows (FEAT_PACK_GQA): a call's rows per (sequence, KV head) are max_seqlen_q x group.
# Chunks of a prompt (thousands of rows) take the flash tiles of the masked table (with a
# [dim][key] V tile for vLLM's layout, whose rows need BLOCK_N >= 32); a few new tokens per
# sequence (speculative verification, rows <= 64) take one m16 tile per warp, and as few
# warps as cover the rows, so that no warp computes only padding. Above head dim 128 the
# tiles keep BLOCK_N = 32 (64 spills up to 272 B at 32 rows; 16 leaves vLLM's V no room).
PREFILL_FEW_ROWS = {16: FlashTiles(16, 32, 1, 3), 32: FlashTiles(32, 32, 2, 3),
                    64: FlashTiles(64, 64, 4, 2)}
PREFILL_FEW_ROWS_WIDE = {32: FlashTiles(32, 32, 2, 2)}
PREFILL_WIDE = FlashTiles(64, 32, 4, 2)
# Long chunks at the head dims only paged_prefill's flash form reaches below and above decode's
# (first guesses from the ptxas report, NVRTC 13.0, sm_90; not measured): ptxas capped some
# forms of the tiles the rules below give at 128-168 registers and spilled 4-20 B (hd32's
# 64x128 window form with every hook over NHD, 64x64 over vLLM's; hd160's 64x32 in three
# forms). These spill in none of the 16 long-chunk forms. smem 36 KB / 60 KB.
PREFILL_LONG_BY_DIM = {32: FlashTiles(64, 128, 4, 2, softmax=1), 160: FlashTiles(64, 64, 4, 2)}
# Long chunks at hd128, causal, no hooks, no split (the common prefill call): 128 rows per
# block (MEASURED, bench/lab/prefill_sweep.py, H200, NHD, ctx 16384: 128x32x4w3s 332 TFLOP/s,
# 128x64x4w2s 348, 64x64x4w2s 288; the dense call 334). With Q re-read from shared memory
# (q_smem) this is the one 128-row packed form ptxas fits in 255 registers without spills;
# its other forms (window, split, hooks) spill 4-32 B and keep 64x64.
PREFILL_LONG_CAUSAL_HD128 = FlashTiles(128, 32, 4, 3, q_smem=1)


def paged_prefill_tiles(arch: str, head_dim: int, rows: int, mask: int = MASK_CAUSAL,
                        split: bool = False, features: int = 0) -> FlashTiles:
    forced = _overrides.get("prefill_tiles")
    if forced is not None:
        return forced
    few = PREFILL_FEW_ROWS if head_dim <= 128 else PREFILL_FEW_ROWS_WIDE
    for limit, tiles in few.items():
        if rows <= limit:
            return tiles
    if head_dim in PREFILL_LONG_BY_DIM:
        return PREFILL_LONG_BY_DIM[head_dim]
    if head_dim > 128:
        return PREFILL_WIDE
    if head_dim == 128 and mask == MASK_CAUSAL and not split and not features & ~FEAT_PACK_GQA:
        return PREFILL_LONG_CAUSAL_HD128
    return flash_tiles(arch, head_dim, masked=True)


def paged_prefill_variant(dtype: str, head_size: int, *, mask: int, split: bool, arch: str,
                          kv: int, features: int, rows: int, fp8: bool = False) -> FlashFwdVariant:
    """paged_prefill's kernel: rows = max_seqlen_q x (query heads per KV head). fp8 caches
    take the same tiles without kv_split (a stage is widened once all of it has landed)."""
    hd = compiled_head_dim(head_size)
    t = paged_prefill_tiles(arch, hd, rows, mask, split, features)
    if fp8:
        t = replace(t, kv_split=False)
    return _flash_variant(dtype, hd, t, mask, split, kv, features | FEAT_PACK_GQA, fp8)


# A few new tokens per sequence (speculative verification) run instead on the tensor-core
# decode form (cuda_src/paged_attention_mma.cuh) as multi-token decode: a block's MMA
# columns are the new tokens x query heads of one sequence, and each warp streams its own
# cp.async ring, where the flash structure (one ring per block behind block barriers) stalled
# at 57-66% of the read bandwidth at every tile (bench/NOTES.md, paged_prefill round 1).
# Columns per block: at most 4 n-tiles, and NT x head_size / 16 <= 32 keeps O^T in 128
# registers a lane (hd128: 32 columns, hd256: 16; 8 n-tiles at hd64 spilled 280-470 B);
# heads per block shrink to fit the tokens.
PREFILL_DECODE_MAX_TOKENS = 16


def _multi_token_columns(head_size: int) -> int:
    return 8 * min(4, 32 // (head_size // 16))


def _multi_tokens(max_seqlen_q: int) -> int:
    # At least 2: the 1-token form is paged_attention's decode, whose query row is the
    # sequence (it reads no cu_seqlens_q), wrong once a sequence has no new token.
    return max(2, 1 << max(0, max_seqlen_q - 1).bit_length())


# Long chunks run on the Hopper kernel (its TMA producer takes a box per cache block: 16-bit
# caches of blocks of at least 8 tokens, vLLM's (8 to 32) or NHD (a box starts on the
# swizzle's 1024-byte period)) where flash_path picks it for the head size; fp8 caches and
# smaller NHD blocks stay on the mma.sync kernel.
PREFILL_SM90_MIN_BLOCK = 8


def paged_prefill_path(arch: str, head_size: int, kv_layout: str, block_size: int,
                       cache: str) -> str:
    """"wgmma" or "mma": the flash kernel of paged_prefill's flash form."""
    if flash_path(arch, head_size) == "wgmma" and cache != "e4m3" \
            and block_size >= PREFILL_SM90_MIN_BLOCK:
        return "wgmma"
    return "mma"


def paged_prefill_form(cache: str, head_size: int, max_seqlen_q: int, total_q: int) -> str:
    """"decode" (multi-token decode) or "flash": the kernel paged_prefill runs. (The decode
    form's partition reduce has one grid row per query row: at most 65535.)"""
    can_decode = (tensor_core_decode_fits(cache, head_size) and max_seqlen_q >= 1 and
                  total_q <= 65535 and
                  _multi_tokens(max_seqlen_q) <= _multi_token_columns(head_size))
    forced = _overrides.get("prefill_form")
    if forced is not None:
        return "decode" if forced == "decode" and can_decode else "flash"
    return "decode" if can_decode and max_seqlen_q <= PREFILL_DECODE_MAX_TOKENS else "flash"


def paged_multi_token(head_size: int, gqa_ratio: int, max_seqlen_q: int) -> tuple[int, int]:
    """(tokens, group) of multi-token decode: the compiled tokens per sequence (a power of
    two >= max_seqlen_q) and the query heads per block (a divisor of the GQA ratio)."""
    tokens = _multi_tokens(max_seqlen_q)
    max_cols = _multi_token_columns(head_size)
    if tokens > max_cols:
        raise ValueError(f"max_seqlen_q: {max_seqlen_q} new tokens exceed the {max_cols} "
                         f"columns of multi-token decode at head size {head_size}")
    limit = min(PAGED_MAX_GROUP, max_cols // tokens,
                _overrides.get("multi_token_group", PAGED_MAX_GROUP))
    return tokens, paged_group(gqa_ratio, limit)


# ---- paged (paged_attention / reshape_and_cache) -------------------------------------------------
# The head sizes of the decode kernels (paged_attention's two forms, and multi-token decode):
# those they are compiled and tested for (cuattn.paged.layout.HEAD_SIZES). paged_prefill's
# flash form and reshape_and_cache take every multiple of 8 up to 256.
PAGED_DECODE_HEAD_SIZES = (64, 80, 96, 112, 120, 128, 192, 256)
# Query heads served by one thread block: the largest divisor of the GQA ratio <= this.
# Every K/V byte is read num_heads / num_kv_heads / group times (once for ratios <= 8).
PAGED_MAX_GROUP = 8
PAGED_PARTITION_SIZES = (128, 256, 512, 1024)


def paged_group(gqa_ratio: int, limit: int = PAGED_MAX_GROUP) -> int:
    return max(g for g in range(1, limit + 1) if gqa_ratio % g == 0)


# Two forms of the kernel (cuattn/paged/forms.py). The tensor-core form (cuda_src/
# paged_attention_mma.cuh) runs for 16-bit caches with head sizes that are multiples of 16;
# the CUDA-core form (cuda_src/paged_attention.cuh) everywhere else (fp8 caches, head 120).
# MEASURED (decode_sweep, H200, hd128 bs16, % of read BW, CUDA-core t128 -> tensor-core):
# group 4: 32 x 4096 v2 p512 84 -> 92 (v1 66 -> 98), 8 x 32768 p512 87 -> 98, 1 x 32768
# p1024 56 -> 66; and even group 1 (7 of 8 MMA columns idle): 32 x 4096 p512 104 -> 109,
# 1 x 32768 p1024 92 -> 94. So every group.
def tensor_core_decode_fits(cache_dtype: str, head_size: int) -> bool:
    """Whether the tensor-core decode kernel (paged_attention's mma form, multi-token decode)
    takes this cache and head size: 16-bit caches, the decode head sizes that are multiples
    of 16 (paged_prefill's other head sizes run on the flash form)."""
    return cache_dtype != "e4m3" and head_size % 16 == 0 and head_size in PAGED_DECODE_HEAD_SIZES


def paged_form(cache_dtype: str, head_size: int, group: int) -> str:
    """"mma" or "simt": the form paged_attention runs for this cache, head size and group."""
    can_mma = tensor_core_decode_fits(cache_dtype, head_size)
    forced = _overrides.get("paged_form")
    if forced is not None:
        return "mma" if forced == "mma" and can_mma else "simt"
    return "mma" if can_mma else "simt"


# CUDA-core form. MEASURED on the H200 (bench/lab/decode_sweep.py, 2026-11-29; bf16, head
# 128, block 16, 32 q heads, L2 flushed, % of the read bandwidth measured in that run,
# 4032 GB/s), threads per block:
#   kv heads / batch x ctx     t256                t128 (chosen)
#   8 / 32 x 4096    v2 p512   72.1                79.3 (p256 81.7)
#   8 / 8 x 32768    v2 p512   75.2                88.8
#   8 / 1 x 32768    v2 p512   56.5                64.1
#   32 / 32 x 4096   v2 p512   100                 105
# 4 warps per block: twice the blocks per SM for the same registers, so more loads in
# flight per SM for the group-4 (8 KV head) case whose math per byte left 8-warp blocks
# stalled. (A software pipeline of the K/V loads gained at most 1.5 points at 256 threads
# and lost 5-25 at 128: retired, bench/NOTES.md paged round 2.)
PAGED_SIMT_NUM_THREADS = 128
# Its partition when the call names none (vLLM's default); version="auto" takes v1 only
# when one partition covers the context (v2 at 512 beat or tied v1 everywhere else: kv 8,
# 32 x 4096: v1 57% vs v2 79%; kv 32: v1 88% vs v2 105%).
PAGED_SIMT_PARTITION_SIZE = 512


def paged_simt_variant(dtype: str, cache: str, head_size: int, block_size: int, group: int,
                       partition_size: int, alibi: bool, softcap: bool = False,
                       sinks: bool = False) -> PagedSimtVariant:
    return PagedSimtVariant(dtype, cache, head_size, block_size, group, partition_size, alibi,
                            PAGED_SIMT_NUM_THREADS, softcap, sinks and not partition_size)


def paged_simt_plan(max_context: int, partition_size: int | None) -> tuple[str, int]:
    """CUDA-core form, version="auto": (version, partition); the caller falls back to v2 when
    v1's logits do not fit in shared memory."""
    ps = partition_size or PAGED_SIMT_PARTITION_SIZE
    return ("v1" if max_context <= ps else "v2"), ps


# Tensor-core form: the group's query heads are the N side of mma.sync, K and V the A side
# straight from their cache layouts, each warp a cp.async ring of STAGES tiles of 16 tokens.
# 96 KB of ring per 4-warp block at hd128 (two blocks, ~128 KB of loads in flight per SM).
# Ring sweep (bench/NOTES.md paged round 3): stages 3 vs 2 within 1-2%; 4 stages, 8 warps
# and 32-token tiles lost 3-20 points at v2 (fewer resident blocks). The K/V copies carry
# an L2 evict-first policy (MEASURED, decode_sweep, H200, clean L2, us off -> on: 32 x 4096
# kvh 8 v2 p256 143 -> 133, 1 x 32768 p1024 40.7 -> 40.5, v1 rows within 1%) and P enters
# P V as two halves (hi + lo) for ~fp32 accuracy: both always on in the kernel.
@dataclass(frozen=True)
class PagedMmaTiles:
    num_warps: int = 4
    stages: int = 3


# Multi-token decode of 4 to 8 tokens takes two stages at every head size. MEASURED (bench/
# lab/verify_sweep.py, H200, bf16 hd128 group 4, vLLM layout block 16, L2 flushed, time over
# single-token decode, 3 stages -> 2): 8 new tokens 32 x 4096 1.175 -> 1.139, 64 x 4096
# 1.177 -> 1.161, 64 x 16384 1.057 -> 1.045; 4 new 32 x 4096 1.063 -> 1.054 (4 stages,
# 8 warps, 2 warps and v2 partitions all slower). 2 tokens lost on two stages (prefill
# suite, batch 64, 4096 and 16384: 1.00-1.01 -> 1.07), so they keep three; 16 were not
# measured and keep three.
def paged_mma_tiles(head_size: int, tokens: int = 1) -> PagedMmaTiles:
    """Ring shape for a head size (above 128 two stages keep two blocks per SM up to hd192)
    and the query tokens per sequence."""
    forced = _overrides.get("paged_mma")
    if forced is not None:
        return forced
    two = head_size > 128 or 4 <= tokens <= 8
    return PagedMmaTiles(stages=2) if two else PagedMmaTiles()


def paged_mma_variant(dtype: str, head_size: int, block_size: int, group: int,
                      partition_size: int, alibi: bool, softcap: bool = False,
                      sinks: bool = False, nhd: bool = False,
                      tokens: int = 1) -> PagedMmaVariant:
    """tokens > 1: multi-token decode (paged_multi_token)."""
    t = paged_mma_tiles(head_size, tokens)
    return PagedMmaVariant(dtype, head_size, block_size, group, partition_size, alibi,
                           t.num_warps, t.stages, softcap, sinks and not partition_size, nhd,
                           tokens)


# Tensor-core form, version="auto" (and v2's partition when the call names none). MEASURED
# (bench/lab/decode_sweep.py, H200, bf16 hd128 bs16, % of read BW; NOTES.md paged round 3):
# its v1 keeps no logits, so it has no length limit, and whenever the v1 grid alone fills the
# SMs it beats v2 (kvh 8: 32 x 4096 (256 blocks) v1 98 vs v2 p1024 95 / p512 92; 128 x 2048
# v1 105 vs 101); below that, the longest partitions that still fill the SMs won everywhere
# (kvh 8, 8 x 32768: p1024 100 / p512 98 / p256 92; 1 x 32768: 66 / 59 / 52; kvh 32, 1 x
# 32768: 94 / 92 / 86): fewer partitions, less scratch and a shorter reduce.
def paged_mma_partition(num_ctas_v1: int, max_context: int, num_sms: int) -> int:
    """v2's partition when the call names none: the longest whose grid fills the SMs."""
    for ps in sorted(PAGED_PARTITION_SIZES, reverse=True):
        if num_ctas_v1 * -(-max_context // ps) >= num_sms:
            return ps
    return min(PAGED_PARTITION_SIZES)


def paged_split_partition(max_context: int, num_splits: int) -> int:
    """v2's partition for a call that names num_splits > 1 (paged_prefill's few-token form):
    the shortest that gives at most num_splits partitions per sequence, else the longest."""
    return next((ps for ps in PAGED_PARTITION_SIZES if -(-max_context // ps) <= num_splits),
                max(PAGED_PARTITION_SIZES))


def paged_mma_plan(num_ctas_v1: int, max_context: int, num_sms: int,
                   partition_size: int | None = None) -> tuple[str, int]:
    """(version, partition_size) for version="auto"; a given partition_size is kept."""
    if num_ctas_v1 >= num_sms:
        return "v1", 0
    ps = partition_size or paged_mma_partition(num_ctas_v1, max_context, num_sms)
    return ("v1", 0) if max_context <= ps else ("v2", ps)


# Partition reduce: one thread per 4 dims (rounded up to a warp) x this many thread groups,
# each taking every GROUPS-th partition. With one group, batch 1 x 32768 tokens (kv heads 8,
# 32 or 64 partitions per row, 32 rows) spent more time in the reduce's chain of dependent
# loads than the partition size saved: v2 p256 52% vs p1024 66% of read BW (decode_sweep,
# H200, tensor-core form). Four groups: the call at p256 64.3 -> 55.9 us (round 3); with
# each group's loads issued together (round 4) the reduce adds 2.8 us after the main kernel.
PAGED_REDUCE_GROUPS = 4


def paged_reduce_variant(dtype: str, head_size: int, sinks: bool = False) -> PagedReduceVariant:
    threads = -(-head_size // 4 // 32) * 32 * PAGED_REDUCE_GROUPS
    return PagedReduceVariant(dtype, head_size, threads, sinks)


RESHAPE_CACHE_NUM_THREADS = 128


def reshape_variant(dtype: str, cache: str, slot64: bool) -> ReshapeCacheVariant:
    return ReshapeCacheVariant(dtype, cache, slot64, RESHAPE_CACHE_NUM_THREADS)


# block_tables_from_flashinfer: a block per sequence writes its row of the table. First
# guess, not measured (a row is max_blocks_per_seq int32: next to nothing beside attention).
FLASHINFER_TABLES_NUM_THREADS = 128


def flashinfer_tables_variant() -> FlashInferTablesVariant:
    return FlashInferTablesVariant(FLASHINFER_TABLES_NUM_THREADS)


# flash_with_kvcache's append (cuda_src/kvcache_append.cuh): a block per new token, a
# thread per 16-byte vector of its K and V rows. A first guess, not measured: the copy is
# tokens x KV heads x head dim, next to nothing beside the attention after it.
KVCACHE_APPEND_NUM_THREADS = 128


def kvcache_append_variant(dtype: str) -> KvCacheAppendVariant:
    return KvCacheAppendVariant(dtype, KVCACHE_APPEND_NUM_THREADS)


# paged_prefill's 16-bit queries quantized for the FP8 forward (q_scale): a block per row,
# a thread per 16-byte output vector. A first guess, not measured: the pass reads q once,
# next to nothing beside the attention after it.
QUANTIZE_NUM_THREADS = 128


def quantize_variant(dtype: str) -> QuantizeE4m3Variant:
    return QuantizeE4m3Variant(dtype, QUANTIZE_NUM_THREADS)
