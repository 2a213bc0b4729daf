// What both forms of the paged decode kernel share (paged_attention.cuh: CUDA cores,
// paged_attention_mma.cuh: tensor cores): the range of tokens a thread block covers, and
// the epilogue that writes v1's output or v2's partial result for the reduce.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "params/paged.cuh"

namespace cuattn {

// The tokens [start, end) of sequence `seq` that partition `part` covers (v1: the whole
// sequence), its length clamped to the block table's capacity.
struct PagedRange {
  int seq_len;   // the whole (clamped) length: positions are relative to it (ALiBi)
  int start;
  int end;
};

template <int BLOCK_SIZE, int PARTITION_SIZE>
__device__ __forceinline__ PagedRange paged_range(const PagedParams& p, int seq, int part) {
  int seq_len = static_cast<const int*>(p.seq_lens)[seq];
  seq_len = min(max(seq_len, 0), p.max_blocks_per_seq * BLOCK_SIZE);
  const int start = part * PARTITION_SIZE;
  const int end = PARTITION_SIZE > 0 ? min(seq_len, start + PARTITION_SIZE) : seq_len;
  return {seq_len, start, end};
}

// The epilogue: v1 writes out (T) and lse; v2 writes the normalised fp32 partial output
// and its lse into tmp_out / tmp_lse, row (query row, head), slot part, for the reduce
// kernel.
template <typename T, int HEAD_SIZE, bool V2>
struct PagedOutput {
  const PagedParams& p;
  int qrow, head0, part;   // qrow: the sequence (decode) or cu_seqlens_q[seq] + token

  __device__ __forceinline__ void store(int h, int d, float value) const {
    if (V2) {
      const long long row = (long long)qrow * p.num_heads + head0 + h;
      static_cast<float*>(p.tmp_out)[(row * p.max_parts + part) * HEAD_SIZE + d] = value;
    } else {
      static_cast<T*>(p.out)[qrow * p.out_stride_seq + (head0 + h) * p.out_stride_head + d] =
          from_float<T>(value);
    }
  }
  __device__ __forceinline__ void store_lse(int h, float lse) const {
    if (V2) {
      const long long row = (long long)qrow * p.num_heads + head0 + h;
      static_cast<float*>(p.tmp_lse)[row * p.max_parts + part] = lse;
    } else if (p.lse != nullptr) {
      static_cast<float*>(p.lse)[(head0 + h) * p.lse_stride_head + qrow * p.lse_stride_seq] = lse;
    }
  }
};

}  // namespace cuattn
