// The split-KV combine kernel of the flash forwards (flash_fwd.cuh, flash_fwd_sm90.cuh): it
// merges the fp32 partial rows of every split into the output, with the sinks.
#pragma once
#include "common/mma.cuh"
#include "common/softmax.cuh"
#include "params/flash_fwd.cuh"

namespace cuattn {

// The split-KV combine's knobs: one warp per (token, head) row, NUM_THREADS per block.
template <typename T_, int HEAD_DIM_, int NUM_THREADS_, bool SINKS_>
struct FlashCombineTraits {
  using T = T_;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static constexpr bool SINKS = SINKS_;   // each head's sink joins the merged state, once
  static constexpr int ROWS_PER_BLOCK = NUM_THREADS / 32;
  static constexpr int PASSES = (HEAD_DIM + 127) / 128;   // 4 columns per lane per pass
  static_assert(NUM_THREADS % 32 == 0, "whole warps");
};

// Grid: (ceil(total_q * num_heads / ROWS_PER_BLOCK)), block: (NUM_THREADS).
// Split-KV combine: one warp merges the num_splits fp32 partial rows of one (token, head)
// by their lse (the SoftmaxState merge in natural-log units: m = max lse_s, w_s = exp(lse_s
// - m), out = sum w_s o_s / sum w_s, lse = m + log(sum w_s)), writes the row in T at its
// place in out, and the lse when asked. Splits that saw no key (lse = -inf) weigh 0; a row no
// split saw gives zeros and -inf. Varlen rows outside every sequence (no split wrote their
// partials) are not written.
template <typename Tr>
__device__ void flash_fwd_combine_kernel(const FlashFwdParams& p) {
  using T = typename Tr::T;
  const int lane = threadIdx.x % 32;
  const long long row = (long long)blockIdx.x * Tr::ROWS_PER_BLOCK + threadIdx.x / 32;
  if (row >= (long long)p.total_q * p.num_heads) return;
  const long long tok = row / p.num_heads;
  const int h = static_cast<int>(row % p.num_heads);
  if (p.cu_seqlens_q != nullptr) {
    const int* cu = static_cast<const int*>(p.cu_seqlens_q);
    if (tok < cu[0] || tok >= cu[p.batch]) return;
  }
  const float* lacc = static_cast<const float*>(p.lseaccum);
  const float* oacc = static_cast<const float*>(p.oaccum);

  // Phase 1: the largest partial lse (and sink: a state {sink, 1} of no value).
  SoftmaxState st = SoftmaxState::empty();
  const float sink = Tr::SINKS ? static_cast<const float*>(p.sinks)[h] : 0.f;
  if (Tr::SINKS) st.max = sink;
  for (int s = 0; s < p.num_splits; ++s) {
    st.max = fmaxf(st.max, lacc[((long long)s * p.num_heads + h) * p.total_q + tok]);
  }
  const float base = SoftmaxState::base(st.max, kLog2e);
  if (Tr::SINKS) st.sum = SoftmaxState::weight(sink, kLog2e, base);
  // Phase 2: weighted sum, 4 columns per lane per pass.
  float acc[Tr::PASSES][4];
#pragma unroll
  for (int it = 0; it < Tr::PASSES; ++it) acc[it][0] = acc[it][1] = acc[it][2] = acc[it][3] = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = SoftmaxState::weight(lacc[((long long)s * p.num_heads + h) * p.total_q + tok],
                                         kLog2e, base);
    if (w == 0.f) continue;
    st.sum += w;
    const float* orow = oacc + (((long long)s * p.total_q + tok) * p.num_heads + h) * p.head_dim;
#pragma unroll
    for (int it = 0; it < Tr::PASSES; ++it) {
      const int col = it * 128 + lane * 4;
      if (col < p.head_dim) {
        const float4 x = *reinterpret_cast<const float4*>(orow + col);
        acc[it][0] += w * x.x;
        acc[it][1] += w * x.y;
        acc[it][2] += w * x.z;
        acc[it][3] += w * x.w;
      }
    }
  }
  // Phase 3: normalise and store at the row's place in out (fixed length: batch-major).
  const float inv = st.inv_sum();
  const long long b = tok / p.seqlen_q;   // varlen: seqlen_q = total_q, so b = 0
  const long long i = tok - b * p.seqlen_q;
  T* orow = static_cast<T*>(p.out) + b * p.o_stride_batch + i * p.o_stride_row +
            h * p.o_stride_head;
#pragma unroll
  for (int it = 0; it < Tr::PASSES; ++it) {
    const int col = it * 128 + lane * 4;
    if (col < p.head_dim) {
      uint2 packed;
      packed.x = pack_pair<T>(acc[it][0] * inv, acc[it][1] * inv);
      packed.y = pack_pair<T>(acc[it][2] * inv, acc[it][3] * inv);
      *reinterpret_cast<uint2*>(orow + col) = packed;
    }
  }
  if (lane == 0 && p.lse != nullptr) {
    static_cast<float*>(p.lse)[b * p.lse_stride_batch + h * p.lse_stride_head +
                               i * p.lse_stride_row] = st.lse(kLog2e);
  }
}

}  // namespace cuattn
