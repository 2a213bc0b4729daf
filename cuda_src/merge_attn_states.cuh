// Merge of partial attention results by their log-sum-exp: for states i with outputs
// o_i and natural-log lse_i, m = max_i lse_i, w_i = exp(lse_i - m),
// out = sum_i w_i o_i / sum_i w_i and lse = m + log(sum_i w_i). This is the combine step of
// split-KV (Flash-Decoding), cascade attention and context parallelism.
#pragma once
#include "common/types.cuh"
#include "common/softmax.cuh"
#include "params/merge.cuh"

namespace cuattn {

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

// The kernel's knobs: STACKED = k states on a leading axis (merge_states), else two arrays.
template <typename T_, int HEAD_SIZE_, int NUM_THREADS_, bool STACKED_>
struct MergeTraits {
  using T = T_;
  static constexpr int HEAD_SIZE = HEAD_SIZE_;
  static constexpr int NUM_THREADS = NUM_THREADS_;
  static constexpr bool STACKED = STACKED_;
  static constexpr int VEC = ElemsPer16B<T>::value;
  static constexpr int VECS_PER_ROW = HEAD_SIZE / VEC;
  static_assert(HEAD_SIZE % VEC == 0, "head size must be a multiple of one 16-byte vector");
};

// Grid: (ceil(num_tokens * num_heads * HEAD_SIZE / 8 / NUM_THREADS)), block: (NUM_THREADS).
// One thread merges one 16-byte vector (8 elements) of one (token, head) row, with the
// head index varying fastest so that consecutive threads touch consecutive bytes. The
// states' weights are SoftmaxState's in natural-log units (lse = max + log(sum)).
template <typename Tr>
__device__ void merge_attn_states_kernel(const MergeParams& p) {
  using T = typename Tr::T;
  constexpr bool STACKED = Tr::STACKED;
  constexpr int NUM_THREADS = Tr::NUM_THREADS;
  constexpr int VEC = Tr::VEC;
  constexpr int VECS_PER_ROW = Tr::VECS_PER_ROW;

  // 32-bit index math (the host guarantees num_tokens * num_heads * VECS_PER_ROW < 2^31).
  const unsigned idx = blockIdx.x * NUM_THREADS + threadIdx.x;
  const unsigned row = idx / VECS_PER_ROW;
  const unsigned vec = idx % VECS_PER_ROW;
  if (row >= unsigned(p.num_tokens) * unsigned(p.num_heads)) return;
  const unsigned token = row / unsigned(p.num_heads);
  const unsigned head = row - token * unsigned(p.num_heads);
  const int num_states = STACKED ? p.num_states : 2;

  // Phase 1: the largest lse over the states (empty states count as -inf).
  SoftmaxState st = SoftmaxState::empty();
  for (int i = 0; i < num_states; ++i) {
    const char* src;
    float lse;
    locate_state<STACKED>(p, i, token, head, src, lse, sizeof(T));
    st.max = fmaxf(st.max, empty_as_neg_inf(lse));
  }
  const float base = SoftmaxState::base(st.max, kLog2e);

  // Phase 2: weighted sum of the outputs.
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
  for (int i = 0; i < num_states; ++i) {
    const char* src;
    float lse;
    locate_state<STACKED>(p, i, token, head, src, lse, sizeof(T));
    const float w = SoftmaxState::weight(empty_as_neg_inf(lse), kLog2e, base);
    if (w == 0.f) continue;   // an empty state is never read: its output may be garbage
    float x[VEC];
    unpack16<T>(load16_stream(src + vec * 16), x);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] += w * x[j];
    st.sum += w;
  }

  // Phase 3: normalise and store; an all-empty row gives zeros and lse = -inf.
  const float inv = st.inv_sum();
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] *= inv;
  char* dst = static_cast<char*>(p.out) +
              (token * p.out_stride_token + head * p.out_stride_head) * (long long)sizeof(T);
  store16_stream(dst + vec * 16, pack16<T>(acc));
  if (vec == 0 && p.out_lse != nullptr) {
    static_cast<float*>(p.out_lse)[head * p.lse_stride_head + token * p.lse_stride_token] =
        st.lse(kLog2e);
  }
}

}  // namespace cuattn
