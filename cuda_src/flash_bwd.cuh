// FlashAttention-2 backward: dQ, dK, dV of out = softmax(scale * hook(Q K^T) + mask) V from the
// forward's out and lse, recomputing P = exp(scale * S - lse) tile by tile instead of storing it
// (Dao 2023, "FlashAttention-2", Algorithm 2). Four kernels:
//   flash_bwd_prep_kernel    D = rowsum(dO * O), lse in log2 units, the dQ workspace zeroed;
//   flash_bwd_kernel         one block per KV tile: dK, dV in registers across the query tiles
//                            (and query heads of its KV head) that see it; dQ added in fp32;
//   flash_bwd_dq_kernel      the fp32 workspace (its slices summed in order) to dQ in T;
//   flash_bwd_dsinks_kernel  each sink's gradient, -sum_i P_sink(i) D_i, in a fixed order.
// The parts are the forward's: BandMask (common/mask.cuh, with rows(), the inverse of keys()),
// the logits hook (common/logits.cuh, with its derivative), the traits' FEATURES bits
// (flash/features.cuh), a sequence's rows (flash/seqlen.cuh), the swizzled tiles (common/mma.cuh).
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/row_chunks.cuh"
#include "params/flash_bwd.cuh"
#include "flash/features.cuh"
#include "flash/seqlen.cuh"

namespace cuattn {

// What one pass over the query tiles computes (FlashBwdTraits PASSES).
enum : int { kBwdDv = 1, kBwdDk = 2, kBwdDq = 4, kBwdAll = 7 };

// Every knob of the main backward kernel (cuattn.keys.FlashBwdVariant, chosen by
// cuattn/tuning_bwd.py) and every constant derived from them.
//   BLOCK_M    query rows per tile (a multiple of 32: the dS tile's rows are swizzled).
//   NUM_WARPS  each warp owns 16 keys of the KV tile: BLOCK_N = 16 NUM_WARPS; its dK and dV
//              rows stay in its registers. For dQ = dS K the warps tile the BLOCK_M x HEAD_DIM
//              product instead: BLOCK_M / 16 row tiles x DQ_GROUPS column groups.
//   Q_CHUNK    queries of a tile whose S^T and dP^T a warp holds at once (fp32, 16 keys each):
//              the tile is taken in BLOCK_M / Q_CHUNK column chunks, each through P, dS and its
//              share of dV, dK (their k16 steps), so that dK, dV and the two chunks fit 255
//              registers.
//   MASK, FEATURES  as the forward's (kSoftcap, kAlibi; sinks need nothing here).
// Above head dim 128, dK and dV together would not fit in registers: PASSES = 2 walks the
// query tiles twice, first for dV (S, P), then for dK and dQ (S, P, dP, dS).
template <typename T_, int HEAD_DIM_, int BLOCK_M_, int NUM_WARPS_, int Q_CHUNK_, int MASK_,
          int FEATURES_>
struct FlashBwdTraits : FlashFeatures<FEATURES_> {
  using T = T_;
  using Mask = BandMask<MASK_>;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int Q_CHUNK = Q_CHUNK_;
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int LOAD_THREADS = THREADS;         // every thread loads (load_tile)
  static constexpr int BLOCK_N = 16 * NUM_WARPS;
  static constexpr int D_CHUNKS = HEAD_DIM / 8;        // 16-byte chunks of a Q / K / V row
  static constexpr int M_CHUNKS = BLOCK_M / 8;         // of a dS^T row (8 queries)
  static constexpr int K_STEPS = HEAD_DIM / 16;        // k16 steps of S^T = K Q^T, dP^T = V dO^T
  static constexpr int C_N_TILES = Q_CHUNK / 8;        // n8 tiles of a chunk of S^T (queries)
  static constexpr int C_K_STEPS = Q_CHUNK / 16;       // its k16 steps of dV += P^T dO, dK += dS^T Q
  static constexpr int D_N_TILES = HEAD_DIM / 8;       // n8 tiles of dK, dV
  static constexpr int DQ_ROW_TILES = BLOCK_M / 16;
  static constexpr int DQ_GROUPS = NUM_WARPS / DQ_ROW_TILES;
  static constexpr int DQ_DIMS = HEAD_DIM / DQ_GROUPS;  // dims of dQ per warp
  static constexpr int DQ_N_TILES = DQ_DIMS / 8;
  static constexpr int PASSES = HEAD_DIM > 128 ? 2 : 1;
  static constexpr int STAGES = 2;                     // Q, dO, lse2, D of the next query tile
  // No causal schedule (bwd_block_index): at the 255-register edge, any block index that is
  // not a blockIdx (which ptxas re-reads for free) doubles the spills.
  static constexpr bool CAUSAL_SCHEDULE = false;
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int QO_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int STAGE_BYTES = 2 * QO_TILE_BYTES + 2 * BLOCK_M * 4;
  static constexpr int DS_BYTES = BLOCK_N * BLOCK_M * 2;
  static constexpr int SMEM_BYTES = 2 * KV_TILE_BYTES + STAGES * STAGE_BYTES + DS_BYTES;
  // The layout of a [row][HEAD_DIM] tile (load_tile): the byte offset of 16-byte chunk ch of
  // row r (common/mma.cuh's swizzle); row r + 8 k sits 8 k ROW_BYTES past row r.
  template <int ROWS>
  static __device__ __forceinline__ u32 tile_offset(int r, int ch) {
    return swizzled_offset<D_CHUNKS>(r, ch);
  }
  static constexpr int ROW_BYTES = D_CHUNKS * 16;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "compiled head dim: a multiple of 32");
  static_assert(BLOCK_M % 32 == 0, "BLOCK_M: a multiple of 32");
  static_assert(Q_CHUNK % 16 == 0 && BLOCK_M % Q_CHUNK == 0, "whole k16 steps per chunk");
  static_assert(NUM_WARPS % DQ_ROW_TILES == 0 && DQ_DIMS % 16 == 0,
                "dQ: whole row tiles per warp group, column groups of k16 steps");
  static_assert(FEATURES_ >= 0 && FEATURES_ < 8, "softcap, ALiBi, sinks");
};

// Copy rows [0, ROWS) of a [row][HEAD_DIM] tile of T (row r at src + r * row_stride) into a
// shared tile of Tr's layout (Tr::tile_offset) by cp.async; rows >= valid_rows and columns >=
// head_dim zero-filled. The Tr::LOAD_THREADS threads (tid 0 ..) share the chunks as
// common/row_chunks.cuh lays out. Where they cover whole rows and the tile takes whole passes,
// each copies one fixed column chunk of every ROWS_PER_PASS-th row: offsets from one source
// pointer and one shared-memory address (few registers live across the key loop); otherwise
// chunk by chunk.
template <typename Tr, int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const typename Tr::T* src, long long row_stride,
                                          int valid_rows, int head_dim_chunks, int tid) {
  constexpr int D_CHUNKS = Tr::D_CHUNKS, THREADS = Tr::LOAD_THREADS;
  using Chunks = RowChunks<THREADS, D_CHUNKS>;
  if constexpr (Chunks::EVEN && ROWS % Chunks::ROWS_PER_PASS == 0) {
    constexpr int ROWS_PER_PASS = Chunks::ROWS_PER_PASS;
    const auto first = Chunks::at(0, tid);
    const int r0 = first.row, ch = first.ch;
    const bool ch_ok = ch < head_dim_chunks;
    const typename Tr::T* s = src + r0 * row_stride + ch * 8;
    const u32 d = dst + Tr::template tile_offset<ROWS>(r0, ch);
    // (unrolled by 4: a few loaders (the Hopper kernel's 64) take 16-32 passes, whose offsets,
    // all held at once, spilled)
#pragma unroll 4
    for (int it = 0; it < ROWS / ROWS_PER_PASS; ++it) {
      const bool ok = ch_ok && r0 + it * ROWS_PER_PASS < valid_rows;
      // (ROWS_PER_PASS % 8 == 0: the swizzle of r0 + it * ROWS_PER_PASS is r0's)
      const u32 row_off = ROWS_PER_PASS % 8 == 0
                              ? it * ROWS_PER_PASS * Tr::ROW_BYTES
                              : Tr::template tile_offset<ROWS>(r0 + it * ROWS_PER_PASS, ch) -
                                    Tr::template tile_offset<ROWS>(r0, ch);
      cp_async_16(d + row_off, ok ? s + it * ROWS_PER_PASS * row_stride : src, ok ? 16 : 0);
    }
  } else {
    constexpr int CHUNKS = ROWS * D_CHUNKS;
#pragma unroll
    for (int it = 0; it < Chunks::template passes<ROWS>(); ++it) {
      const auto at = Chunks::at(it, tid);
      if (CHUNKS % THREADS == 0 || at.index < CHUNKS) {
        const int r = at.row, ch = at.ch;
        const bool ok = r < valid_rows && ch < head_dim_chunks;
        cp_async_16(dst + Tr::template tile_offset<ROWS>(r, ch),
                    ok ? src + r * row_stride + ch * 8 : src, ok ? 16 : 0);
      }
    }
  }
}

// Adds accumulator row hr (0: g, 1: g + 8) of n8 tiles NT, NT + 1, ... into the fp32 row at
// `row` (tile nt at row + 8 nt, columns 2 t4 and 2 t4 + 1 of it), tiles past `cols` left out,
// without returning anything. On sm_90 one red.global.add.v2.f32 per tile, its address `row`
// plus an immediate offset: the adds of a row share one address register (a register pair
// per add spilled the Hopper kernel at head dim 256).
template <int NT, int N_TILES>
__device__ __forceinline__ void add_row(float* row, const float (&acc)[N_TILES][4], int hr,
                                        int cols) {
  if constexpr (NT < N_TILES) {
    if (NT * 8 < cols) {
#if __CUDA_ARCH__ >= 900
      asm volatile("red.global.add.v2.f32 [%0+%3], {%1, %2};\n"
                   :: "l"(row), "f"(acc[NT][2 * hr]), "f"(acc[NT][2 * hr + 1]), "n"(NT * 32)
                   : "memory");
#else
      atomicAdd(row + NT * 8, acc[NT][2 * hr]);
      atomicAdd(row + NT * 8 + 1, acc[NT][2 * hr + 1]);
#endif
    }
    add_row<NT + 1>(row, acc, hr, cols);
  }
}

// S^T (and with DP, dP^T) of this warp's 16 keys against a chunk of a query tile, in one
// loop over HEAD_DIM (two independent MMA chains): s = K Q^T and dp = V dO^T, with A the
// warp's rows of the [key][dim] K and V tiles (ldmatrix, a_steps) and B the chunk's rows of the
// [query][dim] Q and dO tiles (ldmatrix, b_steps). Accumulator rows are keys g, g + 8; columns
// queries 8 nt + 2 t4, +1.
template <typename Tr, bool DP>
__device__ __forceinline__ void keys_by_queries(float (&s)[Tr::C_N_TILES][4],
                                                float (&dp)[Tr::C_N_TILES][4], u32 k_lane,
                                                u32 v_lane, u32 q_lane, u32 do_lane,
                                                const SwizzledSteps<Tr::D_CHUNKS, true>& a_steps,
                                                const SwizzledSteps<Tr::D_CHUNKS, true>& b_steps) {
  using T = typename Tr::T;
#pragma unroll
  for (int nt = 0; nt < Tr::C_N_TILES; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = 0.f;
      if (DP) dp[nt][e] = 0.f;
    }
  }
#pragma unroll
  for (int ks = 0; ks < Tr::K_STEPS; ++ks) {
    u32 ak[4], av[4];
    ldmatrix_x4(ak, k_lane + a_steps.at(ks));
    if (DP) ldmatrix_x4(av, v_lane + a_steps.at(ks));
#pragma unroll
    for (int np = 0; np < Tr::C_N_TILES / 2; ++np) {
      const u32 b_off = np * 16 * Tr::D_CHUNKS * 16 + b_steps.at(ks);
      u32 bq[4], bo[4];
      ldmatrix_x4(bq, q_lane + b_off);
      if (DP) ldmatrix_x4(bo, do_lane + b_off);
      mma_m16n8k16<T>(s[2 * np], ak, bq[0], bq[1]);
      mma_m16n8k16<T>(s[2 * np + 1], ak, bq[2], bq[3]);
      if (DP) {
        mma_m16n8k16<T>(dp[2 * np], av, bo[0], bo[1]);
        mma_m16n8k16<T>(dp[2 * np + 1], av, bo[2], bo[3]);
      }
    }
  }
}

// dV or dK of this warp's 16 keys: acc += A X, A (16 keys x a chunk's queries) packed in
// registers (a[kk]: the k16 step kk), X the chunk's rows of the [query][dim] tile (ldmatrix
// .trans, t_steps).
template <typename Tr>
__device__ __forceinline__ void keys_by_dims(float (&acc)[Tr::D_N_TILES][4],
                                             const u32 (&a)[Tr::C_K_STEPS][4], u32 x_lane,
                                             const SwizzledSteps<Tr::D_CHUNKS, true>& t_steps) {
  using T = typename Tr::T;
#pragma unroll
  for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
#pragma unroll
    for (int dp = 0; dp < Tr::D_N_TILES / 2; ++dp) {
      u32 bf[4];
      ldmatrix_x4_trans(bf, x_lane + kk * 16 * Tr::D_CHUNKS * 16 + t_steps.at(dp));
      mma_m16n8k16<T>(acc[2 * dp], a[kk], bf[0], bf[1]);
      mma_m16n8k16<T>(acc[2 * dp + 1], a[kk], bf[2], bf[3]);
    }
  }
}

// This warp's 16 key rows of dK or dV (times `scale`) into T rows of dst (key j at
// dst + j * row_stride), keys < sk and dims < head_dim only.
template <typename Tr>
__device__ __forceinline__ void store_key_rows(const float (&acc)[Tr::D_N_TILES][4],
                                               typename Tr::T* dst, long long row_stride,
                                               int key0, int sk, int head_dim, float scale,
                                               int g, int t4) {
  using T = typename Tr::T;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int j = key0 + g + 8 * hr;
    if (j >= sk) continue;
    T* row = dst + j * row_stride + 2 * t4;
#pragma unroll
    for (int nt = 0; nt < Tr::D_N_TILES; ++nt) {
      if (nt * 8 < head_dim) {
        *reinterpret_cast<u32*>(row + nt * 8) =
            pack_pair<T>(acc[nt][2 * hr] * scale, acc[nt][2 * hr + 1] * scale);
      }
    }
  }
}

// The first key tile, KV head and batch entry of this block of either main kernel: it takes
// tiles tile0, tile0 + gridDim.x, ... (while they start before the sequence's end) of KV head
// kvh, batch entry b. Block (x, y, z) takes tiles x, x + gridDim.x, ... of KV head y, batch z;
// in kernels with Tr::CAUSAL_SCHEDULE, where p.lpt_group > 0 (causal calls, one tile per
// block), the blocks are read in launch order (x fastest) as sections of lpt_group (KV head,
// batch) pairs, key tile-major within a section:
// the heavy first tiles of a section's pairs start before its light last ones, and the blocks
// that run together stream the Q, dO and dQ rows of few heads through the L2
// (FlashAttention-3's causal backward scheduler, SingleTileBwdLPTScheduler).
struct BwdBlockIndex {
  int tile0, kvh, b;
};
template <typename Tr>
__device__ __forceinline__ BwdBlockIndex bwd_block_index(const FlashBwdParams& p) {
  if constexpr (!Tr::CAUSAL_SCHEDULE) {
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  } else {
    if (p.lpt_group == 0) {
      return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
    }
    // (unsigned: the compiler then knows every index non-negative, as blockIdx's are)
    const unsigned tiles = gridDim.x, pairs = gridDim.y * gridDim.z, group = p.lpt_group;
    const unsigned linear = blockIdx.x + tiles * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned first_pair = linear / (group * tiles) * group;
    const unsigned width = min(group, pairs - first_pair);   // (the last section's may be less)
    const unsigned in_section = linear - first_pair * tiles;
    const unsigned pair = first_pair + in_section % width;
    return {int(in_section / width), int(pair % gridDim.y), int(pair / gridDim.y)};
  }
}

// What every form of the main kernel's block knows (this one's and flash_bwd_sm90.cuh's): its
// (batch entry, KV head) and key tiles (BwdBlockIndex), its sequence's pointers, and the key
// tile it is on (start_tile):
// the query tiles that see it, walked over every query head of the KV head (step it: head
// head_of(it), first row m0_of(it)), and their loads (Tr::LOAD_THREADS threads, load_tile's
// layout: Tr::tile_offset).
template <typename Tr>
struct BwdWork {
  using T = typename Tr::T;
  static constexpr int BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N;

  const FlashBwdParams& p;
  int kvh, sq, sk, head_dim_chunks;   // (kvh: bwd_block_index's)
  typename Tr::Mask mask;
  long long row_base;             // workspace token of this sequence's query row 0
  float* dq_accum;                // this block's slice
  const T* q_seq;                 // query row 0 of the sequence (head 0)
  const T* do_seq;
  const T* k_seq;                 // key 0 of the sequence, this KV head
  const T* v_seq;
  const float* alibi_row;         // ALiBi: the batch entry's slopes (head 0)
  // The key tile: its first key, the query tiles [m_lo, m_lo + n_m) that see any of its
  // keys, [full_lo, full_hi) that see all (no mask), and the steps (query head of the group,
  // query tile).
  int n0, m_lo, n_m, full_lo, full_hi, n_iter;

  __device__ __forceinline__ explicit BwdWork(const FlashBwdParams& params)
      : p(params), mask(0, 0, 0, 0) {
    kvh = bwd_block_index<Tr>(p).kvh;   // (each use reads the index anew: blockIdx's, ptxas
    const int b = batch();              // re-reads them for free)
    const SeqRange qr = seq_range(p.cu_seqlens_q, b, p.seqlen_q);
    const SeqRange kr = seq_range(p.cu_seqlens_k, b, p.seqlen_k);
    sq = qr.len;
    sk = kr.len;
    head_dim_chunks = p.head_dim / 8;
    mask = typename Tr::Mask(sq, sk, p.window_left, p.window_right);
    row_base = (p.cu_seqlens_q == nullptr ? (long long)b * p.seqlen_q : 0) + qr.start;
    alibi_row = static_cast<const float*>(p.alibi_slopes) + (long long)b * p.alibi_stride_batch;
    const long long slice_floats = (long long)p.total_q * p.num_heads * p.head_dim;
    dq_accum = static_cast<float*>(p.dq_accum) + (p.deterministic ? first_tile() * slice_floats : 0);
    q_seq = static_cast<const T*>(p.q) + b * p.q_stride_batch + (long long)qr.start * p.q_stride_row;
    do_seq = static_cast<const T*>(p.dout) + b * p.do_stride_batch +
             (long long)qr.start * p.do_stride_row;
    k_seq = static_cast<const T*>(p.k) + b * p.k_stride_batch +
            (long long)kr.start * p.k_stride_row + kvh * p.k_stride_head;
    v_seq = static_cast<const T*>(p.v) + b * p.v_stride_batch +
            (long long)kr.start * p.v_stride_row + kvh * p.v_stride_head;
  }

  // This block's key tiles: for (int n = first_tile(); has_tile(n); n = next_tile(n)) (the
  // first one recomputed: held across the loop it took a register the producer lacks).
  __device__ __forceinline__ int first_tile() const { return bwd_block_index<Tr>(p).tile0; }
  __device__ __forceinline__ bool has_tile(int n) const { return n * Tr::BLOCK_N < sk; }
  __device__ __forceinline__ int next_tile(int n) const { return n + int(gridDim.x); }
  // The batch entry (recomputed, as first_tile: a register across the loops otherwise).
  __device__ __forceinline__ int batch() const { return bwd_block_index<Tr>(p).b; }

  __device__ __forceinline__ void start_tile(int n) {
    n0 = n * BLOCK_N;
    const auto rows = mask.rows(n0, min(n0 + BLOCK_N, sk) - 1, sq);
    m_lo = rows.begin / BLOCK_M;
    const int m_hi = rows.end > rows.begin ? (rows.end + BLOCK_M - 1) / BLOCK_M : m_lo;
    const bool whole_tile = n0 + BLOCK_N <= sk;   // else its keys past sk need the mask
    full_lo = whole_tile ? (rows.full_begin + BLOCK_M - 1) / BLOCK_M : 0;
    full_hi = whole_tile ? rows.full_end / BLOCK_M : 0;
    n_m = m_hi - m_lo;
    n_iter = p.head_group * n_m;
  }

  __device__ __forceinline__ int head_of(int it) const { return kvh * p.head_group + it / n_m; }
  __device__ __forceinline__ int m0_of(int it) const { return (m_lo + it % n_m) * BLOCK_M; }
  // Whether step it's query tile needs the mask (some of its (query, key) pairs are not seen).
  __device__ __forceinline__ bool masked(int it) const {
    const int m = m_lo + it % n_m;
    return !(m >= full_lo && m < full_hi);
  }

  // The key tile's K and V rows (rows past sk zero-filled).
  __device__ __forceinline__ void load_kv(u32 s_k, u32 s_v, int tid) const {
    load_tile<Tr, BLOCK_N>(s_k, k_seq + (long long)n0 * p.k_stride_row, p.k_stride_row, sk - n0,
                           head_dim_chunks, tid);
    load_tile<Tr, BLOCK_N>(s_v, v_seq + (long long)n0 * p.v_stride_row, p.v_stride_row, sk - n0,
                           head_dim_chunks, tid);
  }

  // Step it's Q and dO tiles, and its lse2 then D rows (2 BLOCK_M floats at s_rows; rows past
  // sq zero-filled).
  __device__ __forceinline__ void load_step(int it, u32 s_q, u32 s_do, u32 s_rows, int tid) const {
    const int h = head_of(it), m0 = m0_of(it);
    load_tile<Tr, BLOCK_M>(s_q, q_seq + (long long)m0 * p.q_stride_row + h * p.q_stride_head,
                           p.q_stride_row, sq - m0, head_dim_chunks, tid);
    load_tile<Tr, BLOCK_M>(s_do, do_seq + (long long)m0 * p.do_stride_row + h * p.do_stride_head,
                           p.do_stride_row, sq - m0, head_dim_chunks, tid);
    const long long row0 = h * (long long)p.total_q + row_base + m0;
    const float* lse2 = static_cast<const float*>(p.lse2);
    const float* dsum = static_cast<const float*>(p.dsum);
    for (int c = tid; c < 2 * BLOCK_M; c += Tr::LOAD_THREADS) {
      const int r = c % BLOCK_M;
      const bool ok = m0 + r < sq;
      cp_async_4(s_rows + c * 4, ok ? (c < BLOCK_M ? lse2 : dsum) + row0 + r : lse2, ok ? 4 : 0);
    }
  }

  // The start of a pass<WHAT> (kBwd* bits) over the key tile: its accumulators zeroed, then,
  // once every thread is done with the shared tiles of the last pass or tile, the K and V
  // tiles (a second pass keeps them) and step 0's stage (load_stage(0)) in one cp.async group.
  template <int WHAT, int N_TILES, typename LoadStage>
  __device__ __forceinline__ void begin_pass(float (&acc_v)[N_TILES][4],
                                             float (&acc_k)[N_TILES][4], u32 s_k, u32 s_v,
                                             int tid, LoadStage&& load_stage) const {
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (WHAT & kBwdDv) acc_v[nt][e] = 0.f;
        if (WHAT & kBwdDk) acc_k[nt][e] = 0.f;
      }
    }
    __syncthreads();
    if ((WHAT & kBwdDv) || Tr::PASSES == 1) load_kv(s_k, s_v, tid);
    if (n_iter > 0) load_stage(0);
    cp_async_commit();
  }

  // A warp's dQ accumulators, rows r0 + g and r0 + g + 8 of head h, columns c0 + 8 nt + 2 t4
  // (+ 1), added into the workspace; rows past sq and columns past head_dim left out.
  template <int N_TILES>
  __device__ __forceinline__ void add_dq_rows(const float (&acc)[N_TILES][4], int h, int r0,
                                              int c0, int g, int t4) const {
    float* rows = dq_accum + ((row_base + r0) * p.num_heads + h) * (long long)p.head_dim + c0 +
                  2 * t4;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = g + 8 * hr;
      if (r0 + r >= sq) continue;
      add_row<0>(rows + (long long)r * p.num_heads * p.head_dim, acc, hr, p.head_dim - c0);
    }
  }

  // The first dK / dV row of the sequence's keys (varlen: they start at cu_seqlens_k[b]).
  __device__ __forceinline__ T* grad_rows(void* grad, long long s_batch, long long s_row,
                                          long long s_head) const {
    const int b = batch();
    const long long k0 =
        p.cu_seqlens_k == nullptr ? 0 : static_cast<const int*>(p.cu_seqlens_k)[b];
    return static_cast<T*>(grad) + b * s_batch + kvh * s_head + k0 * s_row;
  }
};

// P = exp2(scale hook(S) - lse2) (0 where masked) in place of S and, with DS, dS = P (dP - D)
// hook' in place of dP, for accumulators of 16 keys (rows key0 + g, + 8) x N_TILES n8 tiles
// of queries (columns m0 + 8 nt + 2 t4, + 1), whose lse2 and D sit at lse2_d[c] and
// lse2_d[BLOCK_M + c] (c = the column - m0); query head h.
template <typename Tr, bool DS, int N_TILES>
__device__ __forceinline__ void p_and_ds(float (&s)[N_TILES][4], float (&dp)[N_TILES][4],
                                         const BwdWork<Tr>& w, const float* lse2_d, int h,
                                         int m0, int key0, int g, int t4, bool masked) {
  const FlashBwdParams& p = w.p;
  float slope = 0.f;
  if constexpr (Tr::ALIBI) {
    slope = w.alibi_row[h] * p.softmax_scale_inv;
  }
  const typename Tr::Logits hook(slope, p.softcap_in, p.softcap_out);
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt) {
    const int i_loc = nt * 8 + 2 * t4;
    const float2 l2 = *reinterpret_cast<const float2*>(lse2_d + i_loc);
    float2 dd = make_float2(0.f, 0.f);
    if constexpr (DS) dd = *reinterpret_cast<const float2*>(lse2_d + Tr::BLOCK_M + i_loc);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = m0 + i_loc + (e & 1);
      const int j = key0 + g + 8 * (e >> 1);
      float x = s[nt][e], dx = 1.f;
      if constexpr (Tr::Logits::ACTIVE) x = hook(x, i + w.mask.diag, j, dx);
      if (masked && !(i < w.sq && w.mask.visible(i, j, w.sk))) x = neg_inf();
      const float pe = exp2f(fmaf(x, p.scale_log2, -((e & 1) ? l2.y : l2.x)));
      s[nt][e] = pe;
      if constexpr (DS) dp[nt][e] = pe * (dp[nt][e] - ((e & 1) ? dd.y : dd.x)) * dx;
    }
  }
}

// dS = P (dP - D) in place of dP, from P (p_and_ds<Tr, false>'s s), where the logits hook's
// derivative is 1 (no softcap): the same accumulators and D rows as p_and_ds.
template <typename Tr, int N_TILES>
__device__ __forceinline__ void ds_from_p(const float (&s)[N_TILES][4], float (&dp)[N_TILES][4],
                                          const float* lse2_d, int t4) {
  static_assert(!Tr::SOFTCAP, "softcap's dS needs its derivative: p_and_ds<Tr, true>");
#pragma unroll
  for (int nt = 0; nt < N_TILES; ++nt) {
    const float2 dd = *reinterpret_cast<const float2*>(lse2_d + Tr::BLOCK_M + nt * 8 + 2 * t4);
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[nt][e] = s[nt][e] * (dp[nt][e] - ((e & 1) ? dd.y : dd.x));
  }
}

// A (16 keys x N_TILES n8 tiles) accumulators packed to T as the A operands of k16 steps
// (WarpSoftmax::pack_p's layout, flash/softmax.cuh, which wgmma's register A shares).
template <typename T, int N_TILES>
__device__ __forceinline__ void pack_rows(u32 (&a)[N_TILES / 2][4], const float (&x)[N_TILES][4]) {
#pragma unroll
  for (int kk = 0; kk < N_TILES / 2; ++kk) {
    a[kk][0] = pack_pair<T>(x[2 * kk][0], x[2 * kk][1]);
    a[kk][1] = pack_pair<T>(x[2 * kk][2], x[2 * kk][3]);
    a[kk][2] = pack_pair<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
    a[kk][3] = pack_pair<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
  }
}

// One block of the mma.sync kernel: BwdWork, its shared tiles and lane constants, and this
// warp's first key of the tile. pass<WHAT>() walks the query tiles that see the key tile,
// with Q, dO, lse2 and D in two stages.
template <typename Tr>
struct BwdBlock : BwdWork<Tr> {
  using T = typename Tr::T;
  using Work = BwdWork<Tr>;
  static constexpr int D_CHUNKS = Tr::D_CHUNKS, BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N;
  using Work::p;

  u32 s_k, s_v, s_stages, s_ds;   // shared: K tile, V tile, the stages, the dS^T tile
  const float* stage_f32;         // the stages, as floats (lse2 and D rows)
  int tid, warp, g, t4;
  // ldmatrix lane patterns (flash_fwd.cuh's): A rows (a_row, chunk 2 s + lane / 16), also
  // for .trans B; B rows (b_row, chunk 2 s + (lane / 8) % 2), also for .trans A of dS.
  int a_row, b_row;
  SwizzledSteps<D_CHUNKS, true> a_steps, b_steps;
  // (The compact step form: one register each, and a step index known only at run time, as
  // dQ's column group gives K's .trans steps, needs no per-lane table to index.)
  // dQ: this warp's row tile and column group, and the byte offset of its dS^T chunk in a row
  // (2 dq_rt + (lane / 8) % 2).
  int dq_rt, dq_grp;
  u32 ds_lane;
  int warp_key0;                  // this warp's first key of the key tile

  __device__ __forceinline__ BwdBlock(const FlashBwdParams& params, unsigned char* smem)
      : Work(params), a_steps(0, 0), b_steps(0, 0) {
    s_k = smem_addr(smem);
    s_v = s_k + Tr::KV_TILE_BYTES;
    s_stages = s_v + Tr::KV_TILE_BYTES;
    s_ds = s_stages + Tr::STAGES * Tr::STAGE_BYTES;
    stage_f32 = reinterpret_cast<const float*>(smem + 2 * Tr::KV_TILE_BYTES);
    tid = threadIdx.x;
    warp = tid / 32;
    const int lane = tid % 32;
    g = lane / 4;
    t4 = lane % 4;
    a_row = (lane % 8) + ((lane / 8) % 2) * 8;
    b_row = (lane % 8) + (lane / 16) * 8;
    a_steps = SwizzledSteps<D_CHUNKS, true>(a_row, lane / 16);
    b_steps = SwizzledSteps<D_CHUNKS, true>(b_row, (lane / 8) % 2);
    dq_rt = warp % Tr::DQ_ROW_TILES;
    dq_grp = warp / Tr::DQ_ROW_TILES;
    ds_lane = swizzled_offset<Tr::M_CHUNKS>(b_row, 2 * dq_rt + (lane / 8) % 2);
  }

  __device__ __forceinline__ void start_tile(int n) {
    Work::start_tile(n);
    warp_key0 = this->n0 + warp * 16;
  }
  __device__ __forceinline__ int key0() const { return warp_key0; }

  __device__ __forceinline__ u32 s_q(int st) const { return s_stages + st * Tr::STAGE_BYTES; }
  __device__ __forceinline__ u32 s_do(int st) const { return s_q(st) + Tr::QO_TILE_BYTES; }
  __device__ __forceinline__ u32 s_rows(int st) const { return s_do(st) + Tr::QO_TILE_BYTES; }
  __device__ __forceinline__ const float* rows_of(int st) const {   // lse2, then D
    return stage_f32 + (st * Tr::STAGE_BYTES + 2 * Tr::QO_TILE_BYTES) / 4;
  }
  __device__ __forceinline__ void load_stage(int it) const {
    const int st = it % Tr::STAGES;
    this->load_step(it, s_q(st), s_do(st), s_rows(st), tid);
  }

  // One walk over the key tile's query tiles: dV += P^T dO into acc_v (kBwdDv), dK += dS^T Q
  // into acc_k (kBwdDk), dQ += dS K into the workspace (kBwdDq).
  template <int WHAT>
  __device__ __forceinline__ void pass(float (&acc_v)[Tr::D_N_TILES][4],
                                       float (&acc_k)[Tr::D_N_TILES][4]) const {
    constexpr bool DV = WHAT & kBwdDv, DK = WHAT & kBwdDk, DQ = WHAT & kBwdDq, DS = DK || DQ;
    this->template begin_pass<WHAT>(acc_v, acc_k, s_k, s_v, tid,
                                    [&](int it) { load_stage(it); });
    const int n_iter = this->n_iter;

    for (int it = 0; it < n_iter; ++it) {
      const int h = this->head_of(it), m0 = this->m0_of(it), st = it % Tr::STAGES;
      const bool masked = this->masked(it);
      cp_async_wait<0>();
      __syncthreads();   // step it's stage has landed everywhere; the other one is free
      if (it + 1 < n_iter) load_stage(it + 1);
      cp_async_commit();

      const u32 q_tile = s_q(st), do_tile = s_do(st);
#pragma unroll
      for (int c = 0; c < BLOCK_M / Tr::Q_CHUNK; ++c) {   // column chunks of the query tile
        const u32 q_rows = q_tile + c * Tr::Q_CHUNK * D_CHUNKS * 16;
        const u32 do_rows = do_tile + c * Tr::Q_CHUNK * D_CHUNKS * 16;
        // S^T = K Q^T, and dP^T = V dO^T for dS
        float s[Tr::C_N_TILES][4], dp[Tr::C_N_TILES][4];
        keys_by_queries<Tr, DS>(s, dp, s_k + (warp * 16 + a_row) * D_CHUNKS * 16,
                                s_v + (warp * 16 + a_row) * D_CHUNKS * 16,
                                q_rows + b_row * D_CHUNKS * 16, do_rows + b_row * D_CHUNKS * 16,
                                a_steps, b_steps);
        // P = exp2(scale hook(S) - lse2), 0 where masked; dS = P (dP - D) hook'
        p_and_ds<Tr, DS>(s, dp, *this, rows_of(st) + c * Tr::Q_CHUNK, h, m0 + c * Tr::Q_CHUNK,
                         warp_key0, g, t4, masked);
        if constexpr (DV) {
          u32 pa[Tr::C_K_STEPS][4];
          pack_rows<T>(pa, s);
          keys_by_dims<Tr>(acc_v, pa, do_rows + a_row * D_CHUNKS * 16, a_steps);
        }
        if constexpr (DS) {
          u32 dsa[Tr::C_K_STEPS][4];
          pack_rows<T>(dsa, dp);
          if constexpr (DK) keys_by_dims<Tr>(acc_k, dsa, q_rows + a_row * D_CHUNKS * 16, a_steps);
          if constexpr (DQ) store_ds(dsa, c);
        }
      }
      if constexpr (DQ) {
        __syncthreads();   // the whole dS^T tile
        add_dq(h, m0);
      }
    }
    cp_async_wait<0>();
  }

  // This warp's dS^T rows of column chunk c into the [key][query] tile: a[kk][r] holds (key
  // g + 8 (r % 2), chunk queries 16 kk + 8 (r / 2) + 2 t4, +1).
  __device__ __forceinline__ void store_ds(const u32 (&a)[Tr::C_K_STEPS][4], int c) const {
#pragma unroll
    for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = warp * 16 + g + 8 * (r % 2);
        const u32 addr = s_ds + swizzled_offset<Tr::M_CHUNKS>(row, c * Tr::C_N_TILES + 2 * kk + r / 2) +
                         t4 * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(a[kk][r]));
      }
    }
  }

  // dQ of this warp's row tile and column group, dS K over the key tile (A = dS by .trans of
  // the [key][query] tile, B = K by .trans), added into the workspace rows of head h.
  __device__ __forceinline__ void add_dq(int h, int m0) const {
    float acc[Tr::DQ_N_TILES][4];
#pragma unroll
    for (int nt = 0; nt < Tr::DQ_N_TILES; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      u32 af[4];
      ldmatrix_x4_trans(af, s_ds + kk * 16 * Tr::M_CHUNKS * 16 + ds_lane);
#pragma unroll
      for (int dp = 0; dp < Tr::DQ_N_TILES / 2; ++dp) {
        u32 bf[4];
        ldmatrix_x4_trans(bf, s_k + (kk * 16 + a_row) * D_CHUNKS * 16 +
                                  a_steps.at(dq_grp * Tr::DQ_N_TILES / 2 + dp));
        mma_m16n8k16<T>(acc[2 * dp], af, bf[0], bf[1]);
        mma_m16n8k16<T>(acc[2 * dp + 1], af, bf[2], bf[3]);
      }
    }
    this->add_dq_rows(acc, h, m0 + dq_rt * 16, dq_grp * Tr::DQ_DIMS, g, t4);
  }
};

// The key tiles of a block of either main kernel (flash_bwd_kernel, flash_bwd_sm90_kernel):
// BwdBlockIndex's tiles of its KV head and batch entry; for each, pass<WHAT>() over the
// query tiles that see it (one pass, or dV then dK and dQ), then the rows of dV and of dK
// (times the softmax scale) of this thread's 16 keys (Block::key0()).
template <typename Tr, typename Block>
__device__ __forceinline__ void bwd_key_tiles(const FlashBwdParams& p, Block& blk) {
  using T = typename Tr::T;
  T* dk_seq = blk.grad_rows(p.dk, p.dk_stride_batch, p.dk_stride_row, p.dk_stride_head);
  T* dv_seq = blk.grad_rows(p.dv, p.dv_stride_batch, p.dv_stride_row, p.dv_stride_head);
  for (int n = blk.first_tile(); blk.has_tile(n); n = blk.next_tile(n)) {
    blk.start_tile(n);
    const int key0 = blk.key0();
    if constexpr (Tr::PASSES == 1) {
      float acc_v[Tr::D_N_TILES][4], acc_k[Tr::D_N_TILES][4];
      blk.template pass<kBwdAll>(acc_v, acc_k);
      store_key_rows<Tr>(acc_v, dv_seq, p.dv_stride_row, key0, blk.sk, p.head_dim, 1.f, blk.g,
                         blk.t4);
      store_key_rows<Tr>(acc_k, dk_seq, p.dk_stride_row, key0, blk.sk, p.head_dim,
                         p.softmax_scale, blk.g, blk.t4);
    } else {
      float acc[Tr::D_N_TILES][4];
      blk.template pass<kBwdDv>(acc, acc);
      store_key_rows<Tr>(acc, dv_seq, p.dv_stride_row, key0, blk.sk, p.head_dim, 1.f, blk.g,
                         blk.t4);
      blk.template pass<kBwdDk | kBwdDq>(acc, acc);
      store_key_rows<Tr>(acc, dk_seq, p.dk_stride_row, key0, blk.sk, p.head_dim,
                         p.softmax_scale, blk.g, blk.t4);
    }
  }
}

// Grid: (ceil(max_seqlen_k / BLOCK_N), num_heads_kv, batch), or deterministically (dq_slices,
// num_heads_kv, batch); block: (NUM_WARPS * 32), dynamic shared memory: Tr::SMEM_BYTES.
// Each block takes its key tiles (BwdBlockIndex) of one KV head and batch entry: for each, its
// K and V tile stay in shared memory while the query tiles of every query head of KV head y
// that see it stream through two stages (Q, dO, lse2, D). Per query tile, each warp: dP^T =
// V dO^T and S^T = K Q^T for its 16 keys, P = exp2(scale S - lse2) (hook and mask), dS = P
// (dP - D) hook'; dV += P^T dO and dK += dS^T Q in registers; dS^T to shared memory; then all
// warps dQ = dS K, added into dq_accum. The key rows of dK (times the softmax scale) and dV are
// written once per tile (zeros where no query sees a key).
template <typename Tr>
__device__ void flash_bwd_kernel(const FlashBwdParams& p) {
  extern __shared__ __align__(128) unsigned char smem[];
  BwdBlock<Tr> blk(p, smem);
  bwd_key_tiles<Tr>(p, blk);
}

// The row kernels' knobs: one warp per (token, head) row, THREADS per block.
template <typename T_, int HEAD_DIM_, int THREADS_>
struct FlashBwdRowsTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int THREADS = THREADS_;
  static constexpr int ROWS_PER_BLOCK = THREADS / 32;
  static_assert(THREADS % 32 == 0, "whole warps");
};

// The (token, head) row of this warp, and its batch entry b and row i there (fixed length:
// token = b * seqlen_q + i; varlen: b = 0, i = token, as the strides have no batch term).
struct BwdRow {
  long long tok;
  int h;
  long long b, i;
  // The element offset of this row in a (batch, row, head) strided array.
  __device__ __forceinline__ long long at(long long s_batch, long long s_row,
                                          long long s_head) const {
    return b * s_batch + i * s_row + h * s_head;
  }
  // Its row of dq_accum's slice 0; slice s is s * dq_slice(p) floats further.
  __device__ __forceinline__ float* accum(const FlashBwdParams& p) const {
    return static_cast<float*>(p.dq_accum) + (tok * p.num_heads + h) * p.head_dim;
  }
};
__device__ __forceinline__ long long dq_slice(const FlashBwdParams& p) {
  return (long long)p.total_q * p.num_heads * p.head_dim;
}
template <typename Tr>
__device__ __forceinline__ bool bwd_row(const FlashBwdParams& p, BwdRow& r) {
  const long long row = (long long)blockIdx.x * Tr::ROWS_PER_BLOCK + threadIdx.x / 32;
  if (row >= (long long)p.total_q * p.num_heads) return false;
  r.tok = row / p.num_heads;
  r.h = static_cast<int>(row % p.num_heads);
  r.b = r.tok / p.seqlen_q;
  r.i = r.tok - r.b * p.seqlen_q;
  return true;
}

// The tokens the sequences cover: all of them at fixed length, [cu[0], cu[batch]) varlen
// (the forward never writes the rows outside).
__device__ __forceinline__ SeqRange covered_tokens(const FlashBwdParams& p) {
  const int* cu = static_cast<const int*>(p.cu_seqlens_q);
  if (cu == nullptr) return {0, p.total_q};
  return {cu[0], cu[p.batch] - cu[0]};
}

// Grid: (ceil(total_q * num_heads / ROWS_PER_BLOCK)), block: (THREADS).
// Per (token, head) row: D = rowsum(dO * O) in fp32, lse2 = lse * log2(e) (+inf for -inf: a
// row that saw no key has P = 0 everywhere), and its dq_accum rows zeroed in every slice.
// Varlen rows outside every sequence (which the forward never wrote) are not read: D = 0,
// lse2 = +inf.
template <typename Tr>
__device__ void flash_bwd_prep_kernel(const FlashBwdParams& p) {
  using T = typename Tr::T;
  BwdRow r;
  if (!bwd_row<Tr>(p, r)) return;
  const int lane = threadIdx.x % 32;
  const SeqRange tokens = covered_tokens(p);
  const bool covered = r.tok >= tokens.start && r.tok < tokens.start + tokens.len;
  const T* o = static_cast<const T*>(p.out) + r.at(p.o_stride_batch, p.o_stride_row, p.o_stride_head);
  const T* d = static_cast<const T*>(p.dout) +
               r.at(p.do_stride_batch, p.do_stride_row, p.do_stride_head);
  float acc = 0.f;
#pragma unroll
  for (int c = lane * 8; c < Tr::HEAD_DIM; c += 256) {
    if (covered && c < p.head_dim) {
      float fo[8], fd[8];
      unpack16<T>(load16(o + c), fo);
      unpack16<T>(load16(d + c), fd);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(fo[e], fd[e], acc);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  const long long w = (long long)r.h * p.total_q + r.tok;
  if (lane == 0) {
    static_cast<float*>(p.dsum)[w] = acc;
    const float l = covered ? static_cast<const float*>(p.lse)[r.at(
                                  p.lse_stride_batch, p.lse_stride_row, p.lse_stride_head)]
                            : neg_inf();
    static_cast<float*>(p.lse2)[w] = l == neg_inf() ? -neg_inf() : l * kLog2e;
  }
  float* acc_row = r.accum(p);
  const long long slice = dq_slice(p);
  for (int s = 0; s < p.dq_slices; ++s) {
    for (int c = lane * 4; c < p.head_dim; c += 128) {
      *reinterpret_cast<float4*>(acc_row + s * slice + c) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// Grid: (ceil(total_q * num_heads / ROWS_PER_BLOCK)), block: (THREADS).
// Per (token, head) row: dQ = softmax_scale * the sum of its dq_accum slices (in order), in T.
template <typename Tr>
__device__ void flash_bwd_dq_kernel(const FlashBwdParams& p) {
  using T = typename Tr::T;
  BwdRow r;
  if (!bwd_row<Tr>(p, r)) return;
  const int lane = threadIdx.x % 32;
  const float* acc_row = r.accum(p);
  const long long slice = dq_slice(p);
  T* dq = static_cast<T*>(p.dq) + r.at(p.dq_stride_batch, p.dq_stride_row, p.dq_stride_head);
#pragma unroll
  for (int c = lane * 4; c < Tr::HEAD_DIM; c += 128) {
    if (c < p.head_dim) {
      float4 sum = *reinterpret_cast<const float4*>(acc_row + c);
      for (int s = 1; s < p.dq_slices; ++s) {
        const float4 x = *reinterpret_cast<const float4*>(acc_row + s * slice + c);
        sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
      }
      const float sc = p.softmax_scale;
      uint2 packed;
      packed.x = pack_pair<T>(sum.x * sc, sum.y * sc);
      packed.y = pack_pair<T>(sum.z * sc, sum.w * sc);
      *reinterpret_cast<uint2*>(dq + c) = packed;
    }
  }
}

// Grid: (num_heads), block: (THREADS).
// dsinks[h] = -sum_i exp(sink_h - lse_i) D_i over the rows of every sequence (a sink is a
// logit in the denominator whose value is 0, so its dP is 0 and dS = P_sink (0 - D)); the
// sum runs in a fixed order (strided per thread, then a fixed tree), so it is deterministic.
template <typename Tr>
__device__ void flash_bwd_dsinks_kernel(const FlashBwdParams& p) {
  __shared__ float warp_sums[Tr::THREADS / 32];
  const int h = blockIdx.x, tid = threadIdx.x;
  const SeqRange tokens = covered_tokens(p);
  const int lo = tokens.start, hi = tokens.start + tokens.len;
  const float sink2 = static_cast<const float*>(p.sinks)[h] * kLog2e;
  const float* lse2 = static_cast<const float*>(p.lse2) + (long long)h * p.total_q;
  const float* dsum = static_cast<const float*>(p.dsum) + (long long)h * p.total_q;
  float acc = 0.f;
  for (int t = lo + tid; t < hi; t += Tr::THREADS) acc -= exp2f(sink2 - lse2[t]) * dsum[t];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (tid % 32 == 0) warp_sums[tid / 32] = acc;
  __syncthreads();
  if (tid == 0) {
    float total = 0.f;
    for (int w = 0; w < Tr::THREADS / 32; ++w) total += warp_sums[w];
    static_cast<float*>(p.dsinks)[h] = total;
  }
}

}  // namespace cuattn
