// kvcache_append: flash_with_kvcache's new keys and values written into a dense KV cache
// before the attention reads it. Token t of batch entry b goes to slot
// cache_seqlens[b] + cache_len + t of cache row cache_batch_idx[b] (or b).
#pragma once
#include "common/types.cuh"
#include "params/kvcache_append.cuh"

namespace cuattn {

template <typename T_, int NUM_THREADS_>
struct KvCacheAppendTraits {
  using T = T_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "whole warps, one block");
};

// Grid: (seqlen_new, batch), block: (NUM_THREADS). Block (t, b) copies token t of entry b,
// every KV head, K and V, in 16-byte vectors (threads take the (head, vector) pairs in turn).
// A slot outside [0, seqlen_cache) or a row outside [0, batch_cache) is not written: whatever
// the device values say, no write leaves the caches.
template <typename Tr>
__device__ void kvcache_append_kernel(const KvCacheAppendParams& p) {
  using T = typename Tr::T;
  const int t = blockIdx.x, b = blockIdx.y;
  const long long cached =
      p.cache_seqlens ? static_cast<const int*>(p.cache_seqlens)[b] : 0;
  const long long slot = cached + p.cache_len + t;
  const int row = p.cache_batch_idx ? static_cast<const int*>(p.cache_batch_idx)[b] : b;
  if (slot < 0 || slot >= p.seqlen_cache || row < 0 || row >= p.batch_cache) return;
  const int vectors = p.head_dim / 8;
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride_batch + t * p.k_stride_row;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride_batch + t * p.v_stride_row;
  T* kc = static_cast<T*>(p.k_cache) + row * p.kc_stride_batch + slot * p.kc_stride_row;
  T* vc = static_cast<T*>(p.v_cache) + row * p.vc_stride_batch + slot * p.vc_stride_row;
  for (int i = threadIdx.x; i < p.num_heads_kv * vectors; i += Tr::NUM_THREADS) {
    const int h = i / vectors, c = (i % vectors) * 8;
    *reinterpret_cast<uint4*>(kc + h * p.kc_stride_head + c) =
        *reinterpret_cast<const uint4*>(k + h * p.k_stride_head + c);
    *reinterpret_cast<uint4*>(vc + h * p.vc_stride_head + c) =
        *reinterpret_cast<const uint4*>(v + h * p.v_stride_head + c);
  }
}

}  // namespace cuattn
