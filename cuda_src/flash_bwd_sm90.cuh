// FlashAttention backward on Hopper's warpgroup MMA (sm_90a): flash_bwd.cuh's algorithm and
// block shape (one block per KV tile, dK and dV in registers across the query tiles that see
// it, dQ added in fp32 into the workspace; the pre-pass, dQ convert and sinks kernels are
// flash_bwd.cuh's) with its five GEMMs on wgmma.mma_async, in FlashAttention-3's orientation
// (Shah et al. 2024, hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp, SdP_swapAB): each consumer
// warpgroup owns 64 keys of the tile and computes
//   S^T = K Q^T and dP^T = V dO^T   (A: its K / V rows, B: the Q / dO tile, both K-major),
//   P^T, dS^T in registers          (flash_bwd.cuh's p_and_ds: rows keys, columns queries),
//   dV += P^T dO, dK += dS^T Q      (A: P^T / dS^T from registers, B: dO / Q MN-major),
//   dQ = dS K                       (A: the dS^T tile in shared memory, MN-major; B: K,
//                                    MN-major), each warpgroup a 64-row x DQ_DIMS part.
// Stage 1 of the Hopper backward: every thread loads (cp.async, two stages of Q, dO, lse2 and
// D) and computes; no producer warpgroup yet. cp.async writes through the generic proxy and
// wgmma reads through the async proxy, so each thread fences (fence.proxy.async) after its
// copies land and before the barrier that publishes them, as it does after storing dS^T.
#pragma once
#include "flash_bwd.cuh"
#include "common/wgmma.cuh"

namespace cuattn {

// Every knob of one Hopper backward kernel (cuattn.variants.FlashBwdSm90Variant, chosen by
// cuattn/tuning_bwd.py) and every constant derived from them.
//   BLOCK_M  query rows per tile: the N of S^T and dP^T, the K of dV and dK (a multiple of 64).
//   NUM_WG   consumer warpgroups, 64 keys each: BLOCK_N = 64 NUM_WG.
//   MASK, FEATURES  as flash_bwd.cuh's.
// dQ = dS K: the warpgroups tile BLOCK_M x HEAD_DIM as DQ_ROW_TILES row tiles of 64 x
// DQ_GROUPS column groups of DQ_DIMS (whole 64-column blocks of K), each computed in
// DQ_PARTS parts of DQ_N columns (whole column blocks, at most 128: 64 accumulators a thread).
// Above head dim 128 dK and dV together would not fit in registers: PASSES = 2 walks the
// query tiles twice, as flash_bwd.cuh does.
template <typename T_, int HEAD_DIM_, int BLOCK_M_, int NUM_WG_, int MASK_, int FEATURES_>
struct FlashBwdSm90Traits : FlashFeatures<FEATURES_> {
  using T = T_;
  using Mask = BandMask<MASK_>;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int NUM_WG = NUM_WG_;
  static constexpr int BLOCK_N = 64 * NUM_WG;
  static constexpr int THREADS = 128 * NUM_WG;
  static constexpr int D_CHUNKS = HEAD_DIM / 8;       // 16-byte chunks of a Q / K / V row
  static constexpr int K_STEPS = HEAD_DIM / 16;       // k16 steps of S^T, dP^T
  static constexpr int C_N_TILES = BLOCK_M / 8;       // n8 tiles of S^T (queries)
  static constexpr int C_K_STEPS = BLOCK_M / 16;      // k16 steps of dV, dK
  static constexpr int D_N_TILES = HEAD_DIM / 8;      // n8 tiles of dK, dV
  static constexpr int DQ_ROW_TILES = BLOCK_M / 64;
  static constexpr int DQ_GROUPS = NUM_WG / DQ_ROW_TILES;
  static constexpr int DQ_DIMS = HEAD_DIM / DQ_GROUPS;
  static constexpr int DQ_N = DQ_DIMS <= 128 ? DQ_DIMS : DQ_DIMS % 128 == 0 ? 128 : 64;
  static constexpr int DQ_PARTS = DQ_DIMS / DQ_N;
  static constexpr int PASSES = HEAD_DIM > 128 ? 2 : 1;
  static constexpr int STAGES = 2;                    // Q, dO, lse2, D of the next query tile

  // Shared memory from a 1024-byte-aligned base (1024 bytes of slack): the K and V tiles, the
  // stages' Q and dO tiles, the dS^T tile (all 128-byte swizzled: common/wgmma.cuh), then
  // each stage's lse2 and D rows.
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int QO_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int DS_BYTES = BLOCK_N * BLOCK_M * 2;
  static constexpr int ROWS_BYTES = 2 * BLOCK_M * 4;
  static constexpr int SMEM_BYTES =
      1024 + 2 * KV_TILE_BYTES + STAGES * (2 * QO_TILE_BYTES + ROWS_BYTES) + DS_BYTES;
  // load_tile's layout: 64-column blocks of ROWS rows x 128 bytes, 128-byte swizzle.
  template <int ROWS>
  static __device__ __forceinline__ u32 tile_offset(int r, int ch) {
    return sw128_offset<ROWS>(r, ch);
  }
  static constexpr int ROW_BYTES = 128;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "head dim: whole 128-byte column blocks");
  static_assert(BLOCK_M % 64 == 0 && BLOCK_M <= 256, "BLOCK_M: 64-row dQ tiles, wgmma N");
  static_assert(NUM_WG % DQ_ROW_TILES == 0 && DQ_DIMS % 64 == 0,
                "dQ: each warpgroup a row tile and whole 64-column blocks");
  static_assert(FEATURES_ >= 0 && FEATURES_ < 8, "softcap, ALiBi, sinks");
};

// One block: BwdWork (flash_bwd.cuh), its shared memory and this thread's place: warpgroup
// wg (keys 64 wg .. of the tile), warp w4 in it (16 of those keys), g and t4 in the warp.
template <typename Tr>
struct BwdSm90Block : BwdWork<Tr> {
  using T = typename Tr::T;
  using Work = BwdWork<Tr>;
  static constexpr int BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N, HD = Tr::HEAD_DIM;
  using Work::p;

  u32 s_k, s_v, s_ds, s_stage0;   // shared: K, V, dS^T tiles; stage 0's Q tile
  const float* rows0;             // stage 0's lse2 and D rows
  int tid, wg, w4, g, t4;

  __device__ __forceinline__ BwdSm90Block(const FlashBwdParams& params, unsigned char* smem)
      : Work(params) {
    const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
    s_k = base;
    s_v = s_k + Tr::KV_TILE_BYTES;
    s_stage0 = s_v + Tr::KV_TILE_BYTES;
    s_ds = s_stage0 + Tr::STAGES * 2 * Tr::QO_TILE_BYTES;
    rows0 = reinterpret_cast<const float*>(smem + (s_ds + Tr::DS_BYTES - smem_addr(smem)));
    tid = threadIdx.x;
    // (broadcast from lane 0: warp-uniform, so descriptors derived from it stay uniform)
    wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    w4 = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
    g = (tid % 32) / 4;
    t4 = tid % 4;
  }

  __device__ __forceinline__ u32 s_q(int st) const { return s_stage0 + st * 2 * Tr::QO_TILE_BYTES; }
  __device__ __forceinline__ u32 s_do(int st) const { return s_q(st) + Tr::QO_TILE_BYTES; }
  __device__ __forceinline__ const float* rows_of(int st) const {   // lse2, then D
    return rows0 + st * 2 * BLOCK_M;
  }
  // (threadIdx.x read anew: the copies' per-thread offsets are rebuilt per query tile, not
  // held across the loop as invariants)
  __device__ __forceinline__ void load_stage(int it) const {
    const int st = it % Tr::STAGES;
    this->load_step(it, s_q(st), s_do(st), s_ds + Tr::DS_BYTES + st * Tr::ROWS_BYTES,
                    thread_index_now());
  }
  // This thread's first key of the tile: its warp's 16 keys.
  __device__ __forceinline__ int key0() const { return this->n0 + wg * 64 + w4 * 16; }

  // Descriptors (common/wgmma.cuh), each from a tile's address as this point of the program
  // has it (value_now): built per query tile, not held across the loop (the descriptors of
  // every k16 step of every tile, hoisted as loop invariants, spilled ~300 B at hd256).
  // K-major operands by k16 step ks of the head dim: a tile of ROWS rows, its 64-column
  // blocks ROWS x 128 bytes apart (this warpgroup's 64 rows of K or V as A: ROWS = BLOCK_N
  // from row 64 wg; Q or dO as B: ROWS = BLOCK_M).
  static __device__ __forceinline__ u64 desc_now(u32 addr, u32 lbo_bytes = 16) {
    return sw128_desc(static_cast<u32>(value_now(static_cast<int>(addr))), lbo_bytes);
  }
  template <int ROWS>
  static __device__ __forceinline__ u64 k_step(u64 desc, int ks) {
    return desc_advance(desc, (ks / 4) * (ROWS * 128) + (ks % 4) * 32);
  }
  // MN-major operands by k16 step kk of 16 rows (2048 bytes): Q or dO as B of dV, dK (N the
  // head dim, 64-column blocks BLOCK_M x 128 bytes apart); K as B of dQ from column c0 (N its
  // dims); the dS^T tile as A of dQ, its 64 queries from q0 (M).
  static __device__ __forceinline__ u64 mn_step(u64 desc, int kk) {
    return desc_advance(desc, kk * 16 * 128);
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

#pragma unroll 1
    for (int it = 0; it < n_iter; ++it) {
      const int h = this->head_of(it), m0 = this->m0_of(it), st = it % Tr::STAGES;
      cp_async_wait<0>();
      fence_proxy_async();   // this thread's copies, read next by wgmma (the async proxy)
      __syncthreads();       // step it's stage has landed everywhere; the other one is free
      if (it + 1 < n_iter) load_stage(it + 1);
      cp_async_commit();

      // S^T = K Q^T, and dP^T = V dO^T for dS
      float s[Tr::C_N_TILES][4], dp[Tr::C_N_TILES][4];
      wgmma_fence();
      {
        const u64 k = desc_now(s_k + wg * 64 * 128), q = desc_now(s_q(st));
#pragma unroll
        for (int ks = 0; ks < Tr::K_STEPS; ++ks) {
          Wgmma<T, BLOCK_M>::ss(s, k_step<BLOCK_N>(k, ks), k_step<BLOCK_M>(q, ks), ks > 0);
        }
      }
      if constexpr (DS) {
        const u64 v = desc_now(s_v + wg * 64 * 128), d_o = desc_now(s_do(st));
#pragma unroll
        for (int ks = 0; ks < Tr::K_STEPS; ++ks) {
          Wgmma<T, BLOCK_M>::ss(dp, k_step<BLOCK_N>(v, ks), k_step<BLOCK_M>(d_o, ks), ks > 0);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(s);
      if constexpr (DS) fence_regs(dp);

      // P = exp2(scale hook(S) - lse2), 0 where masked; dS = P (dP - D) hook'
      p_and_ds<Tr, DS>(s, dp, *this, rows_of(st), h, m0, key0(), g, t4, this->masked(it));

      // dV += P^T dO, dK += dS^T Q (A from registers)
      u32 pa[Tr::C_K_STEPS][4], dsa[Tr::C_K_STEPS][4];
      if constexpr (DV) pack_rows<T>(pa, s);
      if constexpr (DS) pack_rows<T>(dsa, dp);
      wgmma_fence();
      {
        const u64 d_o = desc_now(s_do(st), BLOCK_M * 128), q = desc_now(s_q(st), BLOCK_M * 128);
#pragma unroll
        for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
          if constexpr (DV) Wgmma<T, HD>::rs(acc_v, pa[kk], mn_step(d_o, kk), 1);
          if constexpr (DK) Wgmma<T, HD>::rs(acc_k, dsa[kk], mn_step(q, kk), 1);
        }
      }
      wgmma_commit();
      if constexpr (DQ) {
        store_ds(dsa);
        fence_proxy_async();   // dS^T, read next by wgmma
        __syncthreads();       // the whole dS^T tile
      }
      // (dQ's accumulators only once dV and dK have landed: the registers of P^T and dS^T
      // are free then)
      wgmma_wait<0>();
      if constexpr (DV) fence_regs(acc_v);
      if constexpr (DK) fence_regs(acc_k);
      if constexpr (DQ) add_dq(h, m0);
    }
    cp_async_wait<0>();
  }

  // This warp's dS^T rows into the [key][query] tile (64-query column blocks, 128-byte
  // swizzle): a[kk][r] holds (key g + 8 (r % 2), queries 16 kk + 8 (r / 2) + 2 t4, + 1).
  __device__ __forceinline__ void store_ds(const u32 (&a)[Tr::C_K_STEPS][4]) const {
#pragma unroll
    for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = wg * 64 + w4 * 16 + g + 8 * (r % 2);
        const u32 addr = s_ds + sw128_offset<BLOCK_N>(row, 2 * kk + r / 2) + t4 * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(a[kk][r]) : "memory");
      }
    }
  }

  // dQ of this warpgroup's row tile and column group, dS K over the key tile, added into the
  // workspace rows of head h (query tile m0).
  __device__ __forceinline__ void add_dq(int h, int m0) const {
    const int rt = wg % Tr::DQ_ROW_TILES, grp = wg / Tr::DQ_ROW_TILES;
    const int r0 = m0 + rt * 64 + w4 * 16;   // this warp's first row
#pragma unroll
    for (int part = 0; part < Tr::DQ_PARTS; ++part) {
      const int c0 = grp * Tr::DQ_DIMS + part * Tr::DQ_N;
      float acc[Tr::DQ_N / 8][4];
      wgmma_fence();
      const u64 ds = desc_now(s_ds + rt * (BLOCK_N * 128));
      const u64 k = desc_now(s_k + (c0 / 64) * (BLOCK_N * 128), BLOCK_N * 128);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        Wgmma<T, Tr::DQ_N>::template ss<1, 1>(acc, mn_step(ds, kk), mn_step(k, kk), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(acc);
      this->add_dq_rows(acc, h, r0, c0, g, t4);
    }
  }
};

// Grid: (ceil(max_seqlen_k / BLOCK_N), num_heads_kv, batch), or deterministically (dq_slices,
// num_heads_kv, batch); block: (THREADS), dynamic shared memory: Tr::SMEM_BYTES. What
// flash_bwd_kernel computes, in the same order (key tiles x, x + gridDim.x, ... of KV head y,
// batch z), with its GEMMs on wgmma: each warpgroup's 64 keys of dK (times the softmax
// scale) and dV are written once per tile.
template <typename Tr>
__device__ void flash_bwd_sm90_kernel(const FlashBwdParams& p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  BwdSm90Block<Tr> blk(p, smem);
  bwd_key_tiles<Tr>(p, blk);
}

}  // namespace cuattn
