"""The params structs of the kernels: each mirrors a header under cuda_src/params/ (one C++
struct, its fields in order; cuattn.jit.ParamsStruct asserts the sizes at compile time).
The keys (cuattn.keys) name the struct their kernel takes; the plan builders pack it.
"""
from __future__ import annotations

from .jit import ParamsStruct


FLASH_PARAMS = ParamsStruct("FlashFwdParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "out"), ("lse", "out"),
    ("oaccum", "out"), ("lseaccum", "out"), ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"),
    ("block_tables", "ptr"), ("seqused_k", "ptr"), ("alibi_slopes", "ptr"), ("sinks", "ptr"),
    ("k_scales", "ptr"), ("v_scales", "ptr"), ("q_descale", "ptr"), ("k_descale", "ptr"),
    ("v_descale", "ptr"),
    ("q_stride_batch", "i64"), ("q_stride_row", "i64"), ("q_stride_head", "i64"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("o_stride_batch", "i64"), ("o_stride_row", "i64"), ("o_stride_head", "i64"),
    ("lse_stride_batch", "i64"), ("lse_stride_head", "i64"), ("lse_stride_row", "i64"),
    ("k_stride_block", "i64"), ("v_stride_block", "i64"), ("k_stride_chunk", "i64"),
    ("v_stride_dim", "i64"), ("bt_stride_seq", "i64"),
    ("batch", "i32"), ("num_heads", "i32"), ("head_group", "i32"), ("seqlen_q", "i32"),
    ("seqlen_k", "i32"), ("total_q", "i32"), ("head_dim", "i32"), ("window_left", "i32"),
    ("window_right", "i32"), ("num_splits", "i32"), ("block_shift", "i32"),
    ("max_blocks_per_seq", "i32"), ("new_keys", "i32"),
    ("scale_log2", "f32"), ("softmax_scale_inv", "f32"), ("softcap_in", "f32"),
    ("softcap_out", "f32"), ("v_scale", "f32"), ("m_blocks", "i32"),
    ("k_scales_stride", "i32"), ("v_scales_stride", "i32"), ("alibi_stride_batch", "i32"),
    ("q_descale_stride_batch", "i32"), ("q_descale_stride_head", "i32"),
    ("k_descale_stride_batch", "i32"), ("k_descale_stride_head", "i32"),
    ("v_descale_stride_batch", "i32"), ("v_descale_stride_head", "i32"),
])

FLASH_BWD_PARAMS = ParamsStruct("FlashBwdParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("dout", "ptr"), ("lse", "ptr"),
    ("dq", "out"), ("dk", "out"), ("dv", "out"), ("dq_accum", "out"), ("dsum", "out"),
    ("lse2", "out"), ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"), ("alibi_slopes", "ptr"),
    ("sinks", "ptr"), ("dsinks", "out"),
    ("q_stride_batch", "i64"), ("q_stride_row", "i64"), ("q_stride_head", "i64"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("o_stride_batch", "i64"), ("o_stride_row", "i64"), ("o_stride_head", "i64"),
    ("do_stride_batch", "i64"), ("do_stride_row", "i64"), ("do_stride_head", "i64"),
    ("dq_stride_batch", "i64"), ("dq_stride_row", "i64"), ("dq_stride_head", "i64"),
    ("dk_stride_batch", "i64"), ("dk_stride_row", "i64"), ("dk_stride_head", "i64"),
    ("dv_stride_batch", "i64"), ("dv_stride_row", "i64"), ("dv_stride_head", "i64"),
    ("lse_stride_batch", "i64"), ("lse_stride_head", "i64"), ("lse_stride_row", "i64"),
    ("batch", "i32"), ("num_heads", "i32"), ("head_group", "i32"), ("seqlen_q", "i32"),
    ("seqlen_k", "i32"), ("total_q", "i32"), ("head_dim", "i32"), ("window_left", "i32"),
    ("window_right", "i32"), ("dq_slices", "i32"), ("deterministic", "i32"),
    ("scale_log2", "f32"), ("softmax_scale", "f32"), ("softmax_scale_inv", "f32"),
    ("softcap_in", "f32"), ("softcap_out", "f32"), ("alibi_stride_batch", "i32"),
    ("lpt_group", "i32"),
])

MERGE_PARAMS = ParamsStruct("MergeParams", [
    ("out", "out"), ("out_lse", "out"),
    ("a_out", "ptr"), ("a_lse", "ptr"), ("b_out", "ptr"), ("b_lse", "ptr"),
    ("out_stride_token", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_token", "i64"),
    ("a_stride_token", "i64"), ("a_stride_head", "i64"),
    ("a_lse_stride_head", "i64"), ("a_lse_stride_token", "i64"),
    ("b_stride_token", "i64"), ("b_stride_head", "i64"),
    ("b_lse_stride_head", "i64"), ("b_lse_stride_token", "i64"),
    ("state_stride", "i64"), ("lse_state_stride", "i64"),
    ("num_states", "i32"), ("num_tokens", "i32"), ("num_heads", "i32"),
])

PAGED_PARAMS = ParamsStruct("PagedParams", [
    ("out", "out"), ("lse", "out"), ("tmp_out", "out"), ("tmp_lse", "out"), ("q", "ptr"),
    ("k_cache", "ptr"), ("v_cache", "ptr"), ("block_tables", "ptr"), ("seq_lens", "ptr"),
    ("alibi_slopes", "ptr"), ("sinks", "ptr"), ("cu_seqlens_q", "ptr"), ("k_scales", "ptr"),
    ("v_scales", "ptr"),
    ("q_stride_seq", "i64"), ("q_stride_head", "i64"),
    ("out_stride_seq", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_seq", "i64"),
    ("k_stride_block", "i64"), ("k_stride_head", "i64"), ("k_stride_x", "i64"),
    ("k_stride_token", "i64"),
    ("v_stride_block", "i64"), ("v_stride_head", "i64"), ("v_stride_dim", "i64"),
    ("v_stride_token", "i64"), ("bt_stride_seq", "i64"),
    ("scale_log2", "f32"), ("v_scale", "f32"), ("softcap_in", "f32"), ("softcap_out", "f32"),
    ("num_seqs", "i32"), ("num_heads", "i32"), ("gqa_ratio", "i32"),
    ("max_blocks_per_seq", "i32"), ("max_parts", "i32"), ("logits_stride", "i32"),
    ("window_left", "i32"), ("window_right", "i32"), ("k_scales_stride", "i32"),
    ("v_scales_stride", "i32"), ("alibi_stride_seq", "i32"),
])

PAGED_REDUCE_PARAMS = ParamsStruct("PagedReduceParams", [
    ("out", "out"), ("lse", "out"), ("tmp_out", "ptr"), ("tmp_lse", "ptr"), ("seq_lens", "ptr"),
    ("sinks", "ptr"), ("cu_seqlens_q", "ptr"),
    ("out_stride_seq", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_seq", "i64"),
    ("num_heads", "i32"), ("max_parts", "i32"), ("partition_size", "i32"),
    ("max_seq_len", "i32"), ("num_seqs", "i32"),
])

RESHAPE_PARAMS = ParamsStruct("ReshapeCacheParams", [
    ("key", "ptr"), ("value", "ptr"), ("k_cache", "out"), ("v_cache", "out"),
    ("slot_mapping", "ptr"), ("k_scales", "ptr"), ("v_scales", "ptr"),
    ("key_stride_token", "i64"), ("key_stride_head", "i64"),
    ("value_stride_token", "i64"), ("value_stride_head", "i64"),
    ("k_stride_block", "i64"), ("k_stride_head", "i64"), ("k_stride_x", "i64"),
    ("k_stride_token", "i64"),
    ("v_stride_block", "i64"), ("v_stride_head", "i64"), ("v_stride_dim", "i64"),
    ("v_stride_token", "i64"),
    ("k_scale", "f32"), ("v_scale", "f32"),
    ("num_tokens", "i32"), ("num_kv_heads", "i32"), ("head_size", "i32"), ("block_size", "i32"),
    ("k_scales_stride", "i32"), ("v_scales_stride", "i32"),
])

FLASHINFER_TABLES_PARAMS = ParamsStruct("FlashInferTablesParams", [
    ("kv_indptr", "ptr"), ("kv_indices", "ptr"), ("kv_last_page_len", "ptr"),
    ("block_tables", "out"), ("seq_lens", "out"),
    ("bt_stride_seq", "i64"),
    ("num_indices", "i32"), ("max_blocks_per_seq", "i32"), ("page_size", "i32"),
])

KVCACHE_APPEND_PARAMS = ParamsStruct("KvCacheAppendParams", [
    ("k", "ptr"), ("v", "ptr"), ("cache_seqlens", "ptr"), ("cache_batch_idx", "ptr"),
    ("k_cache", "out"), ("v_cache", "out"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("kc_stride_batch", "i64"), ("kc_stride_row", "i64"), ("kc_stride_head", "i64"),
    ("vc_stride_batch", "i64"), ("vc_stride_row", "i64"), ("vc_stride_head", "i64"),
    ("num_heads_kv", "i32"), ("head_dim", "i32"), ("seqlen_cache", "i32"),
    ("batch_cache", "i32"), ("cache_len", "i32"),
])

QUANTIZE_PARAMS = ParamsStruct("QuantizeE4m3Params", [
    ("x", "ptr"), ("out", "out"), ("scales", "ptr"),
    ("x_stride_row", "i64"), ("x_stride_head", "i64"),
    ("out_stride_row", "i64"), ("out_stride_head", "i64"),
    ("scale", "f32"), ("num_heads", "i32"), ("head_dim", "i32"), ("head_group", "i32"),
    ("scales_stride", "i32"),
])
