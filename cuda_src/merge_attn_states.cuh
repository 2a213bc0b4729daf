// Merge of partial attention results by their log-sum-exp: for states i with outputs
// o_i and natural-log lse_i, m = max_i lse_i, w_i = exp(lse_i - m),
// out = sum_i w_i o_i / sum_i w_i and lse = m + log(sum_i w_i). This is the combine step of
// split-KV (Flash-Decoding), cascade attention and context parallelism.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"

namespace cuattn {

// Mirrored by cuattn.merge.PARAMS (a static_assert in every entry point checks the layout).
// Strides are in elements.
struct MergeParams {
  const void* out;       // [num_tokens, num_heads, HEAD_SIZE]     T, written
  const void* out_lse;   // [num_heads, num_tokens]                float, written (may be null)
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

// Where state `i` of row (token, head) lives.
template <bool STACKED>
__device__ __forceinline__ void locate_state(const MergeParams& p, int i, long long token,
                                             long long head, const char*& row, float& lse,
                                             int elem_bytes) {
  if (STACKED || i == 0) {
    const long long s = STACKED ? i : 0;
    row = static_cast<const char*>(p.a_out) +
          (s * p.state_stride + token * p.a_stride_token + head * p.a_stride_head) * elem_bytes;
    lse = static_cast<const float*>(p.a_lse)[s * p.lse_state_stride +
                                             head * p.a_lse_stride_head +
                                             token * p.a_lse_stride_token];
  } else {
    row = static_cast<const char*>(p.b_out) +
          (token * p.b_stride_token + head * p.b_stride_head) * elem_bytes;
    lse = static_cast<const float*>(p.b_lse)[head * p.b_lse_stride_head +
                                             token * p.b_lse_stride_token];
  }
}

// Grid: (ceil(num_tokens * num_heads * HEAD_SIZE / 8 / NUM_THREADS)), block: (NUM_THREADS).
// One thread merges one 16-byte vector (8 elements) of one (token, head) row, with the
// head index varying fastest so that consecutive threads touch consecutive bytes.
template <typename T, int HEAD_SIZE, int NUM_THREADS, bool STACKED>
__device__ void merge_attn_states_kernel(const MergeParams& p) {
  constexpr int VEC = ElemsPer16B<T>::value;
  constexpr int VECS_PER_ROW = HEAD_SIZE / VEC;
  static_assert(HEAD_SIZE % VEC == 0, "head size must be a multiple of one 16-byte vector");

  // 32-bit index math (the host guarantees num_tokens * num_heads * VECS_PER_ROW < 2^31).
  const unsigned idx = blockIdx.x * NUM_THREADS + threadIdx.x;
  const unsigned row = idx / VECS_PER_ROW;
  const unsigned vec = idx % VECS_PER_ROW;
  if (row >= unsigned(p.num_tokens) * unsigned(p.num_heads)) return;
  const unsigned token = row / unsigned(p.num_heads);
  const unsigned head = row - token * unsigned(p.num_heads);
  const int num_states = STACKED ? p.num_states : 2;

  // Phase 1: the largest lse over the states (empty states count as -inf).
  float max_lse = neg_inf();
  for (int i = 0; i < num_states; ++i) {
    const char* src;
    float lse;
    locate_state<STACKED>(p, i, token, head, src, lse, sizeof(T));
    max_lse = fmaxf(max_lse, empty_as_neg_inf(lse));
  }

  // Phase 2: weighted sum of the outputs.
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
  float weight_sum = 0.f;
  for (int i = 0; i < num_states; ++i) {
    const char* src;
    float lse;
    locate_state<STACKED>(p, i, token, head, src, lse, sizeof(T));
    const float w = exp_minus(empty_as_neg_inf(lse), max_lse);
    if (w == 0.f) continue;   // an empty state is never read: its output may be garbage
    float x[VEC];
    unpack16<T>(load16_stream(src + vec * 16), x);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += w * x[j];
    weight_sum += w;
  }

  // Phase 3: normalise and store; an all-empty row gives zeros and lse = -inf.
  const float inv = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] *= inv;
  char* dst = static_cast<char*>(const_cast<void*>(p.out)) +
              (token * p.out_stride_token + head * p.out_stride_head) * (long long)sizeof(T);
  store16_stream(dst + vec * 16, pack16<T>(acc));
  if (vec == 0 && p.out_lse != nullptr) {
    float* out_lse = static_cast<float*>(const_cast<void*>(p.out_lse));
    out_lse[head * p.lse_stride_head + token * p.lse_stride_token] =
        weight_sum > 0.f ? max_lse + __logf(weight_sum) : neg_inf();
  }
}

}  // namespace cuattn
