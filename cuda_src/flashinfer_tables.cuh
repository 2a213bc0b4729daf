// flashinfer_tables: cuattn's paged-attention tables from FlashInfer's page table (the
// kv_indptr / kv_indices / kv_last_page_len of its paged-KV wrappers). Row b of
// block_tables lists the pages kv_indices[kv_indptr[b] .. kv_indptr[b + 1]), then zeros;
// seq_lens[b] = (pages - 1) * page_size + kv_last_page_len[b], or 0 without pages.
#pragma once
#include "params/flashinfer_tables.cuh"

namespace cuattn {

template <int NUM_THREADS_>
struct FlashInferTablesTraits {
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static_assert(NUM_THREADS % 32 == 0 && NUM_THREADS <= 1024, "whole warps, one block");
};

// Grid: (batch), block: (NUM_THREADS). Block b writes row b of block_tables, its threads
// taking the entries in turn, and thread 0 writes seq_lens[b]. Whatever the device values
// say, no read leaves kv_indices (an entry whose index falls outside it is 0) and seq_lens
// stays in [0, INT32_MAX], so a malformed table cannot fault.
template <typename Tr>
__device__ void flashinfer_tables_kernel(const FlashInferTablesParams& p) {
  const int b = blockIdx.x;
  const int* indptr = static_cast<const int*>(p.kv_indptr);
  const int* indices = static_cast<const int*>(p.kv_indices);
  const long long begin = indptr[b];
  const long long end = indptr[b + 1];
  const long long pages = end > begin ? end - begin : 0;
  int* row = static_cast<int*>(p.block_tables) + b * p.bt_stride_seq;
  for (int i = threadIdx.x; i < p.max_blocks_per_seq; i += Tr::NUM_THREADS) {
    const long long at = begin + i;
    row[i] = i < pages && at >= 0 && at < p.num_indices ? indices[at] : 0;
  }
  if (threadIdx.x == 0) {
    const long long last = static_cast<const int*>(p.kv_last_page_len)[b];
    long long len = pages > 0 ? (pages - 1) * p.page_size + last : 0;
    len = len < 0 ? 0 : (len > 2147483647LL ? 2147483647LL : len);
    static_cast<int*>(p.seq_lens)[b] = static_cast<int>(len);
  }
}

}  // namespace cuattn
