// Parameters of the paged decode kernels (both forms, cuda_src/paged_attention.cuh and
// paged_attention_mma.cuh) and of their partition reduce (cuda_src/paged_reduce.cuh).
// Mirrored by cuattn.param_structs.PAGED_PARAMS / PAGED_REDUCE_PARAMS; every generated entry
// point static_asserts the size of each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

// Strides are in elements. X = 16 / sizeof(CACHE_T) (vLLM's x-major K layout). The NHD
// layout (tensor-core form, NHD: both caches [num_blocks, block_size, num_kv_heads,
// HEAD_SIZE]) is the same K code with k_stride_x = 8 and k_stride_token the slot stride; its
// V is read like its K (v_stride_token, v_stride_dim unused).
//
// Multi-token decode (tensor-core form, QTOK > 1: paged_prefill's few-token path): the query
// rows of sequence s are cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1, and every array below
// sized by num_seqs (q, out, lse, tmp_out, tmp_lse) is sized by those rows (total_q)
// instead; block_tables and seq_lens stay per sequence.
struct PagedParams {
  void* out;                 // [num_seqs, num_heads, HEAD_SIZE]                 T (v1)
  void* lse;                 // [num_heads, num_seqs]                            float (v1, may be null)
  void* tmp_out;             // [num_seqs, num_heads, max_parts, HEAD_SIZE]      float (v2)
  void* tmp_lse;             // [num_seqs, num_heads, max_parts]                 float (v2)
  const void* q;             // [num_seqs, num_heads, HEAD_SIZE]                 T
  const void* k_cache;       // [num_blocks, num_kv_heads, HEAD_SIZE / X, BLOCK_SIZE, X]  CACHE_T
  const void* v_cache;       // [num_blocks, num_kv_heads, HEAD_SIZE, BLOCK_SIZE]         CACHE_T
  const void* block_tables;  // [num_seqs, max_blocks_per_seq]                   int32
  const void* seq_lens;      // [num_seqs]                                       int32
  const void* alibi_slopes;  // [num_heads] or [num_seqs, num_heads]             float (ALIBI only)
  const void* sinks;         // [num_heads]                                      float (SINKS, v1 only)
  const void* cu_seqlens_q;  // [num_seqs + 1]                                   int32 (multi-token only)
  const void* k_scales;      // [num_kv_heads] or [1]                            float (fp8, may be null)
  const void* v_scales;      // [num_kv_heads] or [1]                            float (fp8, may be null)
  long long q_stride_seq, q_stride_head;
  long long out_stride_seq, out_stride_head;
  long long lse_stride_head, lse_stride_seq;
  long long k_stride_block, k_stride_head, k_stride_x, k_stride_token;
  long long v_stride_block, v_stride_head, v_stride_dim;
  long long v_stride_token;  // NHD only
  long long bt_stride_seq;
  float scale_log2;          // softmax_scale * k_scale * log2(e), folded into q
  float v_scale;             // multiplies the output (1 for 16-bit caches)
                             // (k_scales / v_scales non-null: the scales in device memory,
                             // common/types.cuh kv_head_scale, and the two above exclude them)
  float softcap_in;          // SOFTCAP: 1 / (cap * log2 e) (common/logits.cuh, log2 units)
  float softcap_out;         // SOFTCAP: cap * log2 e
  int num_seqs;
  int num_heads;
  int gqa_ratio;             // num_heads / num_kv_heads
  int max_blocks_per_seq;    // block_tables.shape[1]: sequences are clamped to its capacity
  int max_parts;             // v2: partitions per sequence in tmp_out / tmp_lse
  int logits_stride;         // CUDA-core form: floats per head in the dynamic shared logits buffer
  int window_left;           // keys j >= pos - window_left (a huge value = unbounded); the query's
  int window_right;          // pos = seq_len - 1 (decode; right is 0), seq_len - q_len + i (multi-token)
  int k_scales_stride;       // 1: a scale per KV head; 0: one scale
  int v_scales_stride;
  int alibi_stride_seq;      // 0: alibi_slopes [num_heads]; else its row stride
};

// Rows: the sequences, or the query rows of cu_seqlens_q (multi-token decode; non-null).
struct PagedReduceParams {
  void* out;              // [rows, num_heads, HEAD_SIZE]                     T
  void* lse;              // [num_heads, rows]                                float (may be null)
  const void* tmp_out;    // [rows, num_heads, max_parts, HEAD_SIZE]          float
  const void* tmp_lse;    // [rows, num_heads, max_parts]                     float, natural log
  const void* seq_lens;   // [num_seqs]                                       int32
  const void* sinks;      // [num_heads]                                      float (SINKS only)
  const void* cu_seqlens_q;  // [num_seqs + 1]                                int32 (multi-token only)
  long long out_stride_seq, out_stride_head;
  long long lse_stride_head, lse_stride_seq;
  int num_heads;
  int max_parts;
  int partition_size;
  int max_seq_len;        // max_blocks_per_seq * block_size (the clamp of the main kernel)
  int num_seqs;
};

}  // namespace cuattn
