// Parameters of reshape_and_cache (cuda_src/reshape_and_cache.cuh). Mirrored by
// cuattn.param_structs.RESHAPE_PARAMS; every generated entry point static_asserts the size of
// each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

// Strides are in elements; X = 16 / sizeof(CACHE_T). vLLM's layouts are shown; the NHD
// layout (both caches [num_blocks, block_size, num_kv_heads, head_size]) is the same code
// with k_stride_x = X, v_stride_dim = 1 and the slot strides k/v_stride_token.
struct ReshapeCacheParams {
  const void* key;           // [num_tokens, num_kv_heads, head_size]            T
  const void* value;         // [num_tokens, num_kv_heads, head_size]            T
  void* k_cache;             // [num_blocks, num_kv_heads, head_size / X, block_size, X]  CACHE_T
  void* v_cache;             // [num_blocks, num_kv_heads, head_size, block_size]         CACHE_T
  const void* slot_mapping;  // [num_tokens]                                     int32 or int64
  const void* k_scales;      // [num_kv_heads] or [1] float: the scales in device memory (else null)
  const void* v_scales;
  long long key_stride_token, key_stride_head;
  long long value_stride_token, value_stride_head;
  long long k_stride_block, k_stride_head, k_stride_x, k_stride_token;
  long long v_stride_block, v_stride_head, v_stride_dim, v_stride_token;
  float k_scale;             // fp8 caches only, times k_scales' (1 when those are given)
  float v_scale;
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int k_scales_stride;       // 1: a scale per KV head; 0: one scale
  int v_scales_stride;
};

}  // namespace cuattn
