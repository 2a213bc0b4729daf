// quantize_e4m3: out = e4m3(x / scale), round to nearest, saturating at +-448 (as
// reshape_and_cache stores fp8 caches): the FP8 forward's queries from 16-bit ones
// (paged_prefill's q_scale, vLLM's static query scale). The scale of head h is the scale of
// its KV head h / head_group, so that the attention kernel's (batch, nheads_kv) q_descale
// undoes it.
#pragma once
#include "common/types.cuh"
#include "params/quantize_e4m3.cuh"

namespace cuattn {

// The kernel's knobs: the input type T (fp16 / bf16), threads per block.
template <typename T_, int NUM_THREADS_>
struct QuantizeE4m3Traits {
  using T = T_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
};

// Grid: (rows), block: (NUM_THREADS). Each thread writes whole 16-byte vectors of the output
// (16 elements of one head: two 16-byte input vectors).
template <typename Tr>
__device__ void quantize_e4m3_kernel(const QuantizeE4m3Params& p) {
  using T = typename Tr::T;
  constexpr int IN = ElemsPer16B<T>::value;
  const long long row = blockIdx.x;
  const int vecs_per_head = p.head_dim / 16;
  for (int i = threadIdx.x; i < p.num_heads * vecs_per_head; i += Tr::NUM_THREADS) {
    const int head = i / vecs_per_head, g = i % vecs_per_head;
    const T* src = static_cast<const T*>(p.x) + row * p.x_stride_row + head * p.x_stride_head + g * 16;
    __nv_fp8_e4m3* dst = static_cast<__nv_fp8_e4m3*>(p.out) + row * p.out_stride_row +
                         head * p.out_stride_head + g * 16;
    const float scale = p.scale * kv_head_scale(p.scales, p.scales_stride, head / p.head_group);
    Vec16 packed;
    __nv_fp8_e4m3* q = reinterpret_cast<__nv_fp8_e4m3*>(&packed);
#pragma unroll
    for (int half = 0; half < 16 / IN; ++half) {
      float f[IN];
      unpack16<T>(load16(src + half * IN), f);
#pragma unroll
      for (int e = 0; e < IN; ++e) q[half * IN + e] = from_float<__nv_fp8_e4m3>(__fdiv_rn(f[e], scale));
    }
    store16(dst, packed);
  }
}

}  // namespace cuattn
