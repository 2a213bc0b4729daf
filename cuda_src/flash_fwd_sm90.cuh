// FlashAttention forward on Hopper's warpgroup MMA (sm_90a): the algorithm of flash_fwd.cuh
// (Dao 2023; the wgmma formulation of Shah et al. 2024, "FlashAttention-3"), with S = Q K^T
// and O += P V on wgmma.mma_async: Q and K from 128-byte-swizzled shared memory by
// descriptor, P from registers as the A operand, V read transposed by the descriptor. Each
// warpgroup owns 64 query rows; its warps' accumulators have mma.sync's fragment layout, so
// the online softmax, the mask, the logits hooks, the key-tile order and both epilogues are
// flash_fwd.cuh's parts, unchanged.
// Stage 1 of the Hopper kernel (issue 12): every thread copies K/V tiles with cp.async into
// a STAGES-deep ring, one barrier per tile; no warp specialization yet.
#pragma once
#include "flash_fwd.cuh"
#include "common/wgmma.cuh"

namespace cuattn {

// Every knob of one sm_90a forward kernel (cuattn.variants.FlashFwdSm90Variant, chosen by
// cuattn/tuning.py) and the tile constants derived from them. MASK, SPLIT and FEATURES mean
// what they mean in FlashFwdTraits (kPackGqa excepted: dense K/V only).
template <typename T_, int HEAD_DIM_, int BLOCK_M_, int BLOCK_N_, int STAGES_, int MASK_,
          bool SPLIT_, int FEATURES_>
struct FlashFwdSm90Traits {
  using T = T_;
  using Mask = BandMask<MASK_>;
  static constexpr bool SOFTCAP = (FEATURES_ & kSoftcap) != 0;
  static constexpr bool ALIBI = (FEATURES_ & kAlibi) != 0;
  static constexpr bool SINKS = (FEATURES_ & kSinks) != 0;
  static constexpr bool PACK_GQA = false;
  using Logits = LogitsHook<SOFTCAP, ALIBI>;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_N = BLOCK_N_;
  static constexpr int STAGES = STAGES_;
  static constexpr bool SPLIT = SPLIT_;

  static constexpr int NUM_WG = BLOCK_M / 64;         // warpgroups, 64 query rows each
  static constexpr int NUM_WARPS = 4 * NUM_WG;
  static constexpr int THREADS = 32 * NUM_WARPS;
  // What flash_fwd.cuh's parts read: each warp owns one m16 tile of rows.
  static constexpr int WARP_M = 16;
  static constexpr int M_TILES = 1;
  static constexpr int D_CHUNKS = HEAD_DIM / 8;       // 16-byte chunks per row
  static constexpr int QK_K_STEPS = HEAD_DIM / 16;    // k16 steps of S = Q K^T
  static constexpr int S_N_TILES = BLOCK_N / 8;
  static constexpr int PV_K_STEPS = BLOCK_N / 16;     // k16 steps of O += P V
  static constexpr int O_N_TILES = HEAD_DIM / 8;
  static constexpr bool BRANCH_FREE_RESCALE = true;
  static constexpr bool EARLY_PACK = true;            // P packed to T as the wgmma A operand
  static constexpr int Q_LOADS_PER_LANE = WARP_M * D_CHUNKS / 32;   // the output store
  static constexpr int STORE_UNROLL = Q_LOADS_PER_LANE;

  // Shared memory (all tiles 128-byte swizzled, common/wgmma.cuh): one 64-row Q tile per
  // warpgroup (also its output staging), then STAGES x (K tile, V tile), each [key][dim];
  // 1024 bytes of slack align the base to the swizzle's 1024-byte period.
  static constexpr int WG_Q_BYTES = 64 * HEAD_DIM * 2;
  static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;
  static constexpr int SMEM_BYTES = 1024 + Q_BYTES + STAGES * STAGE_BYTES;
  // Copies: each thread takes one 16-byte column chunk of every ROWS_PER_PASS-th row when
  // a row's chunks divide the block (EVEN_ROWS); otherwise chunk c of the tile goes to
  // thread c % THREADS (head dim 192).
  static constexpr bool EVEN_ROWS = THREADS % D_CHUNKS == 0;
  static constexpr int ROWS_PER_PASS = EVEN_ROWS ? THREADS / D_CHUNKS : 1;
  static constexpr int Q_PASSES = EVEN_ROWS ? (BLOCK_M + ROWS_PER_PASS - 1) / ROWS_PER_PASS
                                            : (BLOCK_M * D_CHUNKS + THREADS - 1) / THREADS;
  static constexpr int KV_PASSES = EVEN_ROWS ? (BLOCK_N + ROWS_PER_PASS - 1) / ROWS_PER_PASS
                                             : (BLOCK_N * D_CHUNKS + THREADS - 1) / THREADS;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "head dim: whole 128-byte column blocks");
  static_assert(BLOCK_M % 64 == 0 && BLOCK_M <= 192, "one to three warpgroups");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "wgmma N of S = Q K^T");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert((FEATURES_ & kPackGqa) == 0, "dense K/V: one head per block");
};

// Grid, block and outputs as flash_fwd_kernel (block: THREADS = 128 x warpgroups).
// Block (x, y, z) computes row tile (gridDim.x - 1 - x) of head y, batch z / num_splits,
// over the key tiles of split z % num_splits.
template <typename Tr>
__device__ void flash_fwd_sm90_kernel(const FlashFwdParams& p) {
  using T = typename Tr::T;
  constexpr int BN = Tr::BLOCK_N;
  constexpr int STAGES = Tr::STAGES;

  extern __shared__ __align__(1024) unsigned char smem[];
  const u32 smem_q = (smem_addr(smem) + 1023u) & ~1023u;
  const u32 smem_kv = smem_q + Tr::Q_BYTES;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int wg = warp / 4;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t4 = lane % 4;

  // ---- Phase 0: which rows, which keys ---------------------------------------------------
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int b = Tr::SPLIT ? blockIdx.z / p.num_splits : blockIdx.z;
  const int split = Tr::SPLIT ? blockIdx.z % p.num_splits : 0;
  const int head = blockIdx.y;
  const int kvh = head / p.head_group;
  const QueryRows<false> qrows{head, 1};
  const SeqRange qr = seq_range(p.cu_seqlens_q, b, p.seqlen_q);
  const SeqRange kr = seq_range(p.cu_seqlens_k, b, p.seqlen_k);
  const int sq = qr.len, sk = kr.len;
  const int m0 = m_block * Tr::BLOCK_M;
  if (m0 >= sq) return;
  const int m_last = min(m0 + Tr::BLOCK_M, sq) - 1;
  const typename Tr::Mask mask(sq, sk, p.window_left, p.window_right);
  const int head_dim_chunks = p.head_dim / 8;

  const T* q_ptr = static_cast<const T*>(p.q) + b * p.q_stride_batch +
                   (long long)qr.start * p.q_stride_row + head * p.q_stride_head;
  const T* k_ptr = static_cast<const T*>(p.k) + b * p.k_stride_batch +
                   (long long)kr.start * p.k_stride_row + kvh * p.k_stride_head;
  const T* v_ptr = static_cast<const T*>(p.v) + b * p.v_stride_batch +
                   (long long)kr.start * p.v_stride_row + kvh * p.v_stride_head;
  const KeyTiles tiles = key_tiles<Tr>(mask, m0, m_last, sk, split, p.num_splits);
  const int n_steps = tiles.n_steps;
  auto stage_base = [&](int n) { return smem_kv + (n % STAGES) * Tr::STAGE_BYTES; };

  // This thread's copy column and first row (EVEN_ROWS); chunks past head_dim and rows
  // past the sequence are zero-filled (a zero V row keeps 0 * garbage out of P V).
  const int ld_ch = Tr::EVEN_ROWS ? tid % Tr::D_CHUNKS : 0;
  const int ld_row = Tr::EVEN_ROWS ? tid / Tr::D_CHUNKS : 0;
  const bool ld_ch_ok = ld_ch < head_dim_chunks;
  auto load_kv = [&](u32 stage, int tile) {
    if constexpr (Tr::EVEN_ROWS) {
      const int key0 = tile * BN + ld_row;
      const T* ks = k_ptr + (long long)key0 * p.k_stride_row + ld_ch * 8;
      const T* vs = v_ptr + (long long)key0 * p.v_stride_row + ld_ch * 8;
#pragma unroll
      for (int it = 0; it < Tr::KV_PASSES; ++it) {
        const int r = it * Tr::ROWS_PER_PASS + ld_row;
        if (BN % Tr::ROWS_PER_PASS == 0 || r < BN) {
          const bool ok = ld_ch_ok && key0 + it * Tr::ROWS_PER_PASS < sk;
          const u32 off = sw128_offset<BN>(r, ld_ch);
          cp_async_16(stage + off, ok ? ks : k_ptr, ok ? 16 : 0);
          cp_async_16(stage + Tr::KV_TILE_BYTES + off, ok ? vs : v_ptr, ok ? 16 : 0);
        }
        ks += (long long)Tr::ROWS_PER_PASS * p.k_stride_row;
        vs += (long long)Tr::ROWS_PER_PASS * p.v_stride_row;
      }
    } else {
#pragma unroll
      for (int it = 0; it < Tr::KV_PASSES; ++it) {
        const int c = it * Tr::THREADS + tid;
        if ((BN * Tr::D_CHUNKS) % Tr::THREADS == 0 || c < BN * Tr::D_CHUNKS) {
          const int r = c / Tr::D_CHUNKS, ch = c % Tr::D_CHUNKS;
          const int key = tile * BN + r;
          const bool ok = ch < head_dim_chunks && key < sk;
          const u32 off = sw128_offset<BN>(r, ch);
          cp_async_16(stage + off, ok ? k_ptr + (long long)key * p.k_stride_row + ch * 8 : k_ptr,
                      ok ? 16 : 0);
          cp_async_16(stage + Tr::KV_TILE_BYTES + off,
                      ok ? v_ptr + (long long)key * p.v_stride_row + ch * 8 : v_ptr, ok ? 16 : 0);
        }
      }
    }
  };

  // ---- Phase 1: start the loads: Q, then the first STAGES-1 K/V tiles ---------------------
#pragma unroll
  for (int it = 0; it < Tr::Q_PASSES; ++it) {
    // row r of the block's Q tile, chunk ch
    const int c = it * Tr::THREADS + tid;
    const int r = Tr::EVEN_ROWS ? it * Tr::ROWS_PER_PASS + ld_row : c / Tr::D_CHUNKS;
    const int ch = Tr::EVEN_ROWS ? ld_ch : c % Tr::D_CHUNKS;
    if (Tr::Q_PASSES * (Tr::EVEN_ROWS ? Tr::ROWS_PER_PASS : Tr::THREADS / Tr::D_CHUNKS) ==
            Tr::BLOCK_M || r < Tr::BLOCK_M) {
      const bool ok = ch < head_dim_chunks && m0 + r < sq;
      const T* src = ok ? q_ptr + (long long)(m0 + r) * p.q_stride_row + ch * 8 : q_ptr;
      cp_async_16(smem_q + (r / 64) * Tr::WG_Q_BYTES + sw128_offset<64>(r % 64, ch), src,
                  ok ? 16 : 0);
    }
  }
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_steps) load_kv(stage_base(s), tiles.tile_of(s));
    cp_async_commit();   // always commit: every thread counts the same groups
  }

  // Descriptors: this warpgroup's Q rows (k16 step ks: column block ks / 4, 32 bytes per
  // step inside it), a stage's K tile likewise, its V tile by k16 step of keys (16 rows of
  // 128 bytes) with 64-column blocks BN x 128 bytes apart.
  const u32 q_wg = smem_q + wg * Tr::WG_Q_BYTES;
  auto q_desc = [&](int ks) { return sw128_desc(q_wg + (ks / 4) * (64 * 128) + (ks % 4) * 32); };
  auto k_desc = [&](u32 stage, int ks) {
    return sw128_desc(stage + (ks / 4) * (BN * 128) + (ks % 4) * 32);
  };
  auto v_desc = [&](u32 stage, int kk) {
    return sw128_desc(stage + Tr::KV_TILE_BYTES + kk * (16 * 128), BN * 128);
  };

  float o_acc[1][Tr::O_N_TILES][4];
#pragma unroll
  for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o_acc[0][nt][e] = 0.f;
  }
  float s[1][Tr::S_N_TILES][4];
  u32 p_pack[1][Tr::PV_K_STEPS][4];
  WarpSoftmax<Tr> softmax(p.scale_log2);
  const int row0 = m0 + warp * 16 + g;   // this thread's rows: row0 and row0 + 8
  float slope = 0.f;
  if constexpr (Tr::ALIBI) {
    slope = static_cast<const float*>(p.alibi_slopes)[head] * p.softmax_scale_inv;
  }
  const typename Tr::Logits hook(slope, p.softcap_in, p.softcap_out);

  // ---- Phase 2: one key tile: S = Q K^T, (hook, mask), online softmax, O += P V ------------
  for (int n = 0; n < n_steps; ++n) {
    const int tile = tiles.tile_of(n);
    // 2a. wait for this tile (and Q), make the copies visible to the tensor cores, then
    // refill the stage every warpgroup finished with last step
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();
    __syncthreads();
    if (n + STAGES - 1 < n_steps) load_kv(stage_base(n + STAGES - 1), tiles.tile_of(n + STAGES - 1));
    cp_async_commit();
    const u32 stage = stage_base(n);

    // 2b. S = Q K^T
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Tr::QK_K_STEPS; ++ks) {
      Wgmma<T, BN>::ss(s[0], q_desc(ks), k_desc(stage, ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s[0]);

    // 2c. the logits hook, then (boundary tiles only) -inf outside the band / sequence
    const bool masked = n < tiles.n_masked;
    if (Tr::Logits::ACTIVE || masked) {
#pragma unroll
      for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row0 + (e / 2) * 8;
          const int j = tile * BN + nt * 8 + 2 * t4 + (e % 2);
          if (Tr::Logits::ACTIVE) s[0][nt][e] = hook(s[0][nt][e], i + mask.diag, j);
          if (masked && !mask.visible(i, j, sk)) s[0][nt][e] = neg_inf();
        }
      }
    }

    // 2d. online softmax (O rescaled, P packed to T)
    softmax.template update<Tr::Mask::BAND>(s, o_acc, p_pack);   // see flash_fwd.cuh

    // 2e. O += P V
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) {
      Wgmma<T, Tr::HEAD_DIM>::rs(o_acc[0], p_pack[0][kk], v_desc(stage, kk), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o_acc[0]);
  }
  cp_async_wait<0>();
  // Every warpgroup's wgmmas have read its Q tile; the epilogue reuses it.
  __syncthreads();

  // ---- Phase 3: whole rows, then the epilogue -------------------------------------------------
  constexpr bool FINISH_SINKS = Tr::SINKS && !Tr::SPLIT;
  float sink[1][2];
  sink[0][0] = sink[0][1] =
      FINISH_SINKS ? static_cast<const float*>(p.sinks)[head] * p.softmax_scale_inv : 0.f;
  const auto rows = softmax.template finish<FINISH_SINKS>(sink);
  if constexpr (Tr::SPLIT) {
    store_partials<Tr>(p, rows, o_acc, b, qrows, sq, split, qr, m0, warp, g, t4,
                       head_dim_chunks);
  } else {
    store_output<Tr>(p, rows, o_acc, smem_q, b, qrows, sq, qr, m0, warp, lane, g, t4,
                     head_dim_chunks);
  }
}

}  // namespace cuattn
