// The rows and keys of one sequence of a flash call: a batch entry's query rows and keys
// (fixed length, varlen or a paged cache's), the paged cache's block table, and the query
// rows of a forward block (one head, or the query heads of one KV head packed).
#pragma once
#include "params/flash_fwd.cuh"

namespace cuattn {

// Rows of one batch entry: where they start and how many there are.
struct SeqRange {
  int start;
  int len;
};

__device__ __forceinline__ SeqRange seq_range(const void* cu_seqlens, int b, int fixed_len) {
  if (cu_seqlens == nullptr) return {0, fixed_len};
  const int* cu = static_cast<const int*>(cu_seqlens);
  const int start = cu[b];
  return {start, cu[b + 1] - start};
}

// The keys of batch entry b: its slice of the packed K / V (cu_seqlens_k), the fixed
// length, or for a paged cache (no offset) its seqused_k plus the keys this call appended,
// clamped to the capacity of its cache (seqlen_k).
template <bool PAGED>
__device__ __forceinline__ SeqRange key_range(const FlashFwdParams& p, int b) {
  if constexpr (PAGED) {
    const long long used =
        (p.seqused_k ? static_cast<const int*>(p.seqused_k)[b] : 0) + (long long)p.new_keys;
    return {0, int(min(max(used, 0LL), (long long)p.seqlen_k))};
  }
  return seq_range(p.cu_seqlens_k, b, p.seqlen_k);
}

// A paged cache (params/flash_fwd.cuh): batch entry b's block-table row, and for its key j
// the cache block (the row's entry) and the slot inside it.
__device__ __forceinline__ const int* paged_table(const FlashFwdParams& p, int b) {
  return static_cast<const int*>(p.block_tables) + b * p.bt_stride_seq;
}
__device__ __forceinline__ long long paged_block(const FlashFwdParams& p, const int* table,
                                                 int j) {
  return __ldg(table + (j >> p.block_shift));
}
__device__ __forceinline__ int paged_slot(const FlashFwdParams& p, int j) {
  return j & ((1 << p.block_shift) - 1);
}

// The query rows of a block: row R of the block's sequence of rows is token R of head
// head0, or with PACK_GQA token R / group of head head0 + R % group (the group query heads
// of one KV head, interleaved per token so that a tile's rows span few tokens).
template <bool PACK>
struct QueryRows {
  int head0;
  int group;   // PACK: query heads per KV head (else 1)
  __device__ __forceinline__ int token(int R) const { return PACK ? R / group : R; }
  __device__ __forceinline__ int head(int R) const { return PACK ? head0 + R % group : head0; }
};

}  // namespace cuattn
