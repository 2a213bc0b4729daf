// Parameters of the flash forward kernels and their split-KV combine (cuda_src/flash_fwd.cuh,
// flash_fwd_sm90.cuh, flash_combine.cuh).
// Mirrored by cuattn.param_structs.FLASH_PARAMS; every generated entry point static_asserts the
// size of each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

// Strides are in elements. Fixed-length: cu_seqlens_* are null and row i of batch b is at
// b * stride_batch + i * stride_row. Varlen: stride_batch is 0, seqlen_q = total_q, and
// the rows of batch b start at cu_seqlens_*[b].
// Paged K/V (paged_prefill, FlashFwdTraits KV != kKvDense): cu_seqlens_k is null, batch b
// has seqused_k[b] + new_keys keys (at most seqlen_k), and key j lives in cache block block_tables[b][j >> block_shift]
// at slot j & (2^block_shift - 1):
//   NHD  K and V (num_blocks, block_size, num_heads_kv, head_dim): element d of key j at
//        block * k_stride_block + slot * k_stride_row + kvh * k_stride_head + d;
//   vLLM K (num_blocks, num_heads_kv, head_dim / 8, block_size, 8): 16-byte chunk c of a
//        key at block * k_stride_block + kvh * k_stride_head + c * k_stride_chunk
//        + slot * k_stride_row (= 8); V (num_blocks, num_heads_kv, head_dim, block_size):
//        dim d at block * v_stride_block + kvh * v_stride_head + d * v_stride_dim + slot.
//   fp8 e4m3 caches (FlashFwdTraits FP8_CACHE): the same in bytes, vLLM's K with 16 one-byte
//        values per chunk ((num_blocks, num_heads_kv, head_dim / 16, block_size, 16),
//        k_stride_row = 16); each value means e4m3 * k_scale (V: * v_scale).
struct FlashFwdParams {
  const void* q;              // [batch, seqlen_q, num_heads, head_dim] T (varlen: [total_q, num_heads, head_dim])
  const void* k;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  const void* v;              // [batch, seqlen_k, num_heads_kv, head_dim] T (varlen: [total_k, ...])
  void* out;                  // [batch, seqlen_q, num_heads, head_dim] T (varlen: [total_q, ...])
  void* lse;                  // [batch, num_heads, seqlen_q] float; null = not asked (varlen: [num_heads, total_q])
  void* oaccum;               // [num_splits, total_q, num_heads, head_dim] float: split-KV partial outputs (else null)
  void* lseaccum;             // [num_splits, num_heads, total_q] float: split-KV partial lse (else null)
  const void* cu_seqlens_q;   // [batch + 1] int32 prefix sums (null = fixed length)
  const void* cu_seqlens_k;   // [batch + 1] int32 prefix sums (null = fixed length or paged)
  const void* block_tables;   // [batch, max_blocks_per_seq] int32 (paged only)
  const void* seqused_k;      // [batch] int32: keys of each sequence (paged only)
  const void* alibi_slopes;   // [num_heads] or [batch, num_heads] float (ALiBi only)
  const void* sinks;          // [num_heads] float: a logit per head in the denominator (sinks only)
  const void* k_scales;       // [num_heads_kv] or [1] float: fp8 caches' scales in device memory
  const void* v_scales;       // (null: 1, or the host's v_scale and softmax scale hold them)
  const void* q_descale;      // [batch, num_heads_kv] float: E4M3 q / k / v (the Hopper kernel's
  const void* k_descale;      // e4m3 form) mean their values times these (null: 1); query head
  const void* v_descale;      // h takes its KV head's q_descale too (FlashAttention-3)
  long long q_stride_batch, q_stride_row, q_stride_head;
  long long k_stride_batch, k_stride_row, k_stride_head;
  long long v_stride_batch, v_stride_row, v_stride_head;
  long long o_stride_batch, o_stride_row, o_stride_head;
  long long lse_stride_batch, lse_stride_head, lse_stride_row;
  long long k_stride_block, v_stride_block;   // paged: between cache blocks
  long long k_stride_chunk;   // between the 16-byte chunks of a key (dense and NHD: 8)
  long long v_stride_dim;     // paged vLLM layout: between the dims of a V slot
  long long bt_stride_seq;    // paged: block_tables row stride
  int batch;
  int num_heads;
  int head_group;             // num_heads / num_heads_kv: query head h reads kv head h / head_group
  int seqlen_q;               // fixed length (varlen: total_q)
  int seqlen_k;               // fixed length (varlen: unused; paged: the capacity of a sequence's keys)
  int total_q;                // rows of oaccum / lseaccum: batch * seqlen_q, or total_q
  int head_dim;               // actual head dim (multiple of 8, <= HEAD_DIM)
  int window_left;            // keys j >= i + sk - sq - window_left (a huge value = unbounded)
  int window_right;           // keys j <= i + sk - sq + window_right (a huge value = unbounded)
  int num_splits;             // split-KV: key tiles are divided among this many blocks
  int block_shift;            // paged: log2(block_size)
  int max_blocks_per_seq;     // paged: block_tables.shape[1]
  int new_keys;               // paged: keys appended after seqused_k[b] by this call (flash_with_kvcache's
                              // k / v; a null seqused_k counts 0); their sum is clamped to seqlen_k
  float scale_log2;           // softmax_scale * log2(e)
  float softmax_scale_inv;    // 1 / softmax_scale: ALiBi slopes and sinks in raw-score units
  float softcap_in;           // softcap: softmax_scale / cap (common/logits.cuh)
  float softcap_out;          // softcap: cap / softmax_scale
  float v_scale;              // fp8 caches: V is e4m3 values times this (else 1); the host
                              // folds K's scale into the softmax scale
  int m_blocks;               // row tiles per (head, batch x split): ceil(rows / BLOCK_M) (the Hopper kernel's schedule)
  int k_scales_stride;        // 1: a scale per KV head; 0: one scale
  int v_scales_stride;
  int alibi_stride_batch;     // 0: alibi_slopes [num_heads]; else its row stride
  int q_descale_stride_batch, q_descale_stride_head;   // elements
  int k_descale_stride_batch, k_descale_stride_head;
  int v_descale_stride_batch, v_descale_stride_head;
};

}  // namespace cuattn
