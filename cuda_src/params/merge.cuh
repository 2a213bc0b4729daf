// Parameters of merge_attn_states / merge_states (cuda_src/merge_attn_states.cuh).
// Mirrored by cuattn.param_structs.MERGE_PARAMS; every generated entry point static_asserts the
// size of each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

// Strides are in elements.
struct MergeParams {
  void* out;             // [num_tokens, num_heads, HEAD_SIZE]     T
  void* out_lse;         // [num_heads, num_tokens]                float (may be null)
  const void* a_out;     // [num_tokens, num_heads, HEAD_SIZE]     T: state 0 (stacked: all states)
  const void* a_lse;     // [num_heads, num_tokens]                float
  const void* b_out;     // [num_tokens, num_heads, HEAD_SIZE]     T: state 1 (pair form only)
  const void* b_lse;     // [num_heads, num_tokens]                float
  long long out_stride_token, out_stride_head;
  long long lse_stride_head, lse_stride_token;          // of out_lse
  long long a_stride_token, a_stride_head, a_lse_stride_head, a_lse_stride_token;
  long long b_stride_token, b_stride_head, b_lse_stride_head, b_lse_stride_token;
  long long state_stride, lse_state_stride;             // stacked form: state i = a + i * stride
  int num_states;
  int num_tokens;
  int num_heads;
};

}  // namespace cuattn
