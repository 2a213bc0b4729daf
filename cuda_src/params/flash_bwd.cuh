// Parameters of the flash backward kernels (cuda_src/flash_bwd.cuh): the pre-pass, the main
// kernel, the dQ convert and the sinks' gradient. Mirrored by
// cuattn.param_structs.FLASH_BWD_PARAMS; every generated entry point static_asserts the size
// of each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

// Strides are in elements; the layouts are the forward's (params/flash_fwd.cuh): fixed length
// with cu_seqlens_* null, row i of batch b at b * stride_batch + i * stride_row; varlen with
// stride_batch 0, seqlen_q = total_q, the rows of batch b from cu_seqlens_*[b].
// Workspace (fp32, one allocation): dq_accum [dq_slices, total_q, num_heads, head_dim] (the
// main kernel adds dS K into slice 0, or deterministically into the slice of its block
// column), dsum [num_heads, total_q] (D = rowsum(dO * O)) and lse2 [num_heads, total_q]
// (lse * log2(e), +inf for a row that saw no key so that its P is 0).
struct FlashBwdParams {
  const void* q;              // [batch, seqlen_q, num_heads, head_dim] T (varlen: [total_q, num_heads, head_dim])
  const void* k;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  const void* v;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  const void* out;            // [batch, seqlen_q, num_heads, head_dim] T: the forward's output
  const void* dout;           // [batch, seqlen_q, num_heads, head_dim] T: the gradient of out
  const void* lse;            // [batch, num_heads, seqlen_q] float: the forward's (varlen: [num_heads, total_q])
  void* dq;                   // [batch, seqlen_q, num_heads, head_dim] T
  void* dk;                   // [batch, seqlen_k, num_heads_kv, head_dim] T
  void* dv;                   // [batch, seqlen_k, num_heads_kv, head_dim] T
  void* dq_accum;             // [dq_slices, total_q, num_heads, head_dim] float (workspace)
  void* dsum;                 // [num_heads, total_q] float (workspace): rowsum(dO * O)
  void* lse2;                 // [num_heads, total_q] float (workspace): lse in log2 units
  const void* cu_seqlens_q;   // [batch + 1] int32 prefix sums (null = fixed length)
  const void* cu_seqlens_k;   // [batch + 1] int32 prefix sums (null = fixed length)
  const void* alibi_slopes;   // [num_heads] or [batch, num_heads] float (ALiBi only)
  const void* sinks;          // [num_heads] float (sinks only)
  void* dsinks;               // [num_heads] float (sinks only)
  long long q_stride_batch, q_stride_row, q_stride_head;
  long long k_stride_batch, k_stride_row, k_stride_head;
  long long v_stride_batch, v_stride_row, v_stride_head;
  long long o_stride_batch, o_stride_row, o_stride_head;
  long long do_stride_batch, do_stride_row, do_stride_head;
  long long dq_stride_batch, dq_stride_row, dq_stride_head;
  long long dk_stride_batch, dk_stride_row, dk_stride_head;
  long long dv_stride_batch, dv_stride_row, dv_stride_head;
  long long lse_stride_batch, lse_stride_head, lse_stride_row;
  int batch;
  int num_heads;
  int head_group;             // num_heads / num_heads_kv: query head h reads kv head h / head_group
  int seqlen_q;               // fixed length (varlen: total_q)
  int seqlen_k;               // fixed length (varlen: unused)
  int total_q;                // rows of the workspace: batch * seqlen_q, or total_q
  int head_dim;               // actual head dim (multiple of 8, <= HEAD_DIM)
  int window_left;            // keys j >= i + sk - sq - window_left (a huge value = unbounded)
  int window_right;           // keys j <= i + sk - sq + window_right (a huge value = unbounded)
  int dq_slices;              // slices of dq_accum (1 unless deterministic)
  int deterministic;          // 1: block column x adds into slice x, walking key tiles x, x + gridDim.x, ...
  float scale_log2;           // softmax_scale * log2(e)
  float softmax_scale;        // dQ = softmax_scale * dS K, dK = softmax_scale * dS^T Q
  float softmax_scale_inv;    // 1 / softmax_scale: ALiBi slopes in raw-score units
  float softcap_in;           // softcap: softmax_scale / cap (common/logits.cuh)
  float softcap_out;          // softcap: cap / softmax_scale
  int alibi_stride_batch;     // 0: alibi_slopes [num_heads]; else its row stride
  int lpt_group;              // 0: block (x, y, z) takes key tiles x, x + gridDim.x, ... of kv head
                              // y, batch z; else (the Hopper kernel) one tile per block, heavy
                              // tiles first: the grid read in launch order as sections of
                              // lpt_group (kv head, batch) pairs, key tile-major within each
                              // (bwd_block_index)
};

}  // namespace cuattn
