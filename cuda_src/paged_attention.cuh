// Paged-attention decode on CUDA cores: one query token per sequence over vLLM's paged KV
// cache (x-major K, dim-major V, a block table per sequence). v1 (whole sequence per thread
// block) and v2 (partitions + paged_reduce.cuh) follow vLLM's paged_attention kernels; unlike
// them, one thread block serves every query head of a KV-head group, so each K/V byte is read
// from memory once. This form runs where the tensor-core one does not (fp8 caches, head
// sizes that are not multiples of 16); it keeps the logits of its range in shared memory and
// takes an exact two-pass softmax over them.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "common/logits.cuh"
#include "paged_common.cuh"

namespace cuattn {

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

// Every knob of the CUDA-core form (cuattn.keys.PagedSimtVariant) and every size derived
// from them.
// SOFTCAP, ALIBI: the logits hook; SINKS: each head's sink joins v1's denominator (v2: the
// reduce's).
template <typename T_, typename CACHE_T_, int HEAD_SIZE_, int BLOCK_SIZE_, int GROUP_,
          int PARTITION_SIZE_, bool ALIBI_, int NUM_THREADS_, bool SOFTCAP_, bool SINKS_>
struct PagedSimtTraits {
  using T = T_;
  using CACHE_T = CACHE_T_;
  using Logits = LogitsHook<SOFTCAP_, ALIBI_>;           // the logits hook
  static constexpr bool ALIBI = ALIBI_;
  static constexpr bool SINKS = SINKS_;
  static constexpr int HEAD_SIZE = HEAD_SIZE_;
  static constexpr int BLOCK_SIZE = BLOCK_SIZE_;
  static constexpr int GROUP = GROUP_;                   // query heads per thread block
  static constexpr int PARTITION_SIZE = PARTITION_SIZE_; // 0: v1
  static constexpr bool V2 = PARTITION_SIZE > 0;
  static constexpr int NUM_THREADS = NUM_THREADS_;
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
  static_assert(!V2 || PARTITION_SIZE % BLOCK_SIZE == 0, "partition of whole blocks");
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
// the whole sequence (v1) or over tokens [z * PARTITION_SIZE, +PARTITION_SIZE) (v2, writing a
// normalised partial output and its lse for the reduce kernel). Each warp step loads its K
// vectors, waits and computes; the V loads start after the softmax's barriers.
template <typename Tr>
__device__ void paged_attention_kernel(const PagedParams& p) {
  using T = typename Tr::T;
  using CACHE_T = typename Tr::CACHE_T;
  constexpr int HEAD_SIZE = Tr::HEAD_SIZE, BLOCK_SIZE = Tr::BLOCK_SIZE, GROUP = Tr::GROUP;
  constexpr int NUM_THREADS = Tr::NUM_THREADS, NUM_WARPS = Tr::NUM_WARPS;
  constexpr bool V2 = Tr::V2;
  constexpr int X = Tr::X, NG = Tr::NG, TGS = Tr::TGS, NGT = Tr::NGT, KU = Tr::KU;
  constexpr int VL = Tr::VL, VPR = Tr::VPR, V_VECS = Tr::V_VECS, VSLOTS = Tr::VSLOTS;
  constexpr int VPT = Tr::VPT, UV = Tr::UV;

  __shared__ __align__(16) float q_s[GROUP * HEAD_SIZE];   // scaled query, log2 domain
  __shared__ float red_s[NUM_WARPS * GROUP];
  __shared__ float inv_sum_s[GROUP];   // v_scale / sum
  __shared__ SoftmaxState state_s[GROUP];
  __shared__ float slope_s[GROUP];     // ALiBi slopes x log2(e)
  __shared__ float sink_s[GROUP];      // sinks x log2(e)
  extern __shared__ __align__(16) float logits[];           // [GROUP][logits_stride]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int seq = blockIdx.y;
  const int part = V2 ? blockIdx.z : 0;
  const int head0 = blockIdx.x * GROUP;
  const int kv_head = head0 / p.gqa_ratio;
  const int LS = p.logits_stride;
  const PagedOutput<T, HEAD_SIZE, V2> output{p, seq, head0, part};

  const PagedRange range = paged_range<BLOCK_SIZE, Tr::PARTITION_SIZE>(p, seq, part);
  if (V2 && range.start >= range.seq_len) return;   // the reduce never reads this partition
  // The window's first key: blocks start at the one that holds it, the select below masks
  // the keys before it.
  const int win_start = max(0, range.seq_len - 1 - p.window_left);
  const int start_tok = max(range.start, win_start);
  const int end_tok = range.end;
  if (start_tok >= end_tok) {   // an empty sequence (v1), or a partition before the window
    for (int i = tid; i < GROUP * HEAD_SIZE; i += NUM_THREADS) output.store(i / HEAD_SIZE, i % HEAD_SIZE, 0.f);
    if (tid < GROUP) {   // v1 with a sink: lse = the sink
      output.store_lse(tid, Tr::SINKS && !V2 ? static_cast<const float*>(p.sinks)[head0 + tid]
                                             : neg_inf());
    }
    return;
  }
  const int start_blk = start_tok / BLOCK_SIZE;
  const int num_blks = (end_tok + BLOCK_SIZE - 1) / BLOCK_SIZE - start_blk;
  const int* block_table = static_cast<const int*>(p.block_tables) + seq * p.bt_stride_seq + start_blk;

  // ---- query -> shared memory (float, pre-scaled by softmax_scale * k_scale * log2 e) ------
  const T* q = static_cast<const T*>(p.q) + seq * p.q_stride_seq;
  const float q_scale = p.scale_log2 * kv_head_scale(p.k_scales, p.k_scales_stride, kv_head);
  for (int i = tid; i < GROUP * HEAD_SIZE; i += NUM_THREADS)
    q_s[i] = to_float(q[(head0 + i / HEAD_SIZE) * p.q_stride_head + i % HEAD_SIZE]) * q_scale;
  if (Tr::ALIBI && tid < GROUP) {
    slope_s[tid] =
        static_cast<const float*>(p.alibi_slopes)[seq * p.alibi_stride_seq + head0 + tid] * kLog2e;
  }
  if (Tr::SINKS && !V2 && tid < GROUP) {
    sink_s[tid] = static_cast<const float*>(p.sinks)[head0 + tid] * kLog2e;
  }
  __syncthreads();

  // ---- logits = q . k for every token of the range, every head of the group -----------------
  const CACHE_T* k_head = static_cast<const CACHE_T*>(p.k_cache) + kv_head * p.k_stride_head;
  const int k_tok = lane % BLOCK_SIZE;
  const int gsub = lane / BLOCK_SIZE;
  float qk_max[GROUP];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) qk_max[h] = neg_inf();

  constexpr int KSTEP = NUM_WARPS * KU;    // blocks per step of the whole thread block
  const long long k_tok_off = (long long)k_tok * p.k_stride_token;
  for (int b0 = warp * KU; b0 < num_blks; b0 += KSTEP) {
    RawVec<16> kv[KU][NGT];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const bool valid = b0 + u < num_blks;
      const long long phys = valid ? __ldg(block_table + b0 + u) : 0;
      const CACHE_T* src = k_head + phys * p.k_stride_block + k_tok_off;
#pragma unroll
      for (int i = 0; i < NGT; ++i) {
        const int g = gsub + TGS * i;
        if (valid && (NG % TGS == 0 || g < NG)) kv[u][i] = load_stream<16>(src + g * p.k_stride_x);
        else kv[u][i].raw = make_uint4(0, 0, 0, 0);
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
          if (Tr::Logits::ACTIVE) {
            l = typename Tr::Logits(Tr::ALIBI ? slope_s[h] : 0.f, p.softcap_in,
                                    p.softcap_out)(l, range.seq_len - 1, t);
          }
          // a select: NaN K, and keys before the window, stay out
          l = t < end_tok && t >= win_start ? l : neg_inf();
          logits[h * LS + b * BLOCK_SIZE + k_tok] = l;
          qk_max[h] = fmaxf(qk_max[h], l);
        }
      }
    }
  }

  // ---- softmax over the range (log2 units): max, exp2, sum (two block-wide reductions) ------
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
  __syncthreads();   // red_s is reused below
  const int num_logits = num_blks * BLOCK_SIZE;
  float row_sum[GROUP];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) {
    // The range holds a visible token, so the max is finite: no -inf guard.
    const float b = SoftmaxState::base<false>(row_max[h], 1.f);
    row_sum[h] = 0.f;
    for (int i = tid; i < num_logits; i += NUM_THREADS) {
      const float e = SoftmaxState::weight(logits[h * LS + i], 1.f, b);
      logits[h * LS + i] = e;
      row_sum[h] += e;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], off);
    if (lane == 0) red_s[warp * GROUP + h] = row_sum[h];
  }
  __syncthreads();
  if (tid < GROUP) {   // the range is never empty here, so the sum is >= 1
    SoftmaxState st{row_max[0], 0.f};
#pragma unroll
    for (int h = 1; h < GROUP; ++h) st.max = tid == h ? row_max[h] : st.max;
    for (int w = 0; w < NUM_WARPS; ++w) st.sum += red_s[w * GROUP + tid];
    // (v2: the sinks join in the reduce)
    const float alpha = Tr::SINKS && !V2 ? st.add_sink<false>(sink_s[tid], 1.f) : 1.f;
    state_s[tid] = st;
    const float v_scale = p.v_scale * kv_head_scale(p.v_scales, p.v_scales_stride, kv_head);
    inv_sum_s[tid] = v_scale * alpha * st.inv_sum();
  }

  // ---- out = P . V -------------------------------------------------------------------------
  const CACHE_T* v_head = static_cast<const CACHE_T*>(p.v_cache) + kv_head * p.v_stride_head;
  const int slot = VSLOTS > 1 ? tid / V_VECS : 0;
  const int vt = VSLOTS > 1 ? tid % V_VECS : tid;
  const bool v_active = VPT > 1 || tid < VSLOTS * V_VECS;
  constexpr int VSTEP = VSLOTS * UV;   // blocks per step of the whole thread block
  float vacc[VPT][GROUP];
#pragma unroll
  for (int j = 0; j < VPT; ++j)
#pragma unroll
    for (int h = 0; h < GROUP; ++h) vacc[j][h] = 0.f;

  for (int b0 = slot * UV; b0 < num_blks; b0 += VSTEP) {
    RawVec<Tr::V_BYTES> vv[UV][VPT];
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const bool valid = v_active && b0 + u < num_blks;
      const CACHE_T* src = v_head + (long long)(valid ? __ldg(block_table + b0 + u) : 0) * p.v_stride_block;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int vec = vt + NUM_THREADS * j;
        vv[u][j] = valid && (V_VECS % NUM_THREADS == 0 || vec < V_VECS)
                       ? load_stream<Tr::V_BYTES>(src + (vec / VPR) * p.v_stride_dim + (vec % VPR) * VL)
                       : RawVec<Tr::V_BYTES>{};
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int b = b0 + u;
      if (!(v_active && b < num_blks)) continue;
      const int blk_tok0 = (start_blk + b) * BLOCK_SIZE;
      const bool tail = blk_tok0 + BLOCK_SIZE > end_tok;   // only the last block of a sequence
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        const int vec = vt + NUM_THREADS * j;
        if (V_VECS % NUM_THREADS != 0 && vec >= V_VECS) continue;
        const int c = vec % VPR;
        float vf[VL];
        unpack_raw<CACHE_T, VL>(vv[u][j], vf);
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
      output.store(i / HEAD_SIZE, i % HEAD_SIZE, s * inv_sum_s[i / HEAD_SIZE]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int vec = vt + NUM_THREADS * j;
      if (vec % VPR != 0 || (V_VECS % NUM_THREADS != 0 && vec >= V_VECS)) continue;
#pragma unroll
      for (int h = 0; h < GROUP; ++h) output.store(h, vec / VPR, vacc[j][h] * inv_sum_s[h]);
    }
  }
  if (tid < GROUP) output.store_lse(tid, state_s[tid].lse(1.f));
}

}  // namespace cuattn
