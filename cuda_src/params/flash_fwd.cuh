// Parameters of the flash forward kernel and its split-KV combine (cuda_src/flash_fwd.cuh).
// Mirrored by cuattn.variants.FLASH_PARAMS; every generated entry point static_asserts the
// size of each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

// Strides are in elements. Fixed-length: cu_seqlens_* are null and row i of batch b is at
// b * stride_batch + i * stride_row. Varlen: stride_batch is 0, seqlen_q = total_q, and
// the rows of batch b start at cu_seqlens_*[b].
struct FlashFwdParams {
  const void* q;              // [batch, seqlen_q, num_heads, head_dim] T (varlen: [total_q, num_heads, head_dim])
  const void* k;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  const void* v;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  void* out;                  // [batch, seqlen_q, num_heads, head_dim] T (varlen: [total_q, ...])
  void* lse;                  // [batch, num_heads, seqlen_q] float; null = not asked (varlen: [num_heads, total_q])
  void* oaccum;               // [num_splits, total_q, num_heads, head_dim] float: split-KV partial outputs (else null)
  void* lseaccum;             // [num_splits, num_heads, total_q] float: split-KV partial lse (else null)
  const void* cu_seqlens_q;   // [batch + 1] int32 prefix sums (null = fixed length)
  const void* cu_seqlens_k;   // [batch + 1] int32 prefix sums (null = fixed length)
  long long q_stride_batch, q_stride_row, q_stride_head;
  long long k_stride_batch, k_stride_row, k_stride_head;
  long long v_stride_batch, v_stride_row, v_stride_head;
  long long o_stride_batch, o_stride_row, o_stride_head;
  long long lse_stride_batch, lse_stride_head, lse_stride_row;
  int batch;
  int num_heads;
  int head_group;             // num_heads / num_heads_kv: query head h reads kv head h / head_group
  int seqlen_q;               // fixed length (varlen: total_q)
  int seqlen_k;               // fixed length (varlen: unused)
  int total_q;                // rows of oaccum / lseaccum: batch * seqlen_q, or total_q
  int head_dim;               // actual head dim (multiple of 8, <= HEAD_DIM)
  int window_left;            // keys j >= i + sk - sq - window_left (a huge value = unbounded)
  int window_right;           // keys j <= i + sk - sq + window_right (a huge value = unbounded)
  int num_splits;             // split-KV: key tiles are divided among this many blocks
  float scale_log2;           // softmax_scale * log2(e)
};

}  // namespace cuattn
