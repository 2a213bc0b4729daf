// Parameters of flashinfer_tables (cuda_src/flashinfer_tables.cuh). Mirrored by
// cuattn.param_structs.FLASHINFER_TABLES_PARAMS; every generated entry point static_asserts the
// size of each field, and tests/test_jit.py compares the offsets.
#pragma once

namespace cuattn {

struct FlashInferTablesParams {
  const void* kv_indptr;         // [batch + 1]                        int32
  const void* kv_indices;        // [num_indices]                      int32
  const void* kv_last_page_len;  // [batch]                            int32
  void* block_tables;            // [batch, max_blocks_per_seq]        int32
  void* seq_lens;                // [batch]                            int32, contiguous
  long long bt_stride_seq;       // block_tables' row stride, in elements
  int num_indices;
  int max_blocks_per_seq;
  int page_size;
};

}  // namespace cuattn
