// The partition reduce of paged decode v2 (both forms): merges the normalised partial
// outputs of one (sequence, head) by their lse, SoftmaxState's merge in natural-log units.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "params/paged.cuh"

namespace cuattn {

// The reduce's knobs: one thread per 4 dims, in whole warps (DIM_THREADS), times GROUPS
// thread groups, NUM_THREADS in all.
template <typename T_, int HEAD_SIZE_, int NUM_THREADS_, bool SINKS_>
struct PagedReduceTraits {
  using T = T_;
  static constexpr int HEAD_SIZE = HEAD_SIZE_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static constexpr bool SINKS = SINKS_;   // each head's sink joins the merged state, once
  static constexpr int DIM_THREADS = (HEAD_SIZE / 4 + 31) / 32 * 32;
  static constexpr int GROUPS = NUM_THREADS / DIM_THREADS;
  static constexpr int CHUNK = 8;   // partitions per thread whose loads are in flight together
  static_assert(HEAD_SIZE % 4 == 0, "float4 rows");
  static_assert(GROUPS >= 1 && NUM_THREADS % DIM_THREADS == 0, "whole thread groups");
};

// The sequence of query row r: r itself, or (multi-token) the s with cu_seqlens_q[s] <= r <
// cu_seqlens_q[s + 1], by bisection; -1 for a row no sequence covers.
__device__ __forceinline__ int query_seq(const PagedReduceParams& p, int r) {
  const int* cu = static_cast<const int*>(p.cu_seqlens_q);
  if (cu == nullptr) return r;
  if (r < cu[0] || r >= cu[p.num_seqs]) return -1;
  int lo = 0, hi = p.num_seqs;   // cu[lo] <= r < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

// Grid: (num_heads, rows), block: (NUM_THREADS); rows: num_seqs, or total_q (multi-token).
// out = sum e^(lse_i - m) o_i / sum e^(lse_i - m), lse = m + log(sum e^(lse_i - m)); one
// partition comes through unchanged (weight e^0 = 1), none (an empty sequence) gives zeros
// and lse = -inf.
// Latency, not bandwidth, is what this kernel costs (a few KB per row, still in L2 after the
// main kernel), so it is written to have few dependent round trips to memory: each of the
// GROUPS thread groups takes every GROUPS-th partition and folds them in CHUNKs whose lse
// and output loads are all issued together, keeping its own running state (an online softmax
// over partitions); the groups then merge once through shared memory. At batch 1 x 32768
// (32 partitions, 4 groups) that is seq_len -> one chunk of loads -> one barrier -> store.
template <typename Tr>
__device__ void paged_attention_reduce_kernel(const PagedReduceParams& p) {
  using T = typename Tr::T;
  constexpr int HEAD_SIZE = Tr::HEAD_SIZE, DIM_THREADS = Tr::DIM_THREADS;
  constexpr int GROUPS = Tr::GROUPS, CHUNK = Tr::CHUNK;
  __shared__ float4 acc_s[GROUPS][DIM_THREADS];
  __shared__ SoftmaxState state_s[GROUPS];

  const int head = blockIdx.x, qrow = blockIdx.y, seq = query_seq(p, qrow);
  if (seq < 0) return;   // a row past cu_seqlens_q[num_seqs]: no sequence's
  const int tid = threadIdx.x, group = tid / DIM_THREADS, dt = tid % DIM_THREADS;
  const int d = dt * 4;
  const bool has_dims = d < HEAD_SIZE;
  int seq_len = static_cast<const int*>(p.seq_lens)[seq];
  seq_len = min(max(seq_len, 0), p.max_seq_len);
  const int num_parts = (seq_len + p.partition_size - 1) / p.partition_size;
  const long long row = (long long)qrow * p.num_heads + head;
  const float* lse_row = static_cast<const float*>(p.tmp_lse) + row * p.max_parts;
  // Threads past the head's dims (HEAD_SIZE % 128 != 0) load a valid column and drop it.
  const float* out_row = static_cast<const float*>(p.tmp_out) + row * p.max_parts * HEAD_SIZE +
                         (has_dims ? d : HEAD_SIZE - 4);

  // ---- each group: a running state and accumulator over partitions group, +GROUPS, ... ----
  SoftmaxState st = SoftmaxState::empty();
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
    float new_max = st.max;
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) new_max = fmaxf(new_max, l[c]);
    const float b = SoftmaxState::base(new_max, kLog2e);
    const float alpha = st.rescale(new_max, kLog2e, b);
    acc.x *= alpha; acc.y *= alpha; acc.z *= alpha; acc.w *= alpha;
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const float w = SoftmaxState::weight(l[c], kLog2e, b);
      st.sum += w;
      acc.x = fmaf(w, o[c].x, acc.x); acc.y = fmaf(w, o[c].y, acc.y);
      acc.z = fmaf(w, o[c].z, acc.z); acc.w = fmaf(w, o[c].w, acc.w);
    }
  }

  // ---- merge the groups (each group's threads hold the same state), and the sink ----------
  if (GROUPS > 1) {
    acc_s[group][dt] = acc;
    if (dt == 0) state_s[group] = st;
    __syncthreads();
    if (group != 0) return;
    float m = state_s[0].max;
#pragma unroll
    for (int k = 1; k < GROUPS; ++k) m = fmaxf(m, state_s[k].max);
    const float b = SoftmaxState::base(m, kLog2e);
    st = SoftmaxState{m, 0.f};
    acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) {
      const float w = SoftmaxState::weight(state_s[k].max, kLog2e, b);
      const float4 a = acc_s[k][dt];
      st.sum = fmaf(w, state_s[k].sum, st.sum);
      acc.x = fmaf(w, a.x, acc.x); acc.y = fmaf(w, a.y, acc.y);
      acc.z = fmaf(w, a.z, acc.z); acc.w = fmaf(w, a.w, acc.w);
    }
  }
  if constexpr (Tr::SINKS) {   // natural-log units
    const float alpha = st.add_sink(static_cast<const float*>(p.sinks)[head], kLog2e);
    acc.x *= alpha; acc.y *= alpha; acc.z *= alpha; acc.w *= alpha;
  }
  const float inv = st.inv_sum();
  if (has_dims) {
    T* o = static_cast<T*>(p.out) + qrow * p.out_stride_seq + head * p.out_stride_head + d;
    o[0] = from_float<T>(acc.x * inv); o[1] = from_float<T>(acc.y * inv);
    o[2] = from_float<T>(acc.z * inv); o[3] = from_float<T>(acc.w * inv);
  }
  if (tid == 0 && p.lse != nullptr) {
    static_cast<float*>(p.lse)[head * p.lse_stride_head + qrow * p.lse_stride_seq] = st.lse(kLog2e);
  }
}

}  // namespace cuattn
