// FlashAttention forward on Hopper's warpgroup MMA (sm_90a): the algorithm of flash_fwd.cuh
// (Dao 2023) in FlashAttention-3's form (Shah et al. 2024): S = Q K^T and O += P V on
// wgmma.mma_async (Q and K from 128-byte-swizzled shared memory by descriptor, P from
// registers as the A operand, V read transposed by its descriptor; vLLM's paged K and V in the
// layouts their boxes land, Traits' shared memory), warp-specialized: a producer warpgroup
// loads Q and the K / V tiles into STAGES-deep rings guarded by mbarriers (by TMA, paged
// caches a box per cache block; a varlen V tile crossing its sequence's end and arrays a
// tensor map cannot describe by cp.async), and 1-3 consumer warpgroups of 64 query rows each
// compute, with setmaxnreg moving registers from the producer to them. Inside a consumer
// warpgroup the softmax of tile n runs while O += P V of tile n-1 is in flight
// (intra-warpgroup overlap). The grid is persistent (for_each_tile): each block walks several
// row tiles (dense calls by a static stride, varlen ones taking tiles from a counter), and the
// producer loads the next one's K / V (and Q, where O has a tile of its own) under the last
// steps and the epilogue of the current one. The consumers' accumulators have mma.sync's
// fragment layout, so the online softmax, the mask, the logits hooks, the key-tile order and
// the epilogues are the parts flash_fwd.cuh's kernel is built of (flash/). (The cp.async
// producer's varlen calls keep one block per row tile.)
#pragma once
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/row_chunks.cuh"
#include "common/wgmma.cuh"
#include "common/wgmma_fp8_ops.cuh"
#include "params/flash_fwd.cuh"
#include "flash/features.cuh"
#include "flash/seqlen.cuh"
#include "flash/key_tiles.cuh"
#include "flash/hook_and_mask.cuh"
#include "flash/softmax.cuh"
#include "flash/epilogue.cuh"

namespace cuattn {

// Every knob of one sm_90a forward kernel (cuattn.keys.FlashFwdSm90Variant, chosen by
// cuattn/tuning.py) and the constants derived from them. MASK, SPLIT and FEATURES mean what
// they mean in FlashFwdTraits (kPackGqa excepted: one query head per block); TMA: the
// producer loads by tensor map (FlashTmaMaps), else by cp.async; KV: dense K / V, or a paged
// cache (paged_prefill: by TMA, a box per cache block), NHD (kKvPagedNhd) or vLLM's layout
// (kKvPagedVllm, its K and V tiles laid out as their boxes land them: Shared memory below).
// T: fp16 / bf16, or e4m3 (the E4M3 form: Q, K and V of one byte, OutT the output's 16-bit
// type; below).
template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int STAGES_, bool TMA_,
          int MASK_, bool SPLIT_, int FEATURES_, int KV_, typename OutT_ = T_>
struct FlashFwdSm90Traits : FlashFeatures<FEATURES_> {
  using T = T_;
  using OutT = OutT_;
  using Mask = BandMask<MASK_>;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_N = BLOCK_N_;
  static constexpr int STAGES = STAGES_;
  static constexpr bool TMA = TMA_;
  static constexpr bool SPLIT = SPLIT_;
  static constexpr bool PAGED = KV_ != kKvDense;
  static constexpr bool VLLM = KV_ == kKvPagedVllm;
  // E4M3 (FlashAttention-3's FP8 forward): S = Q K^T and O += P V on e4m3 wgmma (k32), fp32
  // accumulators and softmax. The e4m3 wgmma reads only K-major B operands, so the producer
  // warpgroup transposes each V tile, landed by TMA in the V ring, into a V^T ring
  // ([dim][key], transpose_v) for the consumers; P = 2^P_SHIFT exp(S - max) (FlashAttention-3's
  // Max_offset: P in [0, 256], e4m3 normals reach down to 2^-14 of the row max; WarpSoftmax
  // divides the factor out of the sum and the accumulator), packed to e4m3 in registers.
  // Dense or NHD-paged K / V by TMA only (vLLM's V cache lands [dim][key] in 16-key rows, no
  // layout the V^T ring takes); the head dim a multiple of 128 (whole 128-byte rows).
  static constexpr bool E4M3 = sizeof(T_) == 1;
  static constexpr int ELEM = sizeof(T_);
  static constexpr int COLS = 128 / ELEM;       // columns of a 128-byte-swizzled column block
  static constexpr int P_SHIFT = E4M3 ? 8 : 0;

  // Warpgroup 0 produces; warpgroups 1 .. NUM_WG compute, 64 query rows each.
  static constexpr int NUM_WG = BLOCK_M / 64;
  static constexpr int PRODUCER_THREADS = 128;
  static constexpr int CONSUMER_THREADS = 128 * NUM_WG;
  static constexpr int THREADS = PRODUCER_THREADS + CONSUMER_THREADS;
  // setmaxnreg: the producer keeps PRODUCER_REGS, each consumer thread gets CONSUMER_REGS
  // (all within the 64K registers of the SM: 128 x (PRODUCER_REGS + NUM_WG x CONSUMER_REGS)).
  // The TMA producer issues from one thread (24, the least setmaxnreg takes, spills its
  // walk over the schedule: 32); the cp.async producer and the TMA producer that fetches a
  // varlen schedule (FETCH_VARLEN: only where two consumer warpgroups leave it the
  // registers) need 40; the consumers take what the launch's pool leaves (LAUNCH_REGS below).
  static constexpr bool FETCH_VARLEN = TMA && NUM_WG < 3;
  static constexpr int PRODUCER_REGS = E4M3 ? 56 : TMA && NUM_WG == 3 ? 32 : 40;
  static constexpr int CONSUMER_REGS = NUM_WG == 3 ? (TMA ? 160 : 152) : E4M3 ? 224 : 232;
  // What the shared parts (flash/) read: each consumer warp owns one m16 tile of rows.
  static constexpr int WARP_M = 16;
  static constexpr int M_TILES = 1;
  static constexpr int D_CHUNKS = HEAD_DIM / 8;       // 16-byte chunks per 16-bit row (O's)
  static constexpr int QK_K_STEPS = HEAD_DIM * ELEM / 32;   // k16 (e4m3: k32) steps of S = Q K^T
  static constexpr int S_N_TILES = BLOCK_N / 8;
  static constexpr int PV_K_STEPS = BLOCK_N * ELEM / 32;    // k16 (k32) steps of O += P V
  static constexpr int O_N_TILES = HEAD_DIM / 8;
  static constexpr bool BRANCH_FREE_RESCALE = true;
  static constexpr int Q_LOADS_PER_LANE = WARP_M * D_CHUNKS / 32;   // the output store
  static constexpr int STORE_UNROLL = Q_LOADS_PER_LANE;

  // Shared memory (tiles 128-byte swizzled, common/wgmma.cuh): one 64-row Q tile per consumer
  // warpgroup, the K ring, the V ring (tiles [key][dim]; VLLM's as its boxes land them: K
  // [key / 8][16-byte chunk][key % 8], no-swizzle core matrices of 8 keys x 16 bytes; V
  // [key / 16][dim][key % 16], 32-byte-swizzled rows, or for blocks of 8
  // [key / 8][dim][key % 8], no-swizzle), the O tile where it fits, then the mbarriers: Q
  // full / empty, K full / empty and V full / empty per stage. 1024 bytes of slack align the
  // base to the swizzle's 1024-byte period. The epilogue stages O (as T) through shared
  // memory for 16-byte stores: through a tile of its own where the block's 227 KB hold one
  // (O_TILE), so that the next row tile's Q loads under it; else through the Q tiles (O_IN_Q:
  // hd256), which are then released only after the epilogue. (SPLIT stores fp32 partials
  // straight from the accumulators: neither.) E4M3: the V^T ring follows the V ring (tiles of
  // HEAD_DIM rows of 128 keys per 128-byte column block), its V-raw full barriers (TMA
  // landed) the other mbarriers; O (16-bit) is twice Q's bytes, so it takes an O tile.
  static constexpr int WG_Q_BYTES = 64 * HEAD_DIM * ELEM;
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * ELEM;
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * ELEM;
  static constexpr int VT_TILE_BYTES = E4M3 ? (BLOCK_N + 127) / 128 * 128 * HEAD_DIM : 0;
  static constexpr int O_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int BAR_BYTES = 8 * (2 + (E4M3 ? 5 : 4) * STAGES);
  static constexpr int SLOT_BYTES = 2 * 16;   // the fetched schedule's ring of two items
  static constexpr int SMEM_NO_O = 1024 + Q_BYTES +
      STAGES * (2 * KV_TILE_BYTES + VT_TILE_BYTES) + BAR_BYTES + SLOT_BYTES;
  static constexpr bool O_TILE = !SPLIT && SMEM_NO_O + O_BYTES <= 227 * 1024;
  static constexpr bool O_IN_Q = !SPLIT && !O_TILE;
  static_assert(!O_IN_Q || Q_BYTES >= O_BYTES, "O staged in the Q tiles: they must hold it");
  static constexpr int SMEM_BYTES = SMEM_NO_O + (O_TILE ? O_BYTES : 0);
  // A full barrier's arrivals: the one TMA-issuing thread (its expect_tx carries the bytes),
  // or every producer thread (cp.async.mbarrier.arrive once its copies landed).
  static constexpr int FULL_ARRIVALS = TMA ? 1 : PRODUCER_THREADS;
  // Named barriers: the producer warpgroup's (varlen: its V edge copies, a fetched item),
  // then one per consumer warpgroup (O_IN_Q: its wgmmas have read its Q tile before the
  // epilogue reuses it).
  static constexpr int PRODUCER_BARRIER = 1;
  static constexpr int CONSUMER_BARRIER_0 = 2;
  // Softcap forms of two consumer warpgroups take turns issuing their GEMMs (FlashAttention-3's
  // ping-pong: warpgroup w waits on PINGPONG_BARRIER_0 + w for its turn and, once its wgmmas
  // are issued, opens the other's), so that one warpgroup's softmax runs under the other's
  // GEMMs: tanh and exp2 of both at once would share each SM sub-partition's MUFU pipe, which
  // one warpgroup's softmax nearly fills (MEASURED, bench/NOTES.md "Session 12": hd64
  // 0.92-0.93x the time; hd128 / hd256 within 2%).
  static constexpr bool PINGPONG = FlashFeatures<FEATURES_>::SOFTCAP && NUM_WG == 2;
  static constexpr int PINGPONG_BARRIER_0 = 4;
  // Softcap alone (Logits::MONOTONE): on tiles without a mask, each row's max is taken from
  // the raw scores, before the tanh, so that no exp2 waits for the tanh of the whole tile.
  // At head dims of 128 and up (MEASURED, bench/NOTES.md "Session 12": paged 0.96x, hd256
  // causal 0.87x; hd64, where the MUFU pipe bounds the step, 1.03-1.09x: there not).
  static constexpr bool RAW_MAX = FlashFeatures<FEATURES_>::Logits::MONOTONE && HEAD_DIM >= 128;
  // The schedule (for_each_tile): under a right edge (causal or a window) a block walks
  // pairs of row tiles, a heavy one and a light one.
  static constexpr bool PAIR_TILES = Mask::BAND;
  // The producer's copies (copy_tile): the warpgroup shares a tile's chunks as
  // common/row_chunks.cuh lays out; EVEN_ROWS: each thread takes one column chunk of every
  // ROWS_PER_PASS-th row (not at head dim 192).
  using TileChunks = RowChunks<PRODUCER_THREADS, D_CHUNKS>;
  static constexpr bool EVEN_ROWS = TileChunks::EVEN;
  static constexpr int ROWS_PER_PASS = TileChunks::ROWS_PER_PASS;

  static_assert(sizeof(T) == 2 || E4M3, "fp16 / bf16, or e4m3");
  static_assert(sizeof(OutT) == 2 && (E4M3 || sizeof(OutT) == sizeof(T)), "a 16-bit output");
  static_assert(HEAD_DIM % COLS == 0 && HEAD_DIM <= 256, "head dim: whole 128-byte column blocks");
  static_assert(!E4M3 || (TMA_ && KV_ != kKvPagedVllm && BLOCK_N % 32 == 0),
                "E4M3: dense or NHD-paged K / V by TMA, key tiles of whole k32 steps");
  static_assert(BLOCK_M % 64 == 0 && BLOCK_M <= 192, "one to three consumer warpgroups");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "wgmma N of S = Q K^T");
  // The block launches with LAUNCH_REGS registers per thread (min_blocks 1: ptxas takes all
  // of 65536 / THREADS, in units of 8), and setmaxnreg.inc waits until the registers it asks
  // for are free in the block's pool: the producer's release has to cover the consumers'
  // gain, or they wait forever (hd128 at 32 / 240 hung).
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
  static_assert(PRODUCER_THREADS * (LAUNCH_REGS - PRODUCER_REGS) >=
                    CONSUMER_THREADS * (CONSUMER_REGS - LAUNCH_REGS),
                "register split: setmaxnreg.inc would wait for registers no one frees");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert((FEATURES_ & kPackGqa) == 0, "one query head per block");
  static_assert(KV_ == kKvDense || TMA_, "paged caches by TMA");
  // Paged: the rows of one TMA box, which stays inside one cache block: the block size, at
  // most the largest power of two dividing BLOCK_N (tiles start at multiples of BLOCK_N);
  // at least 8 (NHD: a box starts on the 1024-byte period of the swizzle; vLLM: whole core
  // matrices). cuattn/_tma.py encodes the maps' boxes by the same rule (paged_box_rows).
  static constexpr int BN_POW2 = BLOCK_N_ & -BLOCK_N_;
  static __device__ __forceinline__ int box_rows(int block_shift) {
    return min(BN_POW2, 1 << block_shift);
  }
  // VLLM's V boxes hold at most 16 keys: per dim a row of 16 keys is one 32-byte-swizzled
  // row (SW32 tiles), of 8 keys (blocks of 8) a 16-byte row of a no-swizzle core matrix.
  static constexpr int VLLM_V_BOX = 16;
  static __device__ __forceinline__ int v_box_rows(int block_shift) {
    return VLLM ? min(box_rows(block_shift), VLLM_V_BOX) : box_rows(block_shift);
  }
};

// The producer's copies of one ROWS x HEAD_DIM tile (rows row0 .., `limit` valid: rows at
// or past it and chunks past head_dim are zero-filled, so a zero V row keeps 0 * garbage
// out of P V) into a 128-byte-swizzled tile at `dst`, 64-row column blocks for Q
// (GROUP_ROWS = 64) or the whole tile (GROUP_ROWS = ROWS).
template <typename Tr, int ROWS, int GROUP_ROWS>
__device__ __forceinline__ void copy_tile(u32 dst, const typename Tr::T* src, long long stride,
                                          int row0, int limit, int head_dim_chunks, int ptid) {
  constexpr int D_CHUNKS = Tr::D_CHUNKS;
  constexpr int PASSES = Tr::TileChunks::template passes<ROWS>();
  auto dst_of = [&](int r, int ch) {
    return dst + (r / GROUP_ROWS) * (GROUP_ROWS * Tr::HEAD_DIM * 2) +
           sw128_offset<GROUP_ROWS>(r % GROUP_ROWS, ch);
  };
  if constexpr (Tr::EVEN_ROWS) {
    // a fixed column chunk, every ROWS_PER_PASS-th row; one pointer stepped along (the
    // producer keeps few registers: a rolled loop)
    const auto first = Tr::TileChunks::at(0, ptid);
    const int ch = first.ch, r0 = first.row;
    const bool ch_ok = ch < head_dim_chunks;
    const typename Tr::T* ptr = src + (long long)(row0 + r0) * stride + ch * 8;
    const long long step = (long long)Tr::ROWS_PER_PASS * stride;
#pragma unroll 1
    for (int it = 0; it < PASSES; ++it) {
      const int r = it * Tr::ROWS_PER_PASS + r0;
      if (PASSES * Tr::ROWS_PER_PASS == ROWS || r < ROWS) {
        const bool ok = ch_ok && row0 + r < limit;
        cp_async_16(dst_of(r, ch), ok ? ptr : src, ok ? 16 : 0);
      }
      ptr += step;
    }
  } else {
#pragma unroll 1
    for (int it = 0; it < PASSES; ++it) {
      const auto at = Tr::TileChunks::at(it, ptid);
      const int r = at.row, ch = at.ch;
      if (PASSES * Tr::PRODUCER_THREADS == ROWS * D_CHUNKS || r < ROWS) {
        const bool ok = ch < head_dim_chunks && row0 + r < limit;
        cp_async_16(dst_of(r, ch), ok ? src + (long long)(row0 + r) * stride + ch * 8 : src,
                    ok ? 16 : 0);
      }
    }
  }
}

// The tensor maps of a call (cuattn/_tma.py encodes them per call): Q, K and V as 4-d
// tensors (head dim, row, head, batch; varlen: batch 1), 128-byte swizzle, boxes of 64
// columns x 64 rows (Q) or x BLOCK_N rows (K, V), out-of-bounds elements zero. Unused
// (zeros) by cp.async forms.
struct FlashTmaMaps {
  TmaDescriptor q, k, v;
};

// The block's shared memory from its 1024-aligned base (Tr::SMEM_BYTES' layout): the Q tiles,
// the K ring, the V ring (E4M3: and the V^T ring), the O tile (Tr::O_TILE; else O is staged in
// the Q tiles), then the mbarriers: Q full, Q empty, per stage K full, K empty, V full, V empty
// (E4M3: then per stage V raw full; V full / empty are then the V^T ring's); then the two slots
// of a fetched schedule's items.
template <typename Tr>
struct Sm90Smem {
  u32 q;
  __device__ u32 k_tile(int s) const { return q + Tr::Q_BYTES + s * Tr::KV_TILE_BYTES; }
  __device__ u32 v_tile(int s) const { return k_tile(Tr::STAGES + s); }
  __device__ u32 vt_tile(int s) const { return v_tile(Tr::STAGES) + s * Tr::VT_TILE_BYTES; }
  __device__ u32 o_stage() const { return Tr::O_TILE ? vt_tile(Tr::STAGES) : q; }
  __device__ u32 q_full() const { return vt_tile(Tr::STAGES) + (Tr::O_TILE ? Tr::O_BYTES : 0); }
  __device__ u32 q_empty() const { return q_full() + 8; }
  __device__ u32 k_full(int s) const { return q_full() + 8 * (2 + s); }
  __device__ u32 k_empty(int s) const { return q_full() + 8 * (2 + Tr::STAGES + s); }
  __device__ u32 v_full(int s) const { return q_full() + 8 * (2 + 2 * Tr::STAGES + s); }
  __device__ u32 v_empty(int s) const { return q_full() + 8 * (2 + 3 * Tr::STAGES + s); }
  __device__ u32 v_raw_full(int s) const { return q_full() + 8 * (2 + 4 * Tr::STAGES + s); }
  __device__ u32 item_slot(int i) const { return q_full() + Tr::BAR_BYTES + 16 * i; }
};

// The dynamic schedule of a varlen call (cuattn/_tma.py): a counter the host zeroes before
// the launch; null when the grid is the schedule.
struct FlashSm90Schedule {
  unsigned* tile_counter;   // [1]
};

// One row tile's work: its sequence's query rows and keys, its first row, query head, KV
// head, batch entry and split, the key tiles it visits; and its place in the block's
// pipeline: the K / V ring step of its first key tile (steps counted over the block's tiles
// so far, RingSlot) and the phase of its Q barriers (the block's tile count, mod 2).
struct Sm90Block {
  SeqRange qr, kr;
  int m0, head, kvh, b, split;
  KeyTiles tiles;
  int first_step, q_phase;
};

// A paged V tile crossing its sequence's end, in the ring's layout: chunk c to thread
// c % 128, each key at its block-table entry, keys past the sequence and columns past
// head_dim zero-filled (a rolled loop: the producer keeps few registers, and a sequence has
// one such tile per row tile at most). NHD: as copy_tile lays a BLOCK_N-row tile out. VLLM
// (V (num_blocks, kvh, head dim, block)): a chunk is 8 keys of one dim, the keys of a chunk
// past the sequence zero-filled by the copy's source size, laid out as the V boxes land
// (Traits::v_box_rows: 16 keys per 32-byte-swizzled row, or 8 per 16-byte row).
template <typename Tr>
__device__ __forceinline__ void copy_paged_tile(u32 dst, const FlashFwdParams& p,
                                                const Sm90Block& blk, int key0, int ptid) {
  using T = typename Tr::T;
  constexpr int BN = Tr::BLOCK_N, D_CHUNKS = Tr::D_CHUNKS, HD = Tr::HEAD_DIM;
  const T* v_head = static_cast<const T*>(p.v) + blk.kvh * p.v_stride_head;
  const int* table = paged_table(p, blk.b);
  if constexpr (Tr::VLLM) {
#pragma unroll 1
    for (int c = ptid; c < BN / 8 * HD; c += Tr::PRODUCER_THREADS) {
      const int wide = value_now(p.block_shift) >= 4;   // v_box_rows 16: 32-byte rows
      const int kc = c / HD, d = c % HD, key = key0 + kc * 8;
      const int keys = d < p.head_dim ? min(max(blk.kr.len - key, 0), 8) : 0;
      const T* src = v_head;
      if (keys > 0) {
        src += paged_block(p, table, key) * p.v_stride_block + d * p.v_stride_dim +
               paged_slot(p, key);
      }
      // the chunk's row (a dim of 8 or 16 keys), then its 16 bytes in it (32-byte swizzle)
      const u32 row = (kc >> wide) * HD + d;
      cp_async_16(dst + (((row << wide) | (wide & (kc ^ (d >> 2)))) << 4), src, keys * 2);
    }
    return;
  }
#pragma unroll 1
  for (int c = ptid; c < BN * D_CHUNKS; c += Tr::PRODUCER_THREADS) {
    const int r = c / D_CHUNKS, ch = c % D_CHUNKS, key = key0 + r;
    const bool ok = key < blk.kr.len && ch < p.head_dim / 8;
    const T* src = v_head;
    if (ok) {
      src += paged_block(p, table, key) * p.v_stride_block +
             paged_slot(p, key) * p.v_stride_row + ch * 8;
    }
    cp_async_16(dst + sw128_offset<BN>(r, ch), src, ok ? 16 : 0);
  }
}

// E4M3: the descale of (batch entry b, KV head kvh) (FlashAttention-3's (batch, nheads_kv)
// float32 arrays), 1 where the call gave none.
__device__ __forceinline__ float descale_of(const void* d, int stride_batch, int stride_head,
                                            int b, int kvh) {
  return d == nullptr ? 1.f : static_cast<const float*>(d)[b * stride_batch + kvh * stride_head];
}

// Whether the call packs its sequences' query rows (cu_seqlens_q): every paged call does.
template <typename Tr>
__device__ __forceinline__ bool varlen_call(const FlashFwdParams& p) {
  return Tr::PAGED || p.cu_seqlens_q != nullptr;
}

// The schedule, which both roles walk: `next(k, m_block, head, z)` names the block's k-th
// item (kItem), one to pass over (kSkip) or the end (kEnd), and for_each_tile builds each
// row tile's Sm90Block (its place in the ring counted here) for `body`. ONE: the block's
// first item only, no loop (for a caller that keeps few registers).
enum Sm90Next { kEnd, kSkip, kItem };

template <typename Tr, bool ONE = false, typename Next, typename F>
__device__ __forceinline__ void for_each_tile(const FlashFwdParams& p, Next&& next, F&& body) {
  int step = 0, n_tiles = 0;   // K / V tiles and row tiles walked so far
  auto visit = [&](unsigned m_block, unsigned head, unsigned z) {
    Sm90Block blk;
    blk.b = Tr::SPLIT ? z / unsigned(p.num_splits) : z;
    blk.split = Tr::SPLIT ? z % unsigned(p.num_splits) : 0;
    blk.head = head;
    blk.kvh = head / unsigned(p.head_group);
    blk.qr = seq_range(p.cu_seqlens_q, blk.b, p.seqlen_q);
    blk.kr = key_range<Tr::PAGED>(p, blk.b);
    blk.m0 = m_block * Tr::BLOCK_M;
    if (blk.m0 >= blk.qr.len) return;   // a varlen sequence shorter than the longest
    const int m_last = min(blk.m0 + Tr::BLOCK_M, blk.qr.len) - 1;
    const typename Tr::Mask mask(blk.qr.len, blk.kr.len, p.window_left, p.window_right);
    blk.tiles = key_tiles<Tr>(mask, blk.m0, m_last, blk.kr.len, blk.split, p.num_splits);
    blk.first_step = step;
    blk.q_phase = n_tiles & 1;
    body(blk, mask);
    step += blk.tiles.n_steps;
    ++n_tiles;
  };
  if constexpr (ONE) {
    unsigned m_block, head, z;
    if (next(0u, m_block, head, z) == kItem) visit(m_block, head, z);
  } else {
#pragma unroll 1
    for (unsigned k = 0;; ++k) {
      unsigned m_block, head, z;
      const Sm90Next got = next(k, m_block, head, z);
      if (got == kEnd) break;
      if (got == kSkip) continue;
      visit(m_block, head, z);
    }
  }
}

// The grid as the schedule. Dense calls launch one block per SM (a persistent grid: a tile's
// loads run under the last steps and the epilogue of the one before), each striding over
// the grid's items: item w is a row tile of one head and one batch x split entry (tiles
// fastest, heavy first, then heads, as the hardware would order a 3-d grid), or under a
// right edge (Tr::PAIR_TILES) the pair of tiles m_blocks - 1 - j and j: where a row's keys
// grow with it (causal, a wide window) their key tiles add up to about the same for every j,
// and a narrow window's tiles cost about the same alone, so that blocks striding over equal
// items stay balanced (an odd m_blocks leaves middle tiles, the last items). Varlen calls
// without a fetched schedule (the cp.async producer's) launch one block per row tile, grid
// (m_blocks, heads, batch x splits) as flash_fwd_kernel's, heavy first.
template <typename Tr>
__device__ __forceinline__ Sm90Next grid_item(const FlashFwdParams& p, unsigned k,
                                              unsigned& m_block, unsigned& head, unsigned& z) {
  // pairs: items [0, n_pairs x entries) hold tiles m_blocks - 1 - j and j (j fastest); an
  // odd m_blocks leaves each entry's middle tile, which come last (half-cost items for the
  // tail) -- items of both costs in between would meet the same blocks every round.
  // Visit k: item blockIdx.x + (k >> pairs) x gridDim.x, its tile k & pairs (unsigned: the
  // divisions by run-time values are shorter). (The constants are derived per visit, from
  // the params: the consumers keep no registers for them across a tile.)
  const unsigned num_m = p.m_blocks;
  if (varlen_call<Tr>(p)) {
    m_block = num_m - 1 - blockIdx.x;
    head = blockIdx.y;
    z = blockIdx.z;
    return k == 0 ? kItem : kEnd;
  }
  const bool pairs = Tr::PAIR_TILES;
  const unsigned entries = p.num_heads * p.batch * (Tr::SPLIT ? p.num_splits : 1);
  const unsigned n_pairs = pairs ? num_m / 2 : 0;
  const unsigned num_items = pairs ? (num_m - n_pairs) * entries : num_m * entries;
  unsigned entry;
  const unsigned w = blockIdx.x + (k >> unsigned(pairs)) * gridDim.x;
  if (w >= num_items) return kEnd;
  if (!pairs) {
    entry = w / num_m;
    m_block = num_m - 1 - w % num_m;
  } else if (w < n_pairs * entries) {
    const unsigned j = w % max(n_pairs, 1u);
    entry = w / max(n_pairs, 1u);
    m_block = (k & 1) ? j : num_m - 1 - j;
  } else {
    if (k & 1) return kSkip;   // a middle tile alone
    entry = w - n_pairs * entries;
    m_block = n_pairs;
  }
  head = entry % unsigned(p.num_heads);
  z = entry / unsigned(p.num_heads);
  return kItem;
}

// A fetched schedule (varlen calls of the TMA producer: the host knows no sequence's length,
// so no static stride is balanced): a persistent grid whose blocks take items from
// sched.tile_counter as they go, in the order of the 3-d grid (row tiles heavy first, heads,
// batch x split entries), counting only row tiles inside their sequence. Thread 0 of the
// producer warpgroup fetches and hands the item to the warpgroup (the producer barrier) and
// to the consumers (the tile's Q full barrier: fetched_item) through item slot k % 2:
// {m_block, head, z, the items of the entries before z} (m_block -1 ends the walk); the
// next fetch walks on from the last slot's entry (a cursor in shared memory, not in the
// producer's few registers).
template <typename Tr>
__device__ __forceinline__ Sm90Next fetch_item(const FlashFwdParams& p,
                                               const FlashSm90Schedule& sched, Sm90Smem<Tr> sm,
                                               int ptid, unsigned k, unsigned& m_block,
                                               unsigned& head, unsigned& z) {
  const u32 slot = sm.item_slot(k & 1);
  if (ptid == 0) {
    const unsigned w = atomicAdd(sched.tile_counter, 1u);
    int item[4] = {-1, 0, 0, 0};   // m_block, head, z, items before z
    if (k > 0) {
      asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n"
                   : "=r"(item[2]), "=r"(item[3]) : "r"(sm.item_slot((k - 1) & 1) + 8));
    }
    const unsigned entries = p.batch * (Tr::SPLIT ? p.num_splits : 1);
    const int* cu = static_cast<const int*>(p.cu_seqlens_q);
#pragma unroll 1
    for (; unsigned(item[2]) < entries; ++item[2]) {
      const unsigned b = Tr::SPLIT ? unsigned(item[2]) / unsigned(p.num_splits) : item[2];
      const unsigned tiles = unsigned(cu[b + 1] - cu[b] + Tr::BLOCK_M - 1) / Tr::BLOCK_M;
      const unsigned n = tiles * unsigned(p.num_heads);
      if (w < unsigned(item[3]) + n) {
        const unsigned local = w - unsigned(item[3]);
        item[0] = int(tiles - 1 - local % tiles);
        item[1] = int(local / tiles);
        break;
      }
      item[3] += int(n);
    }
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(slot), "r"(item[0]), "r"(item[1]), "r"(item[2]), "r"(item[3])
                 : "memory");
  }
  named_barrier_sync(Tr::PRODUCER_BARRIER, Tr::PRODUCER_THREADS);
  int m, h, zz;
  asm volatile("ld.shared.v2.s32 {%0, %1}, [%3];\n"
               "ld.shared.s32 %2, [%3+8];\n"
               : "=r"(m), "=r"(h), "=r"(zz) : "r"(slot) : "memory");
  if (m >= 0) {
    m_block = unsigned(m);
    head = unsigned(h);
    z = unsigned(zz);
    return kItem;
  }
  // the end, for the consumers too: the last tile's Q freed, an arrival without bytes
  if (ptid == 0) {
    mbar_wait(sm.q_empty(), (k & 1) ^ 1);
    mbar_arrive(sm.q_full());
  }
  return kEnd;
}

template <typename Tr>
__device__ __forceinline__ Sm90Next fetched_item(Sm90Smem<Tr> sm, unsigned k, unsigned& m_block,
                                                 unsigned& head, unsigned& z) {
  mbar_wait(sm.q_full(), k & 1);
  int m, h, zz, pad;
  asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(m), "=r"(h), "=r"(zz), "=r"(pad) : "r"(sm.item_slot(k & 1)) : "memory");
  m_block = unsigned(m);
  head = unsigned(h);
  z = unsigned(zz);
  return m >= 0 ? kItem : kEnd;
}

// The K / V ring across a block's tiles: its step `step` (counted over every tile so far)
// uses stage step % STAGES in phase (step / STAGES) & 1.
template <typename Tr>
struct RingSlot {
  int stage, phase;
  __device__ __forceinline__ explicit RingSlot(int step)
      : stage(step % Tr::STAGES), phase((step / Tr::STAGES) & 1) {}
};

// E4M3: P of k32 step kk of m16 tile mt packed to e4m3, the A operand of O += P V (the 16-bit
// forms take WarpSoftmax::pack_p's k16 steps): from n8 tiles 4 kk .. 4 kk + 3, register 0 the
// row-g values of tiles 4 kk and 4 kk + 1, register 1 their row-g + 8 values, registers 2 and
// 3 likewise of tiles 4 kk + 2 and 4 kk + 3: the A fragment's logical keys 4 t4 .. of each 16
// are then the accumulator's keys 2 t4, 2 t4 + 1, 8 + 2 t4, 9 + 2 t4, the order in which
// transpose_v writes V^T's keys.
template <typename Tr>
__device__ __forceinline__ void pack_p_e4m3(u32 (&pf)[4],
                                            const float (&s)[Tr::M_TILES][Tr::S_N_TILES][4],
                                            int mt, int kk) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int nt = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);
    pf[r] = pack_e4m3x4(s[mt][nt][e], s[mt][nt][e + 1], s[mt][nt + 1][e], s[mt][nt + 1][e + 1]);
  }
}

// E4M3: ring step `step`'s V tile ([key][dim], landed in its V ring stage) transposed by the
// producer warpgroup into the stage of the V^T ring ([dim][key], 128-byte-swizzled rows of
// 128 keys), the K-major B operand of O += P V; keys at or past `keys` (the tile's keys
// inside the sequence) zero, so that P = 0 never meets a non-finite value past a varlen
// sequence. The keys of each 16 go in the order pack_p_e4m3 packs P: logical key
// 4 c + {0, 1, 2, 3} is key 2 c + {0, 1, 8, 9} (keys are the contraction index: the same
// permutation of P's columns and V^T's leaves O unchanged). Per warp, a block of 16 keys x
// 32 dims at a time: ldmatrix.trans of its four 8-key x 16-byte matrices gives lane l keys
// 2 (l % 4), +1 (and +8, +9) of dims 2 (l / 4), +1; two byte permutes make each dim's four
// keys, and stmatrix writes them, the rows of its matrices chosen so that no two of one
// matrix share a bank group (even-row matrix: dims 0, 2, 4, 6, 9, 11, 13, 15). Then the V^T
// full arrival (its stage's wait for the consumers to free it first).
template <typename Tr>
__device__ __forceinline__ void transpose_v(Sm90Smem<Tr> sm, int step, int keys, int ptid) {
  constexpr int BN = Tr::BLOCK_N, KEY_GROUPS = BN / 16, OPS = KEY_GROUPS * (Tr::HEAD_DIM / 32);
  const RingSlot<Tr> slot(step);
  const int s = slot.stage;
  mbar_wait(sm.v_raw_full(s), slot.phase);
  mbar_wait(sm.v_empty(s), slot.phase ^ 1);
  const int lane = ptid % 32, j = lane / 8, i = lane % 8;
  // lane l's row of loaded matrix j: key 8 (j % 2) + i, chunk j / 2 of the 16 keys x 32 dims;
  // its row of stored matrix j: dim 16 (j / 2) + 2 i (+1: the odd matrices' rows 0-3 and the
  // even ones' rows 4-7)
  const int ld_key = 8 * (j % 2) + i, ld_chunk = j / 2;
  const int st_dim = 16 * (j / 2) + 2 * i + ((i < 4) != (j % 2 == 0) ? 1 : 0);
  const u32 sel_even = lane < 16 ? 0x6420u : 0x7531u, sel_odd = sel_even ^ 0x1111u;
#pragma unroll 1
  for (int op = ptid / 32; op < OPS; op += Tr::PRODUCER_THREADS / 32) {
    const int kg = op % KEY_GROUPS, d0 = 32 * (op / KEY_GROUPS);
    u32 r[4];
    ldmatrix_x4_trans(r, sm.v_tile(s) + sw128_offset<BN>(16 * kg + ld_key, d0 / 16 + ld_chunk));
    if (keys < BN) {   // this lane's keys 16 kg + 2 (l % 4) + {0, 1} (r[0], r[2]), + {8, 9}
      const int k = 16 * kg + 2 * (lane % 4);
      const u32 lo = (k < keys ? 0xffffu : 0u) | (k + 1 < keys ? 0xffff0000u : 0u);
      const u32 hi = (k + 8 < keys ? 0xffffu : 0u) | (k + 9 < keys ? 0xffff0000u : 0u);
      r[0] &= lo;
      r[2] &= lo;
      r[1] &= hi;
      r[3] &= hi;
    }
    const u32 out[4] = {__byte_perm(r[0], r[1], sel_even), __byte_perm(r[0], r[1], sel_odd),
                        __byte_perm(r[2], r[3], sel_even), __byte_perm(r[2], r[3], sel_odd)};
    stmatrix_x4(sm.vt_tile(s) + sw128_offset<Tr::HEAD_DIM>(d0 + st_dim, kg), out);
  }
  fence_proxy_async();   // V^T's generic-proxy writes (and V's reads) before wgmma (and TMA)
  named_barrier_sync(Tr::PRODUCER_BARRIER, Tr::PRODUCER_THREADS);
  if (ptid == 0) mbar_arrive(sm.v_full(s));
}

// The TMA producer (the producer warpgroup, thread ptid; thread 0 issues the Q and K copies,
// thread V_ISSUER the V copies), per tile of the schedule: K_0, then Q once the consumers
// freed the last tile's (K_0's stage frees before Q does), then V_0, K_1, V_1, ..., each K /
// V tile into its ring stage once the consumers freed it. Each box is one 64-column block of
// a tile (the layout of copy_tile; paged: of one cache block's keys), each barrier expects
// its tile's bytes (out-of-bounds zeros count too). Dense: the maps' bounds zero-fill rows
// past the sequence. Varlen (the maps span every packed sequence, batch 1): rows past a
// sequence are the next one's, harmless in Q (rows never stored) and K (keys masked by
// select) but not in V, where P = 0 times a non-finite value would still poison the row; so
// a varlen (or paged) V tile crossing the sequence's end is copied by the whole warpgroup
// with cp.async, zero-filled, and the V issuer arrives once every thread's copies landed.
template <typename Tr, bool VARLEN>
__device__ __forceinline__ void tma_produce(const FlashFwdParams& p, const FlashTmaMaps& maps,
                                            const FlashSm90Schedule& sched, Sm90Smem<Tr> sm,
                                            int ptid) {
  using T = typename Tr::T;
  constexpr int BN = Tr::BLOCK_N, COL_BLOCKS = Tr::HEAD_DIM / Tr::COLS;
  // (varlen forms without a fetched schedule: the block's own tile, grid_item's first)
  constexpr bool FETCH = VARLEN && Tr::FETCH_VARLEN, ONE = VARLEN && !Tr::FETCH_VARLEN;
  auto next = [&](unsigned k, unsigned& m_block, unsigned& head, unsigned& z) {
    return FETCH ? fetch_item<Tr>(p, sched, sm, ptid, k, m_block, head, z)
                 : grid_item<Tr>(p, k, m_block, head, z);
  };
  for_each_tile<Tr, ONE>(p, next, [&](const Sm90Block& blk, const typename Tr::Mask&) {
    const int batch = VARLEN ? 0 : blk.b;   // map coordinates: (column, row, head, batch)
    auto load_q = [&]() {
      mbar_wait(sm.q_empty(), blk.q_phase ^ 1);
      mbar_arrive_expect_tx(sm.q_full(), Tr::Q_BYTES);
#pragma unroll
      for (int wg = 0; wg < Tr::NUM_WG; ++wg) {
#pragma unroll
        for (int cb = 0; cb < COL_BLOCKS; ++cb) {
          tma_load_4d(sm.q + wg * Tr::WG_Q_BYTES + cb * (64 * 128), maps.q, sm.q_full(),
                      cb * Tr::COLS, blk.qr.start + blk.m0 + wg * 64, blk.head, batch);
        }
      }
    };
    // Keys key0 .. of K or V into `tile` (by its issuer), once the consumers freed it.
    // Paged: box_rows keys at each block-table entry the tile's keys inside the sequence
    // reach, box i from lane i of the issuing warp (one table load per lane, all in flight
    // at once); the tile's rows past them keep what they held (K: masked by select; V: the
    // edge copy). NHD (maps of (head dim, slot, KV head, cache block)): a box per 64-column
    // block; VLLM (5-d maps of (a row's keys, its column chunk or dim, key group, KV head,
    // cache block), cuattn/_tma.py): one box of every column, V's of v_box_rows keys.
    // load_rows: a dense tile's boxes (the maps' bounds zero-fill rows past the tensor).
    auto load_rows = [&](u32 tile, const TmaDescriptor& map, u32 full, int key0) {
      mbar_arrive_expect_tx(full, Tr::KV_TILE_BYTES);
#pragma unroll
      for (int cb = 0; cb < COL_BLOCKS; ++cb) {
        tma_load_4d(tile + cb * (BN * 128), map, full, cb * Tr::COLS, blk.kr.start + key0,
                    blk.kvh, batch);
      }
    };
    auto load_tile = [&](u32 tile, const TmaDescriptor& map, u32 full, int key0, bool v) {
      if constexpr (Tr::PAGED) {
        const int lane = ptid % 32;
        // (VLLM: the block shift re-read here, not held across the walk: 40 registers)
        const int shift = Tr::VLLM ? value_now(p.block_shift) : p.block_shift;
        const int box = v ? Tr::v_box_rows(shift) : Tr::box_rows(shift);
        const int boxes = (min(BN, blk.kr.len - key0) + box - 1) / box;   // <= BN / 8 <= 32
        if (lane == 0) mbar_arrive_expect_tx(full, boxes * box * (Tr::HEAD_DIM * Tr::ELEM));
        __syncwarp();
        if (lane < boxes) {
          const int key = key0 + lane * box;
          const int page = int(paged_block(p, paged_table(p, blk.b), key));
          const int slot = paged_slot(p, key);
          if constexpr (Tr::VLLM) {
            tma_load_5d(tile + lane * (box * Tr::HEAD_DIM * 2), map, full, 0, 0,
                        slot / (v ? box : 8), blk.kvh, page);   // (K's groups: 8 keys)
          } else {
#pragma unroll
            for (int cb = 0; cb < COL_BLOCKS; ++cb) {
              tma_load_4d(tile + cb * (BN * 128) + lane * (box * 128), map, full,
                          cb * Tr::COLS, slot, blk.kvh, page);
            }
          }
        }
      } else {
        load_rows(tile, map, full, key0);
      }
    };
    auto tma_tile = [&](u32 tile, const TmaDescriptor& map, u32 full, u32 empty, int phase,
                        int key0, bool v) {
      mbar_wait(empty, phase ^ 1);
      load_tile(tile, map, full, key0, v);
    };
    const KeyTiles& tiles = blk.tiles;
    if (tiles.n_steps == 0 && ptid == 0) load_q();
    // The issuers: thread 0 issues Q and K, and V too for a dense call. A paged call issues
    // each K tile from warp 0 and each V tile from warp 1, a box per lane (its boxes, one
    // per cache block and 64 columns, are many: one thread issuing both rings' boxes was the
    // wall for small cache blocks, bench/NOTES.md "paged_prefill on the Hopper kernel");
    // V_ISSUER, warp 1's lane 0, follows the V ring on edge tiles.
    constexpr int V_ISSUER = Tr::PAGED ? 32 : 0;
    const bool k_warp = Tr::PAGED ? ptid < 32 : ptid == 0;
    const bool v_warp = Tr::PAGED ? ptid / 32 == 1 : ptid == 0;
#pragma unroll 1
    for (int n = 0; n < tiles.n_steps; ++n) {
      const RingSlot<Tr> slot(blk.first_step + n);
      const int s = slot.stage;
      const int key0 = tiles.tile_of(n) * BN;
      if (k_warp) {
        tma_tile(sm.k_tile(s), maps.k, sm.k_full(s), sm.k_empty(s), slot.phase, key0, false);
        if (n == 0 && ptid == 0) load_q();
      }
      // Varlen: a V tile crossing its sequence's end is copied by the whole warpgroup
      // (cp.async, zero-filled past the end). The V issuer alone follows the V ring's phases,
      // every step in order; the others meet it at the producer barrier once the stage is
      // free. An mbarrier parity names a phase mod 2, so a thread that waits on the ring
      // itself can fall two phases behind the issuer (which runs ahead on TMA steps): it
      // then takes an old phase for its own and overwrites V in use (waiting only at edge
      // tiles: session 6), or waits for a phase only this warpgroup's next copy completes,
      // a deadlock (waiting every step: seen under racecheck, bench/NOTES.md "Session 7").
      // (Paged: warp 1's other lanes wait too, at TMA steps only, with V_ISSUER: tma_tile's
      // __syncwarp keeps them at its step, so they never fall behind.)
      if constexpr (Tr::E4M3) {
        // V into the V ring (its stage freed by this warpgroup's transpose of step n -
        // STAGES, which ended at the producer barrier), then the transpose of step n - 1
        // while it lands
        if (v_warp) load_tile(sm.v_tile(s), maps.v, sm.v_raw_full(s), key0, true);
        if (n > 0) {
          transpose_v<Tr>(sm, blk.first_step + n - 1, blk.kr.len - tiles.tile_of(n - 1) * BN,
                          ptid);
        }
      } else if (VARLEN && key0 + BN > blk.kr.len) {
        if (ptid == V_ISSUER) mbar_wait(sm.v_empty(s), slot.phase ^ 1);
        named_barrier_sync(Tr::PRODUCER_BARRIER, Tr::PRODUCER_THREADS);   // the stage is free
        if constexpr (Tr::PAGED) {
          copy_paged_tile<Tr>(sm.v_tile(s), p, blk, key0, ptid);
        } else {
          const T* v_ptr = static_cast<const T*>(p.v) +
                           (long long)blk.kr.start * p.v_stride_row + blk.kvh * p.v_stride_head;
          copy_tile<Tr, BN, BN>(sm.v_tile(s), v_ptr, p.v_stride_row, key0, blk.kr.len,
                                p.head_dim / 8, ptid);
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();   // generic-proxy writes, read next by wgmma (the async proxy)
        named_barrier_sync(Tr::PRODUCER_BARRIER, Tr::PRODUCER_THREADS);
        if (ptid == V_ISSUER) mbar_arrive(sm.v_full(s));
      } else if (v_warp) {
        tma_tile(sm.v_tile(s), maps.v, sm.v_full(s), sm.v_empty(s), slot.phase, key0, true);
      }
    }
    if constexpr (Tr::E4M3) {
      if (tiles.n_steps > 0) {
        const int last = tiles.n_steps - 1;
        transpose_v<Tr>(sm, blk.first_step + last, blk.kr.len - tiles.tile_of(last) * BN, ptid);
      }
    }
  });
}

// The cp.async producer (the whole producer warpgroup, thread ptid): the same loads in the
// same order by copy_tile, rows past the sequence and columns past head_dim zero-filled; each
// thread arrives on a full barrier once its copies of that tile landed.
template <typename Tr>
__device__ __forceinline__ void cp_async_produce(const FlashFwdParams& p, Sm90Smem<Tr> sm,
                                                 int ptid) {
  using T = typename Tr::T;
  constexpr int BN = Tr::BLOCK_N;
  const int head_dim_chunks = p.head_dim / 8;
  auto next = [&](unsigned k, unsigned& m_block, unsigned& head, unsigned& z) {
    return grid_item<Tr>(p, k, m_block, head, z);
  };
  for_each_tile<Tr>(p, next, [&](const Sm90Block& blk, const typename Tr::Mask&) {
    const SeqRange qr = blk.qr, kr = blk.kr;
    const int b = blk.b, kvh = blk.kvh;
    const T* q_ptr = static_cast<const T*>(p.q) + b * p.q_stride_batch +
                     (long long)qr.start * p.q_stride_row + blk.head * p.q_stride_head;
    const T* k_ptr = static_cast<const T*>(p.k) + b * p.k_stride_batch +
                     (long long)kr.start * p.k_stride_row + kvh * p.k_stride_head;
    const T* v_ptr = static_cast<const T*>(p.v) + b * p.v_stride_batch +
                     (long long)kr.start * p.v_stride_row + kvh * p.v_stride_head;
    auto load_q = [&]() {
      mbar_wait(sm.q_empty(), blk.q_phase ^ 1);
      copy_tile<Tr, Tr::BLOCK_M, 64>(sm.q, q_ptr, p.q_stride_row, blk.m0, qr.len,
                                     head_dim_chunks, ptid);
      cp_async_mbar_arrive(sm.q_full());
    };
    const KeyTiles& tiles = blk.tiles;
    if (tiles.n_steps == 0) load_q();
#pragma unroll 1
    for (int n = 0; n < tiles.n_steps; ++n) {
      const RingSlot<Tr> slot(blk.first_step + n);
      const int s = slot.stage;
      const int key0 = tiles.tile_of(n) * BN;
      mbar_wait(sm.k_empty(s), slot.phase ^ 1);
      copy_tile<Tr, BN, BN>(sm.k_tile(s), k_ptr, p.k_stride_row, key0, kr.len, head_dim_chunks,
                            ptid);
      cp_async_mbar_arrive(sm.k_full(s));
      if (n == 0) load_q();
      mbar_wait(sm.v_empty(s), slot.phase ^ 1);
      copy_tile<Tr, BN, BN>(sm.v_tile(s), v_ptr, p.v_stride_row, key0, kr.len, head_dim_chunks,
                            ptid);
      cp_async_mbar_arrive(sm.v_full(s));
    }
  });
  cp_async_commit();
  cp_async_wait<0>();   // nothing may still be writing shared memory when the block exits
}

// Grid: (min(items, SMs)) for dense calls and for varlen and paged ones of a fetched
// schedule (FETCH_VARLEN), else (ceil(max_seqlen_q / BLOCK_M), num_heads, batch x
// num_splits) (grid_item); outputs as flash_fwd_kernel; block: THREADS = 128 x (1 + NUM_WG).
template <typename Tr>
__device__ void flash_fwd_sm90_kernel(const FlashFwdParams& p, const FlashTmaMaps& maps,
                                      const FlashSm90Schedule& sched) {
  using T = typename Tr::T;
  constexpr int BN = Tr::BLOCK_N;

  extern __shared__ __align__(1024) unsigned char smem[];
  const Sm90Smem<Tr> sm{(smem_addr(smem) + 1023u) & ~1023u};

  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar_init(sm.q_full(), Tr::FULL_ARRIVALS);
    mbar_init(sm.q_empty(), Tr::CONSUMER_THREADS);
#pragma unroll
    for (int s = 0; s < Tr::STAGES; ++s) {
      mbar_init(sm.k_full(s), Tr::FULL_ARRIVALS);
      mbar_init(sm.v_full(s), Tr::FULL_ARRIVALS);
      mbar_init(sm.k_empty(s), Tr::CONSUMER_THREADS);
      mbar_init(sm.v_empty(s), Tr::CONSUMER_THREADS);
      if constexpr (Tr::E4M3) mbar_init(sm.v_raw_full(s), 1);
    }
    fence_mbar_init();
  }
  __syncthreads();

  // ---- the producer warpgroup ----------------------------------------------------------------
  if (tid < Tr::PRODUCER_THREADS) {
    setmaxnreg_dec<Tr::PRODUCER_REGS>();
    if constexpr (Tr::TMA) {
      if (tid == 0) {
        tma_prefetch(maps.q);
        tma_prefetch(maps.k);
        tma_prefetch(maps.v);
      }
      if (varlen_call<Tr>(p)) {   // (varlen: a fetched schedule, where FETCH_VARLEN)
        tma_produce<Tr, true>(p, maps, sched, sm, tid);
      } else if (Tr::E4M3 || tid == 0) {   // (E4M3: the whole warpgroup transposes V)
        tma_produce<Tr, false>(p, maps, sched, sm, tid);
      }
    } else {
      cp_async_produce<Tr>(p, sm, tid);
    }
    return;
  }

  // ---- the consumer warpgroups ---------------------------------------------------------------
  setmaxnreg_inc<Tr::CONSUMER_REGS>();
  // This thread's place: consumer warp `warp` (rows 16 warp .. of each row tile; broadcast
  // from lane 0, so that the compiler knows it warp-uniform and keeps it, and the Q
  // descriptors derived from it, in uniform registers), and in it rows g and g + 8 of the
  // warp's 16, columns 2 t4 and 2 t4 + 1 of each n8 tile (read afresh where used:
  // thread_index_now, since held across a tile these spilled first).
  const int warp = __shfl_sync(0xffffffffu, (tid - Tr::PRODUCER_THREADS) / 32, 0);
  struct Lane {
    int g, t4;
  };
  auto lane_place = []() {
    const int lane = thread_index_now() % 32;
    return Lane{lane / 4, lane % 4};
  };

  // Descriptors: this warpgroup's Q rows (k16 step ks: column block ks / 4, 32 bytes per
  // step inside it), a K tile likewise, a V tile by k16 step of keys (16 rows of 128 bytes)
  // with its 64-column blocks BN x 128 bytes apart; each a tile's descriptor advanced.
  // VLLM's tiles (K-major both): K (no swizzle) by k16 step two chunks (256 bytes) of every
  // 8-key group; V by k16 step 16 keys (HEAD_DIM x 32 bytes), N its dims: one box of
  // 32-byte-swizzled rows (SBO 256), or two 8-key groups of core matrices (LBO their
  // distance, SBO 128) for blocks of 8 (v_fmt: the descriptor's fields but the address).
  constexpr u32 GROUP_BYTES = Tr::HEAD_DIM * 16;   // VLLM: one 8-key group of a tile
  const u64 v_fmt = Tr::VLLM && Tr::v_box_rows(p.block_shift) == 16
                        ? sw32_desc(0) : plain_desc(0, GROUP_BYTES, 128);
  const u64 q_wg_desc = sw128_desc(sm.q + (warp / 4) * Tr::WG_Q_BYTES);
  auto q_desc = [&](int ks) {
    return desc_advance(q_wg_desc, (ks / 4) * (64 * 128) + (ks % 4) * 32);
  };
  auto k_desc = [&](int s, int ks) {
    if constexpr (Tr::VLLM) {
      return desc_advance(plain_desc(sm.k_tile(s), 128, GROUP_BYTES), ks * 256);
    } else {
      return desc_advance(sw128_desc(sm.k_tile(s)), (ks / 4) * (BN * 128) + (ks % 4) * 32);
    }
  };
  auto v_desc = [&](int s, int kk) {
    if constexpr (Tr::E4M3) {   // V^T: k32 step kk 32 bytes into its 128-key column block
      return desc_advance(sw128_desc(sm.vt_tile(s)),
                          (kk / 4) * (Tr::HEAD_DIM * 128) + (kk % 4) * 32);
    } else if constexpr (Tr::VLLM) {
      return desc_advance(v_fmt, sm.v_tile(s) + kk * 2 * GROUP_BYTES);
    } else {
      return desc_advance(sw128_desc(sm.v_tile(s), BN * 128), kk * (16 * 128));
    }
  };

  // A full barrier of the rings, waited for before wgmma reads its tile. The cp.async
  // producer's copies are generic-proxy writes and wgmma reads through the async proxy: the
  // PTX memory model orders the two only through a proxy fence, so each consumer thread fences
  // once the barrier has shown it the copies (TMA writes through the async proxy: no fence).
  auto wait_full = [](u32 bar, int phase) {
    mbar_wait(bar, phase);
    if constexpr (!Tr::TMA) fence_proxy_async();
  };

  // (the producer's choice: tma_produce's FETCH)
  auto next = [&](unsigned k, unsigned& m_block, unsigned& head, unsigned& z) {
    return Tr::FETCH_VARLEN && varlen_call<Tr>(p)
               ? fetched_item<Tr>(sm, k, m_block, head, z)
               : grid_item<Tr>(p, k, m_block, head, z);
  };
  // Tr::PINGPONG: warpgroup 0 takes the first turn (warpgroup 1 opens it), and consumes
  // warpgroup 1's opening of a turn after the last, so that no barrier is left half-arrived.
  if constexpr (Tr::PINGPONG) {
    if (warp / 4 == 1) named_barrier_arrive(Tr::PINGPONG_BARRIER_0, 256);
  }
  for_each_tile<Tr>(p, next, [&](const Sm90Block& blk, const typename Tr::Mask& mask) {
    const KeyTiles& tiles = blk.tiles;
    const int n_steps = tiles.n_steps;
    const int sk = blk.kr.len;
    float o_acc[1][Tr::O_N_TILES][4];
#pragma unroll
    for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[0][nt][e] = 0.f;
    }
    float s_acc[1][Tr::S_N_TILES][4];
    u32 p_pack[1][Tr::PV_K_STEPS][4];
    float alpha[1][2];
    // Softcap leaves scores as t = tanh(s x cap_in), in units of cap_out: the softmax scale,
    // the ALiBi slope and the sink logit take the factor instead of every score (one FMUL
    // fewer per score: bench/NOTES.md, "Softcap on the Hopper kernel"). E4M3: a score of the
    // e4m3 GEMM is the real one over q_descale x k_descale (qk): the unit (softcap: its
    // input scale) takes the factor.
    const float qk = Tr::E4M3 ? descale_of(p.q_descale, p.q_descale_stride_batch,
                                          p.q_descale_stride_head, blk.b, blk.kvh) *
                                   descale_of(p.k_descale, p.k_descale_stride_batch,
                                              p.k_descale_stride_head, blk.b, blk.kvh)
                             : 1.f;
    const float unit = Tr::SOFTCAP ? p.softcap_out : qk;
    WarpSoftmax<Tr> softmax(p.scale_log2 * unit);

    float slope = 0.f;
    if constexpr (Tr::ALIBI) {
      slope = static_cast<const float*>(p.alibi_slopes)[blk.b * p.alibi_stride_batch + blk.head] *
              p.softmax_scale_inv / unit;
    }
    const typename Tr::Logits hook(slope, Tr::E4M3 ? p.softcap_in * qk : p.softcap_in, 1.f);

    // S = Q K^T of step n into s_acc (issued, committed; the caller waits)
    auto issue_qk = [&](int n) {
      const RingSlot<Tr> slot(blk.first_step + n);
      wait_full(sm.k_full(slot.stage), slot.phase);
#pragma unroll
      for (int ks = 0; ks < Tr::QK_K_STEPS; ++ks) {
        Wgmma<T, BN>::ss(s_acc[0], q_desc(ks), k_desc(slot.stage, ks), ks > 0);
      }
      wgmma_commit();
    };
    // O += P V of step n (P in p_pack; issued, committed)
    auto issue_pv = [&](int n) {
      const RingSlot<Tr> slot(blk.first_step + n);
      wait_full(sm.v_full(slot.stage), slot.phase);
#pragma unroll
      for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
        Wgmma<T, Tr::HEAD_DIM>::template rs<Tr::VLLM || Tr::E4M3 ? 0 : 1>(o_acc[0], p_pack[0][kk],
                                                              v_desc(slot.stage, kk), 1);
      }
      wgmma_commit();
    };
    // S_n has landed: free its K stage, and the Q tiles after the tile's last S (unless they
    // stage O).
    auto release_k = [&](int n) {
      mbar_arrive(sm.k_empty(RingSlot<Tr>(blk.first_step + n).stage));
      if (!Tr::O_IN_Q && n == n_steps - 1) mbar_arrive(sm.q_empty());
    };
    auto release_v = [&](int n) {
      mbar_arrive(sm.v_empty(RingSlot<Tr>(blk.first_step + n).stage));
    };
    // Step n's scores (landed): the logits hook, -inf outside the band / sequence on boundary
    // tiles, then the online softmax (P in place, alpha for the accumulator).
    // (Tr::RAW_MAX: a tile without a mask takes each row's max from the raw scores)
    auto softmax_step = [&](int n) {
      const Lane at = lane_place();
      const int row0 = blk.m0 + warp * 16 + at.g;   // this thread's rows: row0, row0 + 8
      const bool masked = n < tiles.n_masked;
      const int key0 = tiles.tile_of(n) * BN;
      auto row_of = [&](int, int hr) { return row0 + hr * 8; };
      auto hook_of = [&](int, int) -> const typename Tr::Logits& { return hook; };
      if constexpr (Tr::RAW_MAX) {
        if (!masked) {
          float tile_max[1][2];
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            tile_max[0][hr] = hook.of_max(WarpSoftmax<Tr>::thread_max(s_acc, 0, hr));
          }
          hook_and_mask<Tr>(s_acc, false, key0, at.t4, mask, sk, row_of, hook_of);
          softmax.template update_scores<Tr::Mask::BAND, true>(s_acc, alpha, tile_max);
          return;
        }
      }
      hook_and_mask<Tr>(s_acc, masked, key0, at.t4, mask, sk, row_of, hook_of);
      // (MAY_BE_EMPTY: only a band can leave a visited row without keys; see flash/softmax.cuh)
      softmax.template update_scores<Tr::Mask::BAND>(s_acc, alpha);
    };
    auto pack_p = [&]() {
#pragma unroll
      for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
        if constexpr (Tr::E4M3) {
          pack_p_e4m3<Tr>(p_pack[0][kk], s_acc, 0, kk);
        } else {
          WarpSoftmax<Tr>::pack_p(p_pack[0][kk], s_acc, 0, kk);
        }
      }
    };

    // Tr::PINGPONG: this warpgroup's turn to issue wgmmas, and the other's after it (both
    // warpgroups walk the same row tiles' key tiles, so they take as many turns).
    auto turn_begin = [&]() {
      if constexpr (Tr::PINGPONG) named_barrier_sync(Tr::PINGPONG_BARRIER_0 + warp / 4, 256);
    };
    auto turn_end = [&]() {
      if constexpr (Tr::PINGPONG) {
        named_barrier_arrive(Tr::PINGPONG_BARRIER_0 + (warp / 4 ^ 1), 256);
      }
    };

    // ---- the key loop: S_n in flight with O += P_{n-1} V_{n-1}; softmax of S_n under the
    // latter; O rescaled once it has landed ------------------------------------------------
    wait_full(sm.q_full(), blk.q_phase);
    if (n_steps == 0) {
      if (!Tr::O_IN_Q) mbar_arrive(sm.q_empty());
    } else {
      wgmma_fence();
      turn_begin();
      issue_qk(0);
      turn_end();
      wgmma_wait<0>();
      fence_regs(s_acc[0]);
      release_k(0);
      softmax_step(0);
      pack_p();
#pragma unroll 1
      for (int n = 1; n < n_steps; ++n) {
        wgmma_fence();   // s_acc, p_pack and o_acc were written by ordinary instructions
        turn_begin();
        issue_qk(n);
        issue_pv(n - 1);
        turn_end();
        wgmma_wait<1>();   // S_n has landed
        fence_regs(s_acc[0]);
        release_k(n);
        softmax_step(n);
        wgmma_wait<0>();   // O += P_{n-1} V_{n-1} has landed
        fence_regs(o_acc[0]);
        fence_regs(s_acc[0]);   // P_n is packed only now: p_pack may still feed the last wgmma
        release_v(n - 1);
#pragma unroll
        for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
          o_acc[0][nt][0] *= alpha[0][0];
          o_acc[0][nt][1] *= alpha[0][0];
          o_acc[0][nt][2] *= alpha[0][1];
          o_acc[0][nt][3] *= alpha[0][1];
        }
        pack_p();
      }
      wgmma_fence();
      turn_begin();
      issue_pv(n_steps - 1);
      turn_end();
      wgmma_wait<0>();
      fence_regs(o_acc[0]);
      release_v(n_steps - 1);
    }

    // ---- whole rows, then the epilogue ---------------------------------------------------------
    // (the sink logit in raw-score units; E4M3: O = v_descale x P V, paged: the host's v_scale
    // too)
    float sink[1][2];
    sink[0][0] = sink[0][1] =
        WarpSoftmax<Tr>::WITH_SINKS
            ? static_cast<const float*>(p.sinks)[blk.head] * p.softmax_scale_inv / unit
            : 0.f;
    const auto rows = softmax.template finish<Tr::E4M3>(sink, [&] {
      return p.v_scale * descale_of(p.v_descale, p.v_descale_stride_batch,
                                    p.v_descale_stride_head, blk.b, blk.kvh);
    });
    const Lane at = lane_place();
    const QueryRows<false> qrows{blk.head, 1};
    if constexpr (Tr::SPLIT) {
      store_partials<Tr>(p, rows, o_acc, blk.b, qrows, blk.qr.len, blk.split, blk.qr, blk.m0,
                         warp, at.g, at.t4, p.head_dim / 8);
    } else {
      // each warp stages its own 16 rows: an O tile needs no barrier but the store's
      // __syncwarp; the Q tiles only once the whole warpgroup's wgmmas have read them
      if constexpr (Tr::O_IN_Q) {
        named_barrier_sync(Tr::CONSUMER_BARRIER_0 + warp / 4, 128);
      }
      store_output<Tr>(p, rows, o_acc, sm.o_stage(), blk.b, qrows, blk.qr.len, blk.qr, blk.m0,
                       warp, thread_index_now() % 32, at.g, at.t4, p.head_dim / 8);
    }
    if (Tr::O_IN_Q) {   // the Q tiles held O: free them for the next row tile
      fence_proxy_async();   // (generic-proxy accesses, then the producer's async-proxy writes)
      mbar_arrive(sm.q_empty());
    }
  });
  if constexpr (Tr::PINGPONG) {
    if (warp / 4 == 0) named_barrier_sync(Tr::PINGPONG_BARRIER_0, 256);
  }
}

}  // namespace cuattn
