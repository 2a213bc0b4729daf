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
from dataclasses import dataclass as _dataclass


@_dataclass(frozen=True)
class FlashTiles:
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    # Kernel knobs (cuda_src/flash_fwd.cuh, cuattn.flash.FlashFwdVariant); the defaults
    # are the first measured kernel. bench/lab/flash_sweep.py times them; bench/NOTES.md (flash)
    # has what each is predicted to do.
    q_smem: int = 0          # 1: Q re-read from smem per k16 step (32 rows per warp fit);
                             # 2: and compact ldmatrix offsets
    kv_split: bool = False   # separate cp.async groups for K and V (Q K^T waits for K only)
    softmax: int = 0         # bit 0: branch-free rescale of O; bit 1: P packed right after exp


# Head dims the flash kernel is compiled for: the real head dim rounded up to a multiple
# of 32 (the tail columns are zero-filled on load and never stored).
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)

# sm_90 / sm_80 (>= 163 KB of shared memory per block, 2 blocks per SM fit).
_FLASH_BIG_SMEM = {
    32: FlashTiles(64, 128, 4, 2),     # 142 / 168 / 147 regs, smem 36 KB
    # 32 rows per warp, Q re-read from shared memory (halves the K/V ldmatrix traffic per
    # FLOP): hd64 334 / 345 TFLOP/s at S 4096 / 16384 against 297 / 309 for 64x64x4w3s
    # (bench/lab/flash_sweep.py, H200, 2026-11-29). Its masked and split forms spill: below.
    64: FlashTiles(128, 128, 4, 2, q_smem=2, softmax=2),   # 254 regs, smem 80 KB
    96: FlashTiles(64, 64, 4, 2),      # 217 / 225 / 231 regs, smem 60 KB
    # hd128: 379 / 401 TFLOP/s against 322 / 355 for 64x64x4w2s. Without kv_split it
    # measured 388 / 408 but its split-KV form spills 52 B; with it nothing spills.
    128: FlashTiles(128, 64, 4, 2, q_smem=1, kv_split=True, softmax=2),   # 255 regs, 96 KB
    # Above 128, Q fragments are re-read from shared memory each k16 step (Q + O would
    # not fit in registers) and the key loop is one loop with a uniform mask branch.
    160: FlashTiles(64, 64, 4, 2),     # 248 / 249 / 250 regs, smem 100 KB (1 block/SM on sm_80)
    192: FlashTiles(64, 16, 4, 2),     # 244 / 245 / 252 regs (BN 32 spills 12 B), smem 48 KB
    224: FlashTiles(64, 16, 4, 2),     # 255 regs (BN 32 spills 24 bytes), smem 56 KB
    256: FlashTiles(64, 32, 4, 2),     # 249 / 255 / 247 regs, smem 96 KB
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


def flash_tiles(arch: str, head_dim: int, masked: bool) -> FlashTiles:
    """Tiles for ``arch`` (``sm_XY``), a compiled head dim, and whether the form is masked
    (causal or window) or split-KV, which use _FLASH_BIG_SMEM_MASKED where it has an entry.
    """
    if arch in ("sm_86", "sm_87", "sm_89"):
        return _FLASH_SMALL_SMEM[head_dim]
    if masked and head_dim in _FLASH_BIG_SMEM_MASKED:
        return _FLASH_BIG_SMEM_MASKED[head_dim]
    return _FLASH_BIG_SMEM[head_dim]


# Split-KV combine: one warp per (token, head) row.
FLASH_COMBINE_NUM_THREADS = 128
# Split-KV rule for num_splits=0 (cuattn.flash.choose_num_splits): as many splits as keep
# the whole grid within ONE wave of (SMs x resident blocks), each split keeping at least
# FLASH_MIN_TILES_PER_SPLIT key tiles, at most FLASH_MAX_SPLITS. Measured on the H200
# (bench/lab/flash_splits.py, causal bf16 hd128, microseconds by split count): a partial
# second wave costs a whole one, e.g. batch 4 x 1 query x 16384 keys x 32 heads (128
# blocks, 264 slots): 1: 280, 2: 211, 3 (the old round-up rule): 279, 4: 212;
# 1 x 1 x 65536 x 32 heads: 1: 1096, 8: 211 (best; one wave), 16: 217, 64: 251;
# 1 x 64 x 16384 x 16 heads: 16 splits 47 us, best.
FLASH_MIN_TILES_PER_SPLIT = 4
FLASH_MAX_SPLITS = 64
# Shipped (precompiled) head dims; others compile on first use.
FLASH_SHIPPED_HEAD_DIMS = (64, 96, 128, 256)

# paged (paged_attention / reshape_and_cache) -------------------------------------------------
# MEASURED on the H200 (bench/lab/decode_sweep.py, 2026-11-29; bf16, head 128, block 16,
# 32 q heads, L2 flushed, % of the read bandwidth measured in that run, 4032 GB/s):
#   kv heads / batch x ctx     t256 pl0 (old)      t256 pl2           t128 pl0 (chosen)
#   8 / 32 x 4096    v2 p512   72.1                72.7               79.3 (p256 81.7; v1 t256 pl2 84.3)
#   8 / 8 x 32768    v2 p512   75.2                76.5               88.8
#   8 / 1 x 32768    v2 p512   56.5                57.7               64.1
#   32 / 32 x 4096   v2 p512   100                 99                 105
# 4 warps per block: twice the blocks per SM for the same registers, so more loads in
# flight per SM for the group-4 (8 KV head) case whose math per byte left 8-warp blocks
# stalled; the software pipeline (below) gained at most 1.5 points and is off.
PAGED_NUM_THREADS = 128
# Software pipeline of the K and V loads (cuda_src/paged_attention.cuh, PIPELINE): each
# register of a step's K (V) vectors is refilled with the next step's vector as soon as it has
# been unpacked, and the first V batch is issued before the softmax. Written on a CPU-only
# machine against the H200 table in bench/NOTES.md (paged) (kvh 8 = group 4 at 70-77% of read
# BW at batch x ctx >= 128k, 54% at 1 x 32768): predicted to raise group 4 the most, since its
# longer math per step left loads idle. MEASURED (table above): +0.5 to +1.5 points with 256
# threads, -5 to -25 points with 128 (more registers, fewer blocks): off.
# Bit 0: K rotation, bit 1: V rotation + the early first V batch. Compiled for sm_90
# (bf16 hd128 bs16 p512): bit 1 alone costs no register (g4: 118, g1: 92 at min_blocks 2);
# bit 0 makes ptxas double-buffer under the 128-register cap of min_blocks 2 and spill
# (g4: 128 regs, 36 B), while with plain __launch_bounds__(256) it picks g4 100 / g1 97
# registers without spills -- still two 256-thread blocks per SM -- hence paged_min_blocks.
PAGED_PIPELINE = 0
# K rotation only where a warp step holds few K vectors per lane: with more (block 32, head
# >= 192) the doubled live vectors spilled even at 255 registers (hd256 bs16 g4,
# hd96/hd256 bs32 g8), and those variants already have >= 12 loads in flight per lane.
PAGED_PIPELINE_K_MAX_VECS = 8


def paged_pipeline(cache_dtype: str, head_size: int, block_size: int, group: int) -> int:
    """The PIPELINE bits of a paged_attention variant (see PAGED_PIPELINE)."""
    x = 16 if cache_dtype == "e4m3" else 8          # elements per 16-byte x-vector
    ngt = -(-(head_size // x) // (32 // block_size))  # K vectors per lane per cache block
    ku = max(1, min(8 // ngt, 16 // x))              # cache blocks per warp step
    bits = PAGED_PIPELINE
    if ngt * ku > PAGED_PIPELINE_K_MAX_VECS:
        bits &= ~1
    return bits
# Tensor-core form (cuda_src/paged_attention_mma.cuh, cuattn.paged.PagedMmaVariant): the
# group's query heads are the N side of mma.sync, K and V the A side straight from their
# cache layouts, each warp a cp.async ring of STAGES tiles of TILE tokens. Written against
# the CUDA-core kernel's measured shortfall at group 4 (76-85% of read bandwidth, bound by
# its GROUP dot products per loaded element, bench/NOTES.md paged); first guesses: 96 KB of
# ring per 4-warp block at hd128 (two blocks, ~128 KB of loads in flight per SM).
@_dataclass(frozen=True)
class PagedMmaTiles:
    num_warps: int = 4
    stages: int = 3
    tile: int = 16          # tokens per warp step (16 or 32)
    p_split: bool = True    # P as bf16/f16 hi + lo (two P.V MMAs): ~fp32 accuracy
    # K/V copies with an L2 evict-first policy (read once). MEASURED (decode_sweep, H200,
    # clean L2, us off -> on): 32 x 4096 kvh 8 v2 p256 143 -> 133, 1 x 32768 p1024 40.7 ->
    # 40.5, v1 rows within 1%. After a dirty flush it helps batch 1 (49.1 -> 45.8) and costs
    # v1 at large batch 3-5% (139 -> 143 at 32 x 4096): on, as the clean state is the real one.
    evict_first: bool = True


PAGED_MMA = PagedMmaTiles()
# Smallest GQA group that takes the tensor-core form (16-bit caches, head size % 16 == 0).
# MEASURED (decode_sweep, H200, hd128 bs16, % of read BW, CUDA-core t128 -> tensor-core):
# group 4: 32 x 4096 v2 p512 84 -> 92 (v1 66 -> 98), 8 x 32768 p512 87 -> 98, 1 x 32768
# p1024 56 -> 66; and even group 1 (7 of 8 MMA columns idle): 32 x 4096 p512 104 -> 109,
# 1 x 32768 p1024 92 -> 94. So every group.
PAGED_MMA_MIN_GROUP = 1


def paged_mma_tiles(head_size: int) -> PagedMmaTiles:
    """Ring shape for a head size: above 128 two stages keep two blocks per SM up to hd192."""
    return PAGED_MMA if head_size <= 128 else PagedMmaTiles(stages=2)


def paged_uses_mma(cache_dtype: str, head_size: int, group: int) -> bool:
    """Whether paged_attention runs the tensor-core form for this cache and group."""
    return cache_dtype != "e4m3" and head_size % 16 == 0 and group >= PAGED_MMA_MIN_GROUP


# Query heads served by one thread block: the largest divisor of the GQA ratio <= this.
# Every K/V byte is read num_heads / num_kv_heads / group times (once for ratios <= 8).
PAGED_MAX_GROUP = 8
PAGED_PARTITION_SIZES = (128, 256, 512, 1024)
# Partition reduce: one thread per 4 dims (rounded up to a warp) x this many thread groups,
# each taking every GROUPS-th partition. With one group, batch 1 x 32768 tokens (kv heads 8,
# 32 or 64 partitions per row, 32 rows) spent more time in the reduce's chain of dependent
# loads than the partition size saved: v2 p256 52% vs p1024 66% of read BW (decode_sweep,
# H200, tensor-core form). Four groups: the call at p256 64.3 -> 55.9 us (round 3); with
# each group's loads issued together (round 4) the reduce adds 2.8 us after the main kernel.
PAGED_REDUCE_GROUPS = 4
RESHAPE_CACHE_NUM_THREADS = 128
# Shipped (precompiled) set: bf16/f16 x these head sizes x block 16 x v1/v2 x groups.
PAGED_SHIPPED_HEAD_SIZES = (64, 128, 256)
PAGED_SHIPPED_BLOCK_SIZES = (16,)
PAGED_SHIPPED_GROUPS = (1, 4, 8)
# version="auto": v1 needs no reduce launch and no scratch, but one thread block per
# (head group, sequence) walks the whole context. MEASURED with 128 threads (table above):
# v2 at 512-token partitions beat or tied v1 at every configuration with more than one
# partition (kv 8, 32 x 4096: v1 t128 57% vs v2 79%; kv 32: v1 88% vs v2 105%), so auto
# takes v1 only when one partition covers the context.


# The CUDA-core form's partition when the call names none (vLLM's default).
PAGED_PARTITION_SIZE = 512


def paged_version(num_ctas_v1: int, max_context: int, partition_size: int, num_sms: int) -> str:
    """CUDA-core form: "v1" or "v2" for version="auto" (a host-side bound: no data is read)."""
    return "v1" if max_context <= partition_size else "v2"


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


def paged_mma_plan(num_ctas_v1: int, max_context: int, num_sms: int,
                   partition_size: int | None = None) -> tuple[str, int]:
    """(version, partition_size) for version="auto"; a given partition_size is kept."""
    if num_ctas_v1 >= num_sms:
        return "v1", 0
    ps = partition_size or paged_mma_partition(num_ctas_v1, max_context, num_sms)
    return ("v1", 0) if max_context <= ps else ("v2", ps)


def paged_min_blocks(cache_dtype: str, head_size: int, block_size: int, group: int,
                     pipeline: int = 0) -> int:
    """__launch_bounds__(256, min_blocks) of a paged_attention variant.

    A plain __launch_bounds__(256) let ptxas (NVRTC 12.x, sm_90) pick register caps of 64 or
    80 for some variants and spill; 2 (<= 128 registers, two blocks per SM) compiles the
    16-bit variants with group <= 4 and group * head_size < 1024 without spills; group 8,
    group 4 at head 256, and fp8 caches (whose conversion needs more registers, in software
    before sm_89) with group >= 4 spill at 128, so they get 1 (up to 255 registers).
    From a sweep of sm_90 compiles (every head/block size, group 1-8, v1/v2, ALiBi),
    2026-11-29; the occupancy effect is unmeasured."""
    if group >= 8 or group * head_size >= 1024 or (cache_dtype == "e4m3" and group >= 4):
        return 1
    if pipeline & 1:
        return 0       # K rotation: let ptxas pick (a 128 cap spills, see PAGED_PIPELINE)
    return 2
