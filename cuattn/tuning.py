"""The one tuning table: every launch-shape choice of every kernel, with the measurement
behind it. C++ receives these as template parameters and derives everything else.
"""
from __future__ import annotations

# merge_attn_states / merge_states --------------------------------------------------------
# One thread per 16-byte vector; 256 threads per block. H200, bf16, 16384 tokens x 32 heads
# x 128: see bench/NOTES.md (merge v1) for the measured bandwidth.
MERGE_NUM_THREADS = 256

# Head sizes each kernel ships precompiled (precompile's default set); anything else
# that the kernel supports compiles on first use.
MERGE_SHIPPED_HEAD_SIZES = (64, 128, 256)

# flash (flash_forward / flash_varlen_forward) ---------------------------------------------
# (arch family, compiled head dim, causal) -> FlashTiles. Each warp owns BLOCK_M / NUM_WARPS
# query rows (16 or 32: a multiple of the mma m16 tile); Q fragments stay in registers, so
# registers grow with (rows per warp) x head dim and the larger head dims use 16 rows/warp.
# Shared memory = Q tile + STAGES x (K tile + V tile) = 2 bytes x HEAD_DIM x
# (BLOCK_M + 2 x STAGES x BLOCK_N); limits per block: sm_90 227 KB, sm_80 163 KB,
# sm_86/sm_89 99 KB.
# FIRST GUESSES, NOT YET MEASURED (written on a machine with no GPU; the reasoning is
# registers <= 255 without spills, two resident blocks per SM where shared memory allows,
# and FlashAttention-2's own tile choices). Replace each line with the H200 measurement.
from dataclasses import dataclass as _dataclass


@_dataclass(frozen=True)
class FlashTiles:
    block_m: int
    block_n: int
    num_warps: int
    stages: int


# Head dims the flash kernel is compiled for: the real head dim rounded up to a multiple
# of 32 (the tail columns are zero-filled on load and never stored).
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

# sm_90 / sm_80 (>= 163 KB of shared memory per block).
_FLASH_BIG_SMEM = {
    # hd <= 64: 32 rows per warp halves the shared-memory reads of K and V per FLOP
    # (Q 32 + O 64 + S 64 registers). smem 16 + 2x32 = 80 KB -> 2 blocks/SM on sm_90.
    32: FlashTiles(128, 64, 4, 2),
    64: FlashTiles(128, 64, 4, 2),
    # hd 96-128: 16 rows per warp (Q 32 + O 64 + S 32 registers at hd128);
    # 128 rows x 8 warps share each K/V tile. smem 32 + 2x32 = 96 KB at hd128.
    96: FlashTiles(128, 64, 8, 2),
    128: FlashTiles(128, 64, 8, 2),
    160: FlashTiles(64, 64, 4, 2),
    192: FlashTiles(64, 64, 4, 2),
    # hd 224-256: Q 64 + O 128 registers per thread leave room for a 32-key S tile only.
    # smem 32 + 2x32 = 96 KB at hd256 -> 2 blocks/SM on sm_90.
    224: FlashTiles(64, 32, 4, 2),
    256: FlashTiles(64, 32, 4, 2),
}
# sm_86 / sm_89 (99 KB per block): same register shapes, tiles trimmed to fit.
_FLASH_SMALL_SMEM = dict(_FLASH_BIG_SMEM)
_FLASH_SMALL_SMEM.update({
    128: FlashTiles(128, 32, 8, 2),   # 32 + 2x16 = 64 KB
    160: FlashTiles(64, 32, 4, 2),
    192: FlashTiles(64, 32, 4, 2),
})


def flash_tiles(arch: str, head_dim: int, causal: bool) -> FlashTiles:
    """Tiles for ``arch`` (``sm_XY``), a compiled head dim and the causal flag.

    Causal currently uses the same tiles as non-causal (not yet measured apart).
    """
    table = _FLASH_SMALL_SMEM if arch in ("sm_86", "sm_87", "sm_89") else _FLASH_BIG_SMEM
    return table[head_dim]


# Split-KV combine: one warp per (token, head) row.
FLASH_COMBINE_NUM_THREADS = 128
# Split-KV rule for num_splits=0: split only when the grid fills less than this fraction
# of (SMs x resident blocks), each split keeps at least this many key tiles, at most
# FLASH_MAX_SPLITS splits (FlashAttention-2's heuristic has the same shape; unmeasured here).
FLASH_SPLIT_FILL_FRACTION = 0.8
FLASH_MIN_TILES_PER_SPLIT = 4
FLASH_MAX_SPLITS = 64
# Shipped (precompiled) head dims; others compile on first use.
FLASH_SHIPPED_HEAD_DIMS = (64, 96, 128, 256)

# paged (paged_attention / reshape_and_cache) -------------------------------------------------
# First guesses, written before any H200 measurement (bench/suite_decode.py measures them;
# bench/NOTES_decode.md records the numbers). Replace each with the measured choice.
#
# 256 threads (8 warps): K phase one cache block per warp per step with ~8 16-byte loads in
# flight per lane; V phase the whole thread block reads one block's V (head 128, block 16,
# bf16 = 256 vectors) per step, 8 blocks deep.
PAGED_NUM_THREADS = 256
# Query heads served by one thread block: the largest divisor of the GQA ratio <= this.
# Every K/V byte is read num_heads / num_kv_heads / group times (once for ratios <= 8).
PAGED_MAX_GROUP = 8
PAGED_PARTITION_SIZES = (128, 256, 512, 1024)
PAGED_REDUCE_MIN_THREADS = 32          # reduce: one thread per 4 dims, at least one warp
RESHAPE_CACHE_NUM_THREADS = 128
# Shipped (precompiled) set: bf16/f16 x these head sizes x block 16 x v1/v2 x groups.
PAGED_SHIPPED_HEAD_SIZES = (64, 128, 256)
PAGED_SHIPPED_BLOCK_SIZES = (16,)
PAGED_SHIPPED_GROUPS = (1, 4, 8)
# version="auto": v1 needs no reduce launch and no scratch, but one thread block per
# (head group, sequence) walks the whole context, so it only wins when those blocks alone
# fill the GPU several times over and the context is short. vLLM's own rule (v1 when
# max_seq_len <= 8192 and (one partition or num_seqs * num_heads > 512)) is the reference.
PAGED_V1_MIN_WAVES = 4                 # thread blocks >= this x SM count
PAGED_V1_MAX_CONTEXT = 4096            # tokens (block_tables.shape[1] * block_size)


def paged_version(num_ctas_v1: int, max_context: int, partition_size: int, num_sms: int) -> str:
    """"v1" or "v2" for version="auto" (a host-side bound only: no data is read)."""
    if max_context <= partition_size:
        return "v1"                    # one partition: v2 would only add the reduce
    if num_ctas_v1 >= PAGED_V1_MIN_WAVES * num_sms and max_context <= PAGED_V1_MAX_CONTEXT:
        return "v1"
    return "v2"
