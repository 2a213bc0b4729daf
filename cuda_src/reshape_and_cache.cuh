// reshape_and_cache: scatter new tokens' keys and values into the paged KV cache at
// slot = physical_block * block_size + offset, in vLLM's layouts (x-major K, dim-major V) or
// the NHD layout (params/reshape_and_cache.cuh); negative slots are skipped, fp8 e4m3 caches
// store round-to-nearest(value / scale).
#pragma once
#include "common/types.cuh"
#include "params/reshape_and_cache.cuh"

namespace cuattn {

template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

// The kernel's knobs: the key / value type T, the cache's CACHE_T (T or fp8 e4m3), the
// slot_mapping width (SLOT64: int64, else int32), threads per block.
template <typename T_, typename CACHE_T_, bool SLOT64_, int NUM_THREADS_>
struct ReshapeCacheTraits {
  using T = T_;
  using CACHE_T = CACHE_T_;
  static constexpr bool SLOT64 = SLOT64_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static constexpr int X = 16 / sizeof(CACHE_T);        // elements of one 16-byte x-vector
  static constexpr bool SAME = SameType<T, CACHE_T>::value;
};

// Grid: (num_tokens), block: (NUM_THREADS). Each thread moves whole x-vectors (X elements of
// one head, 16 bytes of the cache): one 16-byte store into K, and into V X strided element
// stores (vLLM) or one 16-byte store (NHD, v_stride_dim = 1).
template <typename Tr>
__device__ void reshape_and_cache_kernel(const ReshapeCacheParams& p) {
  using T = typename Tr::T;
  using CACHE_T = typename Tr::CACHE_T;
  constexpr bool SLOT64 = Tr::SLOT64;
  constexpr int NUM_THREADS = Tr::NUM_THREADS;
  constexpr int X = Tr::X;
  constexpr bool SAME = Tr::SAME;
  const int token = blockIdx.x;
  const long long slot = SLOT64 ? static_cast<const long long*>(p.slot_mapping)[token]
                                : (long long)static_cast<const int*>(p.slot_mapping)[token];
  if (slot < 0) return;
  const long long block = slot / p.block_size;
  const int offset = slot % p.block_size;
  const int vecs_per_head = p.head_size / X;
  CACHE_T* k_cache = static_cast<CACHE_T*>(p.k_cache);
  CACHE_T* v_cache = static_cast<CACHE_T*>(p.v_cache);
  for (int i = threadIdx.x; i < p.num_kv_heads * vecs_per_head; i += NUM_THREADS) {
    const int head = i / vecs_per_head, g = i % vecs_per_head;
    const T* k_src = static_cast<const T*>(p.key) + token * p.key_stride_token + head * p.key_stride_head + g * X;
    const T* v_src = static_cast<const T*>(p.value) + token * p.value_stride_token + head * p.value_stride_head + g * X;
    CACHE_T* k_dst = k_cache + block * p.k_stride_block + head * p.k_stride_head + g * p.k_stride_x +
                     offset * p.k_stride_token;
    CACHE_T* v_dst = v_cache + block * p.v_stride_block + head * p.v_stride_head +
                     (long long)g * X * p.v_stride_dim + offset * p.v_stride_token;
    if constexpr (SAME) {
      const Vec16 kv = load16(k_src), vv = load16(v_src);
      store16(k_dst, kv);
      if (p.v_stride_dim == 1) {
        store16(v_dst, vv);
      } else {
        const CACHE_T* ve = reinterpret_cast<const CACHE_T*>(&vv);
#pragma unroll
        for (int e = 0; e < X; ++e) v_dst[e * p.v_stride_dim] = ve[e];
      }
    } else {
      // 16-bit input -> fp8: X = 16 elements, two 16-byte input vectors per cache vector.
      constexpr int IN = ElemsPer16B<T>::value;
      const float k_scale = p.k_scale * kv_head_scale(p.k_scales, p.k_scales_stride, head);
      const float v_scale = p.v_scale * kv_head_scale(p.v_scales, p.v_scales_stride, head);
      Vec16 packed;
      CACHE_T* kq = reinterpret_cast<CACHE_T*>(&packed);
#pragma unroll
      for (int half = 0; half < X / IN; ++half) {
        float kf[IN], vf[IN];
        unpack16<T>(load16(k_src + half * IN), kf);
        unpack16<T>(load16(v_src + half * IN), vf);
#pragma unroll
        for (int e = 0; e < IN; ++e) {
          kq[half * IN + e] = from_float<CACHE_T>(__fdiv_rn(kf[e], k_scale));
          v_dst[(half * IN + e) * p.v_stride_dim] = from_float<CACHE_T>(__fdiv_rn(vf[e], v_scale));
        }
      }
      store16(k_dst, packed);
    }
  }
}

}  // namespace cuattn
