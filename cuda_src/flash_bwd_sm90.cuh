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
// Warp-specialized: a producer warpgroup (few registers: setmaxnreg) loads the key tile's K and
// V and, per query tile, Q, dO, lse2 and D into a ring of STAGES stages by cp.async, each
// guarded by a full and an empty mbarrier, and (one warp of it) adds the consumers' dQ tile
// into the workspace by bulk reduce-adds; the consumer warpgroups compute, P under the dP
// GEMM and dQ's GEMM under the wait for dV and dK. cp.async writes through the generic proxy
// and wgmma and the bulk copies read through the async proxy, so a consumer fences
// (fence.proxy.async) after each full barrier it waits on and after storing dS^T or dQ.
#pragma once
#include "flash_bwd.cuh"
#include "common/wgmma.cuh"

namespace cuattn {

// Every knob of one Hopper backward kernel (cuattn.keys.FlashBwdSm90Variant, chosen by
// cuattn/tuning_bwd.py) and every constant derived from them.
//   BLOCK_M  query rows per tile: the N of S^T and dP^T, the K of dV and dK (a multiple of 64).
//   NUM_WG   consumer warpgroups, 64 keys each: BLOCK_N = 64 NUM_WG (and one producer
//            warpgroup: THREADS = 128 (1 + NUM_WG)).
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
  static constexpr int PRODUCER_THREADS = 128;
  static constexpr int CONSUMER_THREADS = 128 * NUM_WG;
  static constexpr int THREADS = PRODUCER_THREADS + CONSUMER_THREADS;
  // The producer warpgroup's roles: warps 0-1 load (load_tile's threads), warp 2 adds dQ into
  // the workspace (where DQ_SMEM), warp 3 idles.
  static constexpr int LOAD_THREADS = 64;
  static constexpr int DQ_WARP = 2;
  // setmaxnreg: the block launches with LAUNCH_REGS a thread (65536 / THREADS in units of 8,
  // at most 255: min_blocks 1); with two consumer warpgroups the producer gives up registers
  // for them (the release covers the gain, else setmaxnreg.inc waits forever); with one,
  // everyone has 255 already.
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8 > 255 ? 255 : 65536 / THREADS / 8 * 8;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  static constexpr bool SET_REGS = NUM_WG == 2;
  // bwd_block_index's schedule, where p.lpt_group > 0 (the host sets it for causal calls
  // only; the other forms compile none of it)
  static constexpr bool CAUSAL_SCHEDULE = MASK_ == kMaskCausal;
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
  static constexpr int STAGES = 2;                    // Q, dO, lse2, D of a query tile

  // Shared memory from a 1024-byte-aligned base (1024 bytes of slack): the K and V tiles, the
  // stages' Q and dO tiles, two dS^T tiles (all 128-byte swizzled: common/wgmma.cuh), the dQ
  // tile (DQ_SMEM), each stage's lse2 and D rows, then the mbarriers (full and empty per
  // stage; K / V full and empty; dQ full and empty).
  // dQ: the consumers store their dQ accumulators into a [BLOCK_M][HEAD_DIM] fp32 tile (rows
  // DQ_ROW_BYTES apart: 32 bytes of padding keep the stores of a half-warp on distinct banks)
  // and the producer's DQ_WARP adds it into the workspace (cp.reduce.async.bulk, one row per
  // copy), off the consumers' path; where that tile does not fit beside the rest (hd256) the
  // consumers add their accumulators themselves (red.global.add).
  static constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
  static constexpr int QO_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
  static constexpr int DS_BYTES = BLOCK_N * BLOCK_M * 2;
  static constexpr int ROWS_BYTES = 2 * BLOCK_M * 4;
  static constexpr int BARRIERS = 2 * STAGES + 4;
  static constexpr int DQ_ROW_BYTES = HEAD_DIM * 4 + 32;
  static constexpr int DQ_TILE_BYTES = BLOCK_M * DQ_ROW_BYTES;
  static constexpr int BASE_SMEM_BYTES = 1024 + 2 * KV_TILE_BYTES +
                                         STAGES * (2 * QO_TILE_BYTES + ROWS_BYTES) +
                                         2 * DS_BYTES + 8 * BARRIERS;
  static constexpr bool DQ_SMEM = BASE_SMEM_BYTES + DQ_TILE_BYTES <= 227 * 1024;
  static constexpr int SMEM_BYTES = BASE_SMEM_BYTES + (DQ_SMEM ? DQ_TILE_BYTES : 0);
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
  static_assert(NUM_WG <= 2, "one or two consumer warpgroups");
  static_assert(!SET_REGS || PRODUCER_THREADS * (LAUNCH_REGS - PRODUCER_REGS) >=
                                 CONSUMER_THREADS * (CONSUMER_REGS - LAUNCH_REGS),
                "register split: setmaxnreg.inc would wait for registers no one frees");
  static_assert(FEATURES_ >= 0 && FEATURES_ < 8, "softcap, ALiBi, sinks");
};

// The shared memory of one block (the traits' layout) from its 1024-byte-aligned base.
template <typename Tr>
struct BwdSm90Smem {
  u32 base;
  __device__ __forceinline__ u32 k() const { return base; }
  __device__ __forceinline__ u32 v() const { return base + Tr::KV_TILE_BYTES; }
  __device__ __forceinline__ u32 q(int st) const {
    return base + 2 * Tr::KV_TILE_BYTES + st * 2 * Tr::QO_TILE_BYTES;
  }
  __device__ __forceinline__ u32 d_o(int st) const { return q(st) + Tr::QO_TILE_BYTES; }
  __device__ __forceinline__ u32 ds(int buf) const { return q(Tr::STAGES) + buf * Tr::DS_BYTES; }
  __device__ __forceinline__ u32 dq() const { return ds(2); }
  __device__ __forceinline__ u32 rows(int st) const {
    return dq() + (Tr::DQ_SMEM ? Tr::DQ_TILE_BYTES : 0) + st * Tr::ROWS_BYTES;
  }
  __device__ __forceinline__ u32 full(int st) const { return rows(Tr::STAGES) + st * 8; }
  __device__ __forceinline__ u32 empty(int st) const { return full(Tr::STAGES) + st * 8; }
  __device__ __forceinline__ u32 kv_full() const { return empty(Tr::STAGES); }
  __device__ __forceinline__ u32 kv_empty() const { return kv_full() + 8; }
  __device__ __forceinline__ u32 dq_full() const { return kv_full() + 16; }
  __device__ __forceinline__ u32 dq_empty() const { return kv_full() + 24; }
};

// The ring: the producer and the consumers count the query steps of every pass of every key
// tile of the block alike; step s uses stage s % STAGES, in phase (s / STAGES) % 2.
template <typename Tr>
__device__ __forceinline__ int ring_stage(int step) { return step % Tr::STAGES; }
template <typename Tr>
__device__ __forceinline__ int ring_phase(int step) { return (step / Tr::STAGES) & 1; }

// The producer's loaders (threads 0 .. LOAD_THREADS - 1), in bwd_key_tiles' order: per key
// tile, once the
// consumers are done with the last one (kv_empty), its K and V tiles (kv_full); then per pass
// and query step, once the consumers freed the stage (empty), the step's Q, dO, lse2 and D
// (full). Each thread arrives on a full barrier when its copies for it have landed. (Its
// index read anew per copy: the copies' offsets, held across the loop, spilled 40 registers.)
template <typename Tr>
__device__ __forceinline__ void bwd_sm90_produce(const FlashBwdParams& p, BwdSm90Smem<Tr> sm) {
  BwdWork<Tr> w(p);
  int step = 0, tile = 0;
  for (int n = w.first_tile(); w.has_tile(n); n = w.next_tile(n), ++tile) {
    w.start_tile(n);
    mbar_wait(sm.kv_empty(), (tile & 1) ^ 1);
    w.load_kv(sm.k(), sm.v(), thread_index_now());
    cp_async_mbar_arrive(sm.kv_full());
#pragma unroll 1
    for (int pass = 0; pass < Tr::PASSES; ++pass) {
#pragma unroll 1
      for (int it = 0; it < w.n_iter; ++it, ++step) {
        const int st = ring_stage<Tr>(step);
        mbar_wait(sm.empty(st), ring_phase<Tr>(step) ^ 1);
        w.load_step(it, sm.q(st), sm.d_o(st), sm.rows(st), thread_index_now());
        cp_async_mbar_arrive(sm.full(st));
      }
    }
  }
  cp_async_wait<0>();   // nothing may still be writing shared memory when the block exits
}

// The producer's DQ_WARP (lane `lane`), for DQ_SMEM: per step of each key tile's dQ pass, once
// the consumers have stored the dQ tile (dq_full), its rows below the sequence's end added
// into the workspace, one cp.reduce.async.bulk (.add.f32) of head_dim floats a row, or one
// red.global.add a float where a row's bytes are not a multiple of 16 (odd head dims); the
// tile is handed back (dq_empty) once read. A key tile's adds complete before the next tile's
// start, which adds into the same rows: the order of the adds stays fixed (deterministic).
template <typename Tr>
__device__ __forceinline__ void bwd_sm90_add_dq(const FlashBwdParams& p, BwdSm90Smem<Tr> sm,
                                                int lane) {
  BwdWork<Tr> w(p);
  const bool bulk = p.head_dim % 4 == 0;
  const long long row_floats = (long long)p.num_heads * p.head_dim;
  int dq_step = 0;
  for (int n = w.first_tile(); w.has_tile(n); n = w.next_tile(n)) {
    w.start_tile(n);
#pragma unroll 1
    for (int it = 0; it < w.n_iter; ++it, ++dq_step) {
      const int h = w.head_of(it), m0 = w.m0_of(it);
      float* rows = w.dq_accum + ((w.row_base + m0) * p.num_heads + h) * (long long)p.head_dim;
      const int n_rows = min(Tr::BLOCK_M, w.sq - m0);
      mbar_wait(sm.dq_full(), dq_step & 1);
      if (bulk) {
        for (int r = lane; r < n_rows; r += 32) {
          asm volatile(
              "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
              :: "l"(rows + r * row_floats), "r"(sm.dq() + r * Tr::DQ_ROW_BYTES),
                 "r"(p.head_dim * 4) : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      } else {
        for (int r = 0; r < n_rows; ++r) {
          for (int c = lane; c < p.head_dim; c += 32) {
            float x;
            asm volatile("ld.shared.f32 %0, [%1];\n"
                         : "=f"(x) : "r"(sm.dq() + r * Tr::DQ_ROW_BYTES + c * 4) : "memory");
            asm volatile("red.global.add.f32 [%0], %1;\n"
                         :: "l"(rows + r * row_floats + c), "f"(x) : "memory");
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(sm.dq_empty());
    }
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

// One consumer block: BwdWork (flash_bwd.cuh), its shared memory and this thread's place:
// consumer warpgroup wg (keys 64 wg .. of the tile), warp w4 in it (16 of those keys), g and
// t4 in the warp; and where it is in the ring (step) and in its key tiles (tile).
template <typename Tr>
struct BwdSm90Block : BwdWork<Tr> {
  using T = typename Tr::T;
  using Work = BwdWork<Tr>;
  static constexpr int BLOCK_M = Tr::BLOCK_M, BLOCK_N = Tr::BLOCK_N, HD = Tr::HEAD_DIM;
  static constexpr int DS_BARRIER = 1;   // named barrier of the consumers: dS^T stored
  using Work::p;

  BwdSm90Smem<Tr> sm;
  const float* rows0;             // stage 0's lse2 and D rows
  int wg, w4, g, t4;
  int step = 0, tile = 0, dq_step = 0;

  __device__ __forceinline__ BwdSm90Block(const FlashBwdParams& params, unsigned char* smem,
                                          BwdSm90Smem<Tr> smem_layout)
      : Work(params), sm(smem_layout) {
    rows0 = reinterpret_cast<const float*>(smem + (sm.rows(0) - smem_addr(smem)));
    const int ctid = threadIdx.x - Tr::PRODUCER_THREADS;
    // (broadcast from lane 0: warp-uniform, so descriptors derived from it stay uniform)
    wg = __shfl_sync(0xffffffffu, ctid / 128, 0);
    w4 = __shfl_sync(0xffffffffu, (ctid / 32) % 4, 0);
    g = (ctid % 32) / 4;
    t4 = ctid % 4;
  }

  __device__ __forceinline__ const float* rows_of(int st) const {   // lse2, then D
    return rows0 + st * (Tr::ROWS_BYTES / 4);
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
  // into acc_k (kBwdDk), dQ += dS K into the workspace (kBwdDq). The tile's first pass waits
  // for its K and V; its last (the one with dK) hands them back to the producer.
  template <int WHAT>
  __device__ __forceinline__ void pass(float (&acc_v)[Tr::D_N_TILES][4],
                                       float (&acc_k)[Tr::D_N_TILES][4]) {
    constexpr bool DV = WHAT & kBwdDv, DK = WHAT & kBwdDk, DQ = WHAT & kBwdDq, DS = DK || DQ;
    if constexpr (DV || Tr::PASSES == 1) {
      mbar_wait(sm.kv_full(), tile & 1);
      fence_proxy_async();   // the producer's copies, read next by wgmma (the async proxy)
    }
    const int n_iter = this->n_iter;
    int step = this->step;   // (a local: a member advanced in the loop stays in memory)

#pragma unroll 1
    for (int it = 0; it < n_iter; ++it, ++step) {
      const int h = this->head_of(it), m0 = this->m0_of(it), st = ring_stage<Tr>(step);
      mbar_wait(sm.full(st), ring_phase<Tr>(step));
      fence_proxy_async();

      // S^T = K Q^T, then dP^T = V dO^T for dS: two groups, so that P is computed under the
      // second
      float s[Tr::C_N_TILES][4], dp[Tr::C_N_TILES][4];
      wgmma_fence();
      {
        const u64 k = desc_now(sm.k() + wg * 64 * 128), q = desc_now(sm.q(st));
#pragma unroll
        for (int ks = 0; ks < Tr::K_STEPS; ++ks) {
          Wgmma<T, BLOCK_M>::ss(s, k_step<BLOCK_N>(k, ks), k_step<BLOCK_M>(q, ks), ks > 0);
        }
      }
      wgmma_commit();
      if constexpr (DS) {
        const u64 v = desc_now(sm.v() + wg * 64 * 128), d_o = desc_now(sm.d_o(st));
#pragma unroll
        for (int ks = 0; ks < Tr::K_STEPS; ++ks) {
          Wgmma<T, BLOCK_M>::ss(dp, k_step<BLOCK_N>(v, ks), k_step<BLOCK_M>(d_o, ks), ks > 0);
        }
        wgmma_commit();
      }

      // P = exp2(scale hook(S) - lse2), 0 where masked; dS = P (dP - D) hook'. Without
      // softcap (hook' = 1) P is computed under the dP^T GEMM; softcap's dS needs each
      // score's hook': P and dS both once dP^T has landed.
      constexpr bool P_FIRST = !Tr::SOFTCAP || !DS;
      const float* rows = rows_of(st);
      if constexpr (P_FIRST) {
        if constexpr (DS) wgmma_wait<1>(); else wgmma_wait<0>();
        fence_regs(s);
        p_and_ds<Tr, false>(s, dp, *this, rows, h, m0, key0(), g, t4, this->masked(it));
        if constexpr (DS) {
          wgmma_wait<0>();   // dP^T has landed
          fence_regs(dp);
          ds_from_p<Tr>(s, dp, rows, t4);
        }
      } else {
        wgmma_wait<0>();
        fence_regs(s);
        fence_regs(dp);
        p_and_ds<Tr, true>(s, dp, *this, rows, h, m0, key0(), g, t4, this->masked(it));
      }
      // dV += P^T dO, dK += dS^T Q (A from registers)
      u32 pa[Tr::C_K_STEPS][4], dsa[Tr::C_K_STEPS][4];
      if constexpr (DV) pack_rows<T>(pa, s);
      if constexpr (DS) pack_rows<T>(dsa, dp);
      wgmma_fence();
      if constexpr (DV) {
        const u64 d_o = desc_now(sm.d_o(st), BLOCK_M * 128);
#pragma unroll
        for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
          Wgmma<T, HD>::rs(acc_v, pa[kk], mn_step(d_o, kk), it > 0 || kk > 0);
        }
      }
      if constexpr (DK) {
        const u64 q = desc_now(sm.q(st), BLOCK_M * 128);
#pragma unroll
        for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
          Wgmma<T, HD>::rs(acc_k, dsa[kk], mn_step(q, kk), it > 0 || kk > 0);
        }
      }
      wgmma_commit();
      // dS^T into buffer step % 2: the consumers' barrier of the last step came after every
      // warpgroup's dQ GEMM of the step before (which read this buffer) had landed. dQ's
      // first GEMM goes out before dV and dK have landed (they are waited for under it).
      if constexpr (DQ) {
        store_ds(dsa, step & 1);
        fence_proxy_async();   // dS^T, read next by wgmma
        named_barrier_sync(DS_BARRIER, Tr::CONSUMER_THREADS);   // the whole dS^T tile
        add_dq(h, m0, step & 1, [&] { dkv_landed<WHAT, 1>(acc_v, acc_k, st); });
      } else {
        dkv_landed<WHAT, 0>(acc_v, acc_k, st);
      }
    }
    this->step = step;
    if (n_iter == 0) {   // (else the first step's GEMMs zeroed them: scale-d 0)
#pragma unroll
      for (int nt = 0; nt < Tr::D_N_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (DV) acc_v[nt][e] = 0.f;
          if (DK) acc_k[nt][e] = 0.f;
        }
      }
    }
    if constexpr (DK) {   // the tile's last pass: every GEMM on its K and V has landed
      mbar_arrive(sm.kv_empty());
      ++tile;
    }
  }

  // Once the GEMMs but the last PENDING groups have landed, dV and dK among them: stage st's
  // Q, dO, lse2 and D are read (its empty barrier), and the registers of P^T and dS^T free.
  template <int WHAT, int PENDING>
  __device__ __forceinline__ void dkv_landed(float (&acc_v)[Tr::D_N_TILES][4],
                                             float (&acc_k)[Tr::D_N_TILES][4], int st) const {
    wgmma_wait<PENDING>();
    if constexpr (WHAT & kBwdDv) fence_regs(acc_v);
    if constexpr (WHAT & kBwdDk) fence_regs(acc_k);
    mbar_arrive(sm.empty(st));
  }

  // This warp's dS^T rows into [key][query] tile buf (64-query column blocks, 128-byte
  // swizzle): a[kk][r] holds (key g + 8 (r % 2), queries 16 kk + 8 (r / 2) + 2 t4, + 1).
  __device__ __forceinline__ void store_ds(const u32 (&a)[Tr::C_K_STEPS][4], int buf) const {
#pragma unroll
    for (int kk = 0; kk < Tr::C_K_STEPS; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = wg * 64 + w4 * 16 + g + 8 * (r % 2);
        const u32 addr = sm.ds(buf) + sw128_offset<BLOCK_N>(row, 2 * kk + r / 2) + t4 * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(a[kk][r]) : "memory");
      }
    }
  }

  // dQ of this warpgroup's row tile and column group, dS K over the key tile (dS^T tile
  // buf), added into the workspace rows of head h (query tile m0): through the dQ tile and
  // the producer's DQ_WARP (DQ_SMEM), or by this thread's red.global.add;
  // first_issued() runs once the first part's GEMM is committed (the caller's wait for the
  // GEMMs before it).
  template <typename FirstIssued>
  __device__ __forceinline__ void add_dq(int h, int m0, int buf, FirstIssued&& first_issued) {
    const int rt = wg % Tr::DQ_ROW_TILES, grp = wg / Tr::DQ_ROW_TILES;
    const int r0 = m0 + rt * 64 + w4 * 16;   // this warp's first row
#pragma unroll
    for (int part = 0; part < Tr::DQ_PARTS; ++part) {
      const int c0 = grp * Tr::DQ_DIMS + part * Tr::DQ_N;
      float acc[Tr::DQ_N / 8][4];
      wgmma_fence();
      const u64 ds = desc_now(sm.ds(buf) + rt * (BLOCK_N * 128));
      const u64 k = desc_now(sm.k() + (c0 / 64) * (BLOCK_N * 128), BLOCK_N * 128);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        Wgmma<T, Tr::DQ_N>::template ss<1, 1>(acc, mn_step(ds, kk), mn_step(k, kk), kk > 0);
      }
      wgmma_commit();
      if (part == 0) first_issued();
      wgmma_wait<0>();
      fence_regs(acc);
      if constexpr (Tr::DQ_SMEM) {
        if (part == 0) mbar_wait(sm.dq_empty(), (dq_step & 1) ^ 1);   // the last tile is read
        store_dq(acc, r0 - m0, c0);
      } else {
        this->add_dq_rows(acc, h, r0, c0, g, t4);
      }
    }
    if constexpr (Tr::DQ_SMEM) {
      fence_proxy_async();   // the dQ tile, read next by the bulk copies (the async proxy)
      mbar_arrive(sm.dq_full());
      ++dq_step;
    }
  }

  // This warp's dQ accumulators (rows r0 + g, + 8 of the tile, columns c0 + 8 nt + 2 t4, + 1)
  // into the dQ tile.
  template <int N_TILES>
  __device__ __forceinline__ void store_dq(const float (&acc)[N_TILES][4], int r0, int c0) const {
    const u32 row = sm.dq() + (r0 + g) * Tr::DQ_ROW_BYTES + (c0 + 2 * t4) * 4;
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                     :: "r"(row + hr * 8 * Tr::DQ_ROW_BYTES + nt * 32),
                        "f"(acc[nt][2 * hr]), "f"(acc[nt][2 * hr + 1]) : "memory");
      }
    }
  }
};

// Grid: (ceil(max_seqlen_k / BLOCK_N), num_heads_kv, batch), or deterministically (dq_slices,
// num_heads_kv, batch); block: (THREADS), dynamic shared memory: Tr::SMEM_BYTES. What
// flash_bwd_kernel computes, in the same order (BwdBlockIndex's key tiles of one KV head and
// batch entry), with its GEMMs on wgmma: warpgroup 0 loads (bwd_sm90_produce), each consumer
// warpgroup's 64 keys of dK (times the softmax scale) and dV are written once per tile.
template <typename Tr>
__device__ void flash_bwd_sm90_kernel(const FlashBwdParams& p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const BwdSm90Smem<Tr> sm{(smem_addr(smem) + 1023u) & ~1023u};
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < Tr::STAGES; ++st) {
      mbar_init(sm.full(st), Tr::LOAD_THREADS);
      mbar_init(sm.empty(st), Tr::CONSUMER_THREADS);
    }
    mbar_init(sm.kv_full(), Tr::LOAD_THREADS);
    mbar_init(sm.kv_empty(), Tr::CONSUMER_THREADS);
    mbar_init(sm.dq_full(), Tr::CONSUMER_THREADS);
    mbar_init(sm.dq_empty(), 1);
    fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x < Tr::PRODUCER_THREADS) {
    if constexpr (Tr::SET_REGS) setmaxnreg_dec<Tr::PRODUCER_REGS>();
    const int warp = threadIdx.x / 32;
    if (threadIdx.x < Tr::LOAD_THREADS) {
      bwd_sm90_produce<Tr>(p, sm);
    } else if (Tr::DQ_SMEM && warp == Tr::DQ_WARP) {
      bwd_sm90_add_dq<Tr>(p, sm, threadIdx.x % 32);
    }
    return;
  }
  if constexpr (Tr::SET_REGS) setmaxnreg_inc<Tr::CONSUMER_REGS>();
  BwdSm90Block<Tr> blk(p, smem, sm);
  bwd_key_tiles<Tr>(p, blk);
}

}  // namespace cuattn
