// Paged-attention decode: one query token per sequence over vLLM's paged KV cache (x-major K,
// dim-major V, a block table per sequence). v1 (whole sequence per thread block) and v2
// (partitions + a reduce) follow vLLM's paged_attention kernels; unlike them, one thread block
// serves every query head of a KV-head group, so each K/V byte is read from memory once.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"

namespace cuattn {

// Mirrored by cuattn.paged.PARAMS (a static_assert in every entry point checks the layout).
// Strides are in elements. X = 16 / sizeof(CACHE_T).
struct PagedParams {
  const void* out;           // [num_seqs, num_heads, HEAD_SIZE]                 T, written (v1)
  const void* lse;           // [num_heads, num_seqs]                            float, written (v1, may be null)
  const void* tmp_out;       // [num_seqs, num_heads, max_parts, HEAD_SIZE]      float, written (v2)
  const void* tmp_lse;       // [num_seqs, num_heads, max_parts]                 float, written (v2)
  const void* q;             // [num_seqs, num_heads, HEAD_SIZE]                 T
  const void* k_cache;       // [num_blocks, num_kv_heads, HEAD_SIZE / X, BLOCK_SIZE, X]  CACHE_T
  const void* v_cache;       // [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE]         CACHE_T
  const void* block_tables;  // [num_seqs, max_blocks_per_seq]                   int32
  const void* seq_lens;      // [num_seqs]                                       int32
  const void* alibi_slopes;  // [num_heads]                                      float (ALIBI only)
  long long q_stride_seq, q_stride_head;
  long long out_stride_seq, out_stride_head;
  long long lse_stride_head, lse_stride_seq;
  long long k_stride_block, k_stride_head, k_stride_x, k_stride_token;
  long long v_stride_block, v_stride_head, v_stride_dim;
  long long bt_stride_seq;
  float scale_log2;          // softmax_scale * k_scale * log2(e), folded into q
  float v_scale;             // multiplies the output (1 for 16-bit caches)
  int num_seqs;
  int num_heads;
  int gqa_ratio;             // num_heads / num_kv_heads
  int max_blocks_per_seq;    // block_tables.shape[1]: sequences are clamped to its capacity
  int max_parts;             // v2: partitions per sequence in tmp_out / tmp_lse
  int logits_stride;         // floats per head in the dynamic shared logits buffer
};

// Raw 16- or 8-byte vector (8-byte only for fp8 V rows of block size 8).
template <int BYTES> struct RawVec;
template <> struct __align__(16) RawVec<16> { uint4 raw; };
template <> struct __align__(8) RawVec<8> { uint2 raw; };

template <int BYTES>
__device__ __forceinline__ RawVec<BYTES> load_stream(const void* p);
template <> __device__ __forceinline__ RawVec<16> load_stream<16>(const void* p) {
  RawVec<16> v;
  v.raw = __ldcs(reinterpret_cast<const uint4*>(p));
  return v;
}
template <> __device__ __forceinline__ RawVec<8> load_stream<8>(const void* p) {
  RawVec<8> v;
  v.raw = __ldcs(reinterpret_cast<const uint2*>(p));
  return v;
}

template <typename CT, int N, int BYTES>
__device__ __forceinline__ void unpack_raw(const RawVec<BYTES>& v, float (&out)[N]) {
  static_assert(N * sizeof(CT) == BYTES, "vector size mismatch");
  const CT* elems = reinterpret_cast<const CT*>(&v);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(elems[i]);
}

// Every size the kernel derives from its template parameters, in one place.
template <typename CACHE_T, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
struct PagedTraits {
  static constexpr int NUM_WARPS = NUM_THREADS / 32;
  // K: a warp reads one cache block per step; lane = gsub * BLOCK_SIZE + token, so the 32
  // lanes read 32 consecutive x-vectors (512 contiguous bytes) and TGS lanes share a token.
  static constexpr int X = 16 / sizeof(CACHE_T);
  static constexpr int NG = HEAD_SIZE / X;                  // x-vectors per token
  static constexpr int TGS = 32 / BLOCK_SIZE;               // lanes per token
  static constexpr int NGT = (NG + TGS - 1) / TGS;          // x-vectors per lane per block
  // Blocks per warp per step: ~8 loads in flight per lane, at most 16 unpacked K floats.
  static constexpr int KU_RAW = 8 / NGT;
  static constexpr int KU_MAX = 16 / X;
  static constexpr int KU = KU_RAW < 1 ? 1 : (KU_RAW > KU_MAX ? KU_MAX : KU_RAW);
  // V: the whole thread block reads consecutive vectors of VL tokens of one dim; VSLOTS
  // groups of V_VECS threads each take a cache block, each thread UV blocks per step.
  static constexpr int VL = X < BLOCK_SIZE ? X : BLOCK_SIZE;   // tokens per V load
  static constexpr int V_BYTES = VL * sizeof(CACHE_T);         // 16, or 8 (fp8, block 8)
  static constexpr int VPR = BLOCK_SIZE / VL;                  // loads per dim row
  static constexpr int V_VECS = HEAD_SIZE * VPR;               // loads per cache block
  static constexpr int VSLOTS = NUM_THREADS >= V_VECS ? NUM_THREADS / V_VECS : 1;
  static constexpr int VPT = NUM_THREADS >= V_VECS ? 1 : (V_VECS + NUM_THREADS - 1) / NUM_THREADS;
  // fp8 -> float is a hardware conversion from sm_89 on; before it, the software conversion
  // needs registers, so fp8 V loads go 4 blocks deep instead of 8 there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  static constexpr int UV_DEPTH = sizeof(CACHE_T) == 1 ? 4 : 8;
#else
  static constexpr int UV_DEPTH = 8;
#endif
  static constexpr int UV_RAW = UV_DEPTH / VPT;
  static constexpr int UV = UV_RAW < 1 ? 1 : UV_RAW;
  static_assert(HEAD_SIZE % X == 0, "head size must be a multiple of the 16-byte x-vector");
  static_assert(BLOCK_SIZE <= 32 && 32 % BLOCK_SIZE == 0, "block size 8, 16 or 32");
  static_assert(NUM_THREADS % 32 == 0, "whole warps");
};

template <int N>
__device__ __forceinline__ void load_floats(const float* src, float (&dst)[N]) {
  static_assert(N % 4 == 0, "float4 loads");
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    const float4 v = reinterpret_cast<const float4*>(src)[i];
    dst[4 * i] = v.x; dst[4 * i + 1] = v.y; dst[4 * i + 2] = v.z; dst[4 * i + 3] = v.w;
  }
}

// Grid: (num_heads / GROUP, num_seqs, 1 (v1) or max_parts (v2)), block: (NUM_THREADS),
// dynamic shared memory: GROUP * logits_stride floats.
// One thread block computes query heads [blockIdx.x * GROUP, +GROUP), all of one KV head, over
// the whole sequence (PARTITION_SIZE == 0, v1) or over tokens [z * PARTITION_SIZE, +PARTITION_SIZE)
// (v2, writing a normalised partial output and its lse for the reduce kernel).
//
// PIPELINE (a tuning knob, cuattn.tuning.PAGED_PIPELINE): keep HBM busy across the phases of a
// block. false: each warp step loads its K vectors, waits, computes (loads in flight only while
// a step waits), and the V loads start after the softmax barriers. true: register rotation --
// as soon as a K (V) vector of the current step has been unpacked to floats, the same register
// is refilled with the matching vector of the warp's next step, so about NGT (UV) loads per lane
// are in flight during the math; block-table entries are read two steps ahead; the first V
// batch is issued before the softmax reductions, overlapping them. Same registers for the
// raw vectors, a few more for addresses.
template <typename T, typename CACHE_T, int HEAD_SIZE, int BLOCK_SIZE, int GROUP,
          int PARTITION_SIZE, bool ALIBI, int NUM_THREADS, int PIPELINE>
__device__ void paged_attention_kernel(const PagedParams& p) {
  using Tr = PagedTraits<CACHE_T, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS>;
  constexpr bool V2 = PARTITION_SIZE > 0;
  constexpr int X = Tr::X, NG = Tr::NG, TGS = Tr::TGS, NGT = Tr::NGT, KU = Tr::KU;
  constexpr int NUM_WARPS = Tr::NUM_WARPS;
  constexpr int VL = Tr::VL, VPR = Tr::VPR, V_VECS = Tr::V_VECS, VSLOTS = Tr::VSLOTS;
  constexpr int VPT = Tr::VPT, UV = Tr::UV;
  static_assert(!V2 || PARTITION_SIZE % BLOCK_SIZE == 0, "partition of whole blocks");

  __shared__ __align__(16) float q_s[GROUP * HEAD_SIZE];   // scaled query, log2 domain
  __shared__ float red_s[NUM_WARPS * GROUP];
  __shared__ float inv_sum_s[GROUP];   // v_scale / sum
  __shared__ float sum_s[GROUP];
  __shared__ float max_s[GROUP];       // row max (log2 domain), for the lse
  __shared__ float slope_s[GROUP];     // ALiBi slopes x log2(e)
  extern __shared__ __align__(16) float logits[];           // [GROUP][logits_stride]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int seq = blockIdx.y;
  const int part = V2 ? blockIdx.z : 0;
  const int head0 = blockIdx.x * GROUP;
  const int kv_head = head0 / p.gqa_ratio;
  const int LS = p.logits_stride;

  int seq_len = static_cast<const int*>(p.seq_lens)[seq];
  seq_len = min(max(seq_len, 0), p.max_blocks_per_seq * BLOCK_SIZE);
  const int start_tok = part * PARTITION_SIZE;
  if (V2 && start_tok >= seq_len) return;     // the reduce kernel never reads this partition
  if (!V2 && seq_len == 0) {                  // empty sequence: zeros, lse = -inf
    for (int i = tid; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {
      T* o = static_cast<T*>(const_cast<void*>(p.out)) + seq * p.out_stride_seq +
             (head0 + i / HEAD_SIZE) * p.out_stride_head + i % HEAD_SIZE;
      *o = from_float<T>(0.f);
    }
    if (p.lse != nullptr && tid < GROUP)
      static_cast<float*>(const_cast<void*>(p.lse))[(head0 + tid) * p.lse_stride_head +
                                                   seq * p.lse_stride_seq] = neg_inf();
    return;
  }
  const int end_tok = V2 ? min(seq_len, start_tok + PARTITION_SIZE) : seq_len;
  const int start_blk = start_tok / BLOCK_SIZE;
  const int num_blks = (end_tok + BLOCK_SIZE - 1) / BLOCK_SIZE - start_blk;
  const int* block_table = static_cast<const int*>(p.block_tables) + seq * p.bt_stride_seq + start_blk;

  // ---- query -> shared memory (float, pre-scaled by softmax_scale * k_scale * log2 e) ------
  const T* q = static_cast<const T*>(p.q) + seq * p.q_stride_seq;
  for (int i = tid; i < GROUP * HEAD_SIZE; i += NUM_THREADS)
    q_s[i] = to_float(q[(head0 + i / HEAD_SIZE) * p.q_stride_head + i % HEAD_SIZE]) * p.scale_log2;
  if (ALIBI && tid < GROUP) slope_s[tid] = static_cast<const float*>(p.alibi_slopes)[head0 + tid] * kLog2e;
  __syncthreads();

  // ---- logits = q . k for every token of the range, every head of the group -----------------
  const CACHE_T* k_head = static_cast<const CACHE_T*>(p.k_cache) + kv_head * p.k_stride_head;
  const int k_tok = lane % BLOCK_SIZE;
  const int gsub = lane / BLOCK_SIZE;
  float qk_max[GROUP];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) qk_max[h] = neg_inf();

  constexpr bool K_PIPE = (PIPELINE & 1) != 0, V_PIPE = (PIPELINE & 2) != 0;
  constexpr int KSTEP = NUM_WARPS * KU;    // blocks per step of the whole thread block
  const long long k_tok_off = (long long)k_tok * p.k_stride_token;
  auto k_load = [&](const CACHE_T* src, int i) -> RawVec<16> {
    const int g = gsub + TGS * i;
    RawVec<16> r;
    if (NG % TGS == 0 || g < NG) r = load_stream<16>(src + g * p.k_stride_x);
    else r.raw = make_uint4(0, 0, 0, 0);
    return r;
  };
  RawVec<16> kv[KU][NGT];
  int phys_n[KU];   // PIPELINE: physical blocks of the warp's next step
  if (K_PIPE) {
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int b = warp * KU + u;
      const CACHE_T* src = k_head + (long long)(b < num_blks ? __ldg(block_table + b) : 0) * p.k_stride_block + k_tok_off;
#pragma unroll
      for (int i = 0; i < NGT; ++i) {
        if (b < num_blks) kv[u][i] = k_load(src, i);
        else kv[u][i].raw = make_uint4(0, 0, 0, 0);
      }
      const int bn = b + KSTEP;
      phys_n[u] = bn < num_blks ? __ldg(block_table + bn) : 0;
    }
  }

  for (int b0 = warp * KU; b0 < num_blks; b0 += KSTEP) {
    const CACHE_T* src_n[KU];   // PIPELINE: the next step's K rows
    bool valid_n[KU];
    if (K_PIPE) {
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        valid_n[u] = b0 + KSTEP + u < num_blks;
        src_n[u] = k_head + (long long)phys_n[u] * p.k_stride_block + k_tok_off;
        const int bnn = b0 + 2 * KSTEP + u;             // two steps ahead
        phys_n[u] = bnn < num_blks ? __ldg(block_table + bnn) : 0;
      }
    } else {
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const bool valid = b0 + u < num_blks;
        const long long phys = valid ? __ldg(block_table + b0 + u) : 0;
        const CACHE_T* src = k_head + phys * p.k_stride_block + k_tok_off;
#pragma unroll
        for (int i = 0; i < NGT; ++i) {
          if (valid) kv[u][i] = k_load(src, i);
          else kv[u][i].raw = make_uint4(0, 0, 0, 0);
        }
      }
    }
    float acc[KU][GROUP];
#pragma unroll
    for (int u = 0; u < KU; ++u)
#pragma unroll
      for (int h = 0; h < GROUP; ++h) acc[u][h] = 0.f;
#pragma unroll
    for (int i = 0; i < NGT; ++i) {
      const int g = gsub + TGS * i;
      if (NG % TGS != 0 && g >= NG) continue;
      float kf[KU][X];
#pragma unroll
      for (int u = 0; u < KU; ++u) unpack_raw<CACHE_T, X>(kv[u][i], kf[u]);
      if (K_PIPE) {   // kv[u][i] is free: refill it with the next step's vector
#pragma unroll
        for (int u = 0; u < KU; ++u) {
          if (valid_n[u]) kv[u][i] = k_load(src_n[u], i);
          else kv[u][i].raw = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int h = 0; h < GROUP; ++h) {
        float qf[X];
        load_floats<X>(q_s + h * HEAD_SIZE + g * X, qf);
#pragma unroll
        for (int u = 0; u < KU; ++u)
#pragma unroll
          for (int e = 0; e < X; ++e) acc[u][h] = fmaf(qf[e], kf[u][e], acc[u][h]);
      }
    }
    // Sum the TGS lanes of each token (lanes BLOCK_SIZE apart).
#pragma unroll
    for (int u = 0; u < KU; ++u)
#pragma unroll
      for (int h = 0; h < GROUP; ++h)
#pragma unroll
        for (int off = BLOCK_SIZE; off < 32; off *= 2)
          acc[u][h] += __shfl_xor_sync(0xffffffffu, acc[u][h], off);
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int b = b0 + u;
      if (b < num_blks && gsub == 0) {
        const int t = (start_blk + b) * BLOCK_SIZE + k_tok;   // token index in the sequence
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
          float l = acc[u][h];
          if (ALIBI) l += slope_s[h] * float(t - seq_len + 1);
          l = t < end_tok ? l : neg_inf();                      // a select: NaN K stays out
          logits[h * LS + b * BLOCK_SIZE + k_tok] = l;
          qk_max[h] = fmaxf(qk_max[h], l);
        }
      }
    }
  }

  // ---- V setup; PIPELINE: issue the first V batch now, so it loads during the softmax -------
  const CACHE_T* v_head = static_cast<const CACHE_T*>(p.v_cache) + kv_head * p.v_stride_head;
  const int slot = VSLOTS > 1 ? tid / V_VECS : 0;
  const int vt = VSLOTS > 1 ? tid % V_VECS : tid;
  const bool v_active = VPT > 1 || tid < VSLOTS * V_VECS;
  constexpr int VSTEP = VSLOTS * UV;   // blocks per step of the whole thread block
  auto v_load = [&](const CACHE_T* src, int j) -> RawVec<Tr::V_BYTES> {
    const int vec = vt + NUM_THREADS * j;
    if (V_VECS % NUM_THREADS == 0 || vec < V_VECS)
      return load_stream<Tr::V_BYTES>(src + (vec / VPR) * p.v_stride_dim + (vec % VPR) * VL);
    return RawVec<Tr::V_BYTES>{};
  };
  RawVec<Tr::V_BYTES> vv[UV][VPT];
  if (V_PIPE) {
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int b = slot * UV + u;
      const bool valid = v_active && b < num_blks;
      const CACHE_T* src = v_head + (long long)(valid ? __ldg(block_table + b) : 0) * p.v_stride_block;
#pragma unroll
      for (int j = 0; j < VPT; ++j) vv[u][j] = valid ? v_load(src, j) : RawVec<Tr::V_BYTES>{};
    }
  }

  // ---- softmax over the range: max, exp2, sum (two block-wide reductions) -------------------
#pragma unroll
  for (int h = 0; h < GROUP; ++h) {
    float m = qk_max[h];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) red_s[warp * GROUP + h] = m;
  }
  __syncthreads();
  float row_max[GROUP];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) {
    row_max[h] = red_s[h];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) row_max[h] = fmaxf(row_max[h], red_s[w * GROUP + h]);
  }
  if (tid < GROUP) {
    float m = row_max[0];
#pragma unroll
    for (int h = 1; h < GROUP; ++h) m = tid == h ? row_max[h] : m;
    max_s[tid] = m;
  }
  __syncthreads();   // red_s is reused below
  const int num_logits = num_blks * BLOCK_SIZE;
  float row_sum[GROUP];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) {
    row_sum[h] = 0.f;
    for (int i = tid; i < num_logits; i += NUM_THREADS) {
      const float e = exp2f(logits[h * LS + i] - row_max[h]);
      logits[h * LS + i] = e;
      row_sum[h] += e;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], off);
    if (lane == 0) red_s[warp * GROUP + h] = row_sum[h];
  }
  __syncthreads();
  if (tid < GROUP) {   // the range is never empty here, so the sum is >= 1
    float s = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) s += red_s[w * GROUP + tid];
    sum_s[tid] = s;
    inv_sum_s[tid] = p.v_scale / s;
  }

  // ---- out = P . V -------------------------------------------------------------------------
  float vacc[VPT][GROUP];
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int h = 0; h < GROUP; ++h) vacc[j][h] = 0.f;

  for (int b0 = slot * UV; b0 < num_blks; b0 += VSTEP) {
    int vphys_n[UV];   // PIPELINE: physical blocks of the next batch (-1: none)
    if (V_PIPE) {
#pragma unroll
      for (int u = 0; u < UV; ++u) {
        const int bn = b0 + VSTEP + u;
        vphys_n[u] = v_active && bn < num_blks ? __ldg(block_table + bn) : -1;
      }
    } else {
#pragma unroll
      for (int u = 0; u < UV; ++u) {
        const bool valid = v_active && b0 + u < num_blks;
        const CACHE_T* src = v_head + (long long)(valid ? __ldg(block_table + b0 + u) : 0) * p.v_stride_block;
#pragma unroll
        for (int j = 0; j < VPT; ++j) vv[u][j] = valid ? v_load(src, j) : RawVec<Tr::V_BYTES>{};
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int b = b0 + u;
      const bool live = v_active && b < num_blks;
      const int blk_tok0 = (start_blk + b) * BLOCK_SIZE;
      const bool tail = blk_tok0 + BLOCK_SIZE > end_tok;   // only the last block of a sequence
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int vec = vt + NUM_THREADS * j;
        if (V_VECS % NUM_THREADS != 0 && vec >= V_VECS) continue;
        const int c = vec % VPR;
        float vf[VL];
        unpack_raw<CACHE_T, VL>(vv[u][j], vf);
        if (V_PIPE)   // vv[u][j] is free: refill it with the next batch's vector
          vv[u][j] = vphys_n[u] >= 0 ? v_load(v_head + (long long)vphys_n[u] * p.v_stride_block, j)
                                     : RawVec<Tr::V_BYTES>{};
        if (!live) continue;
        if (tail) {
#pragma unroll
          for (int e = 0; e < VL; ++e) vf[e] = blk_tok0 + c * VL + e < end_tok ? vf[e] : 0.f;
        }
#pragma unroll
        for (int h = 0; h < GROUP; ++h) {
          float pf[VL];
          load_floats<VL>(logits + h * LS + b * BLOCK_SIZE + c * VL, pf);
#pragma unroll
          for (int e = 0; e < VL; ++e) vacc[j][h] = fmaf(pf[e], vf[e], vacc[j][h]);
        }
      }
    }
  }
  // The VPR lanes of one dim are adjacent: sum them.
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int h = 0; h < GROUP; ++h)
#pragma unroll
      for (int off = 1; off < VPR; off *= 2)
        vacc[j][h] += __shfl_xor_sync(0xffffffffu, vacc[j][h], off);

  // ---- write: v1 the output and lse, v2 the normalised partial output and its lse ---------
  const long long row0 = (long long)seq * p.num_heads + head0;   // v2 rows of tmp_*
  auto store = [&](int h, int d, float value) {
    value *= inv_sum_s[h];
    if (V2) {
      static_cast<float*>(const_cast<void*>(p.tmp_out))[((row0 + h) * p.max_parts + part) * HEAD_SIZE + d] = value;
    } else {
      static_cast<T*>(const_cast<void*>(p.out))[seq * p.out_stride_seq + (head0 + h) * p.out_stride_head + d] =
          from_float<T>(value);
    }
  };
  __syncthreads();   // logits are dead (reused by the slot sum), inv_sum_s is visible
  if (VSLOTS > 1) {
    float* slot_sum = logits;   // [VSLOTS][GROUP][HEAD_SIZE], fits: logits_stride >= NUM_THREADS
    if (v_active && vt % VPR == 0) {
#pragma unroll
      for (int h = 0; h < GROUP; ++h) slot_sum[(slot * GROUP + h) * HEAD_SIZE + vt / VPR] = vacc[0][h];
    }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_SIZE; i += NUM_THREADS) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < VSLOTS; ++k) s += slot_sum[k * GROUP * HEAD_SIZE + i];
      store(i / HEAD_SIZE, i % HEAD_SIZE, s);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int vec = vt + NUM_THREADS * j;
      if (vec % VPR != 0 || (V_VECS % NUM_THREADS != 0 && vec >= V_VECS)) continue;
#pragma unroll
      for (int h = 0; h < GROUP; ++h) store(h, vec / VPR, vacc[j][h]);
    }
  }
  if (tid < GROUP) {
    const float lse = (max_s[tid] + __log2f(sum_s[tid])) * kLn2;   // natural log
    if (V2) {
      static_cast<float*>(const_cast<void*>(p.tmp_lse))[(row0 + tid) * p.max_parts + part] = lse;
    } else if (p.lse != nullptr) {
      static_cast<float*>(const_cast<void*>(p.lse))[(head0 + tid) * p.lse_stride_head +
                                                   seq * p.lse_stride_seq] = lse;
    }
  }
}

// Mirrored by cuattn.paged.REDUCE_PARAMS. Strides are in elements.
struct PagedReduceParams {
  const void* out;        // [num_seqs, num_heads, HEAD_SIZE]                 T, written
  const void* lse;        // [num_heads, num_seqs]                            float, written (may be null)
  const void* tmp_out;    // [num_seqs, num_heads, max_parts, HEAD_SIZE]      float
  const void* tmp_lse;    // [num_seqs, num_heads, max_parts]                 float, natural log
  const void* seq_lens;   // [num_seqs]                                       int32
  long long out_stride_seq, out_stride_head;
  long long lse_stride_head, lse_stride_seq;
  int num_heads;
  int max_parts;
  int partition_size;
  int max_seq_len;        // max_blocks_per_seq * block_size (the clamp of the main kernel)
};

// Grid: (num_heads, num_seqs), block: (NUM_THREADS) = DIM_THREADS (4 dims each) x GROUPS.
// Merges the partitions of one (sequence, head): out = sum e^(lse_i - m) o_i / sum e^(lse_i - m),
// lse = m + log(sum e^(lse_i - m)); one partition comes through unchanged (weight e^0 = 1),
// none (an empty sequence) gives zeros and lse = -inf.
// Latency, not bandwidth, is what this kernel costs (a few KB per row, still in L2 after the
// main kernel), so it is written to have few dependent round trips to memory: each of the
// GROUPS thread groups takes every GROUPS-th partition and folds them in CHUNKs whose lse
// and output loads are all issued together, keeping its own running max (an online softmax
// over partitions); the groups then merge once through shared memory. At batch 1 x 32768
// (32 partitions, 4 groups) that is seq_len -> one chunk of loads -> one barrier -> store.
template <typename T, int HEAD_SIZE, int NUM_THREADS>
__device__ void paged_attention_reduce_kernel(const PagedReduceParams& p) {
  static_assert(HEAD_SIZE % 4 == 0, "float4 rows");
  constexpr int DIM_THREADS = (HEAD_SIZE / 4 + 31) / 32 * 32;
  constexpr int GROUPS = NUM_THREADS / DIM_THREADS;
  static_assert(GROUPS >= 1 && NUM_THREADS % DIM_THREADS == 0, "whole thread groups");
  constexpr int CHUNK = 8;   // partitions per thread whose loads are in flight together
  __shared__ float4 acc_s[GROUPS][DIM_THREADS];
  __shared__ float max_s[GROUPS], sum_s[GROUPS];

  const int head = blockIdx.x, seq = blockIdx.y;
  const int tid = threadIdx.x, group = tid / DIM_THREADS, dt = tid % DIM_THREADS;
  const int d = dt * 4;
  const bool has_dims = d < HEAD_SIZE;
  int seq_len = static_cast<const int*>(p.seq_lens)[seq];
  seq_len = min(max(seq_len, 0), p.max_seq_len);
  const int num_parts = (seq_len + p.partition_size - 1) / p.partition_size;
  const long long row = (long long)seq * p.num_heads + head;
  const float* lse_row = static_cast<const float*>(p.tmp_lse) + row * p.max_parts;
  // Threads past the head's dims (HEAD_SIZE % 128 != 0) load a valid column and drop it.
  const float* out_row = static_cast<const float*>(p.tmp_out) + row * p.max_parts * HEAD_SIZE +
                         (has_dims ? d : HEAD_SIZE - 4);

  // ---- each group: running (max, sum, acc) over partitions group, group + GROUPS, ... ------
  float m = neg_inf(), sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int first = group; first < num_parts; first += GROUPS * CHUNK) {
    // Every load of the chunk before any use, unconditional so that the compiler issues them
    // together (predicated, it interleaved them with the math two at a time): slots past the
    // last partition re-read a valid one and get weight 0 through lse = -inf.
    float l[CHUNK];
    float4 o[CHUNK];
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const int i = min(first + c * GROUPS, num_parts - 1);
      l[c] = lse_row[i];
      o[c] = *reinterpret_cast<const float4*>(out_row + (long long)i * HEAD_SIZE);
    }
#pragma unroll
    for (int c = 0; c < CHUNK; ++c)
      if (first + c * GROUPS >= num_parts) l[c] = neg_inf();
    float new_m = m;
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) new_m = fmaxf(new_m, l[c]);
    const float base = new_m == neg_inf() ? 0.f : new_m;   // no -inf - -inf
    const float alpha = __expf(m - base);
    sum *= alpha;
    acc.x *= alpha; acc.y *= alpha; acc.z *= alpha; acc.w *= alpha;
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const float w = __expf(l[c] - base);
      sum += w;
      acc.x = fmaf(w, o[c].x, acc.x); acc.y = fmaf(w, o[c].y, acc.y);
      acc.z = fmaf(w, o[c].z, acc.z); acc.w = fmaf(w, o[c].w, acc.w);
    }
    m = new_m;
  }

  // ---- merge the groups (each group's threads hold the same max and sum) ------------------
  if (GROUPS > 1) {
    acc_s[group][dt] = acc;
    if (dt == 0) { max_s[group] = m; sum_s[group] = sum; }
    __syncthreads();
    if (group != 0) return;
    m = max_s[0];
#pragma unroll
    for (int k = 1; k < GROUPS; ++k) m = fmaxf(m, max_s[k]);
    const float base = m == neg_inf() ? 0.f : m;
    sum = 0.f;
    acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) {
      const float w = __expf(max_s[k] - base);
      const float4 a = acc_s[k][dt];
      sum = fmaf(w, sum_s[k], sum);
      acc.x = fmaf(w, a.x, acc.x); acc.y = fmaf(w, a.y, acc.y);
      acc.z = fmaf(w, a.z, acc.z); acc.w = fmaf(w, a.w, acc.w);
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  if (has_dims) {
    T* o = static_cast<T*>(const_cast<void*>(p.out)) + seq * p.out_stride_seq + head * p.out_stride_head + d;
    o[0] = from_float<T>(acc.x * inv); o[1] = from_float<T>(acc.y * inv);
    o[2] = from_float<T>(acc.z * inv); o[3] = from_float<T>(acc.w * inv);
  }
  if (tid == 0 && p.lse != nullptr)
    static_cast<float*>(const_cast<void*>(p.lse))[head * p.lse_stride_head + seq * p.lse_stride_seq] =
        sum > 0.f ? m + __logf(sum) : neg_inf();
}

}  // namespace cuattn
