// Parameters of kvcache_append (cuda_src/kvcache_append.cuh). Mirrored by
// cuattn.param_structs.KVCACHE_APPEND_PARAMS; every generated entry point static_asserts the size
// of each field, and tests/test_jit.py compares the offsets. Strides are in elements.
#pragma once

namespace cuattn {

struct KvCacheAppendParams {
  const void* k;                // [batch, seqlen_new, num_heads_kv, head_dim] T
  const void* v;                // [batch, seqlen_new, num_heads_kv, head_dim] T
  const void* cache_seqlens;    // [batch] int32: keys each row holds before the call (null: 0)
  const void* cache_batch_idx;  // [batch] int32: the cache row of batch entry b (null: b)
  void* k_cache;                // [batch_cache, seqlen_cache, num_heads_kv, head_dim] T
  void* v_cache;                // [batch_cache, seqlen_cache, num_heads_kv, head_dim] T
  long long k_stride_batch, k_stride_row, k_stride_head;
  long long v_stride_batch, v_stride_row, v_stride_head;
  long long kc_stride_batch, kc_stride_row, kc_stride_head;
  long long vc_stride_batch, vc_stride_row, vc_stride_head;
  int num_heads_kv;
  int head_dim;                 // a multiple of 8
  int seqlen_cache;
  int batch_cache;
  int cache_len;                // added to every cache_seqlens entry (an int cache_seqlens)
};

}  // namespace cuattn
