// The online-softmax state of one row and how states merge (Milakov & Gimelshein 2018,
// "Online normalizer calculation for softmax"; the rescale of FlashAttention). Every softmax
// of every kernel, and every combine of partial results (split-KV, paged v2 partitions,
// warps, merge_attn_states), is written with SoftmaxState.
#pragma once

namespace cuattn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// -inf (NVRTC has no constant-expression infinity; this folds to an immediate).
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// An lse of +inf or -inf marks an empty partial result (vLLM and FlashAttention use
// both); everything downstream sees -inf.
__device__ __forceinline__ float empty_as_neg_inf(float lse) {
  return isinf(lse) ? neg_inf() : lse;
}

// Units. A state holds logits in the caller's units, and `scale` turns them into powers of
// two: a logit x weighs exp2(scale * x) before normalisation. Kernels pass
//   scale = softmax_scale * log2(e)  for raw scores (flash_fwd),
//   scale = 1                        for scores already scaled to log2 units (paged), and
//   scale = kLog2e                   for natural-log lse values (the combines),
// and a constant scale folds away.
//
// State: `max` is the largest logit seen (-inf: none yet) and `sum` the sum of
// exp2(scale * (x - max)) over the logits seen. A kernel may spread one row over several
// threads, each holding a part of `sum` under the common `max`, and add the parts at the
// end. The accumulator of the row's output (sum of weight * value) lives with the caller;
// every function that moves `max` returns the factor by which the caller rescales it.
//
// Merging states of disjoint logits (split-KV, v2 partitions, warps, merge_attn_states,
// where a partial result of natural-log lse L is the state {L, 1} in units scale = kLog2e)
// is two passes, never a chain of rescales: the largest max M first, b = base(M, scale),
// then state i weighs w_i = weight(max_i, scale, b) (0 for an empty one): the merged state
// is {M, sum_i w_i sum_i} and its accumulator sum_i w_i acc_i.
struct SoftmaxState {
  float max;
  float sum;

  static __device__ __forceinline__ SoftmaxState empty() { return {neg_inf(), 0.f}; }

  // The subtrahend of exp2 for a row whose max is m: scale * m, or 0 while m is -inf, so
  // that -inf - -inf is never formed (every logit is -inf then, and weighs exp2(-inf) = 0).
  // MAY_BE_EMPTY = false drops the test where the caller knows m is finite.
  template <bool MAY_BE_EMPTY = true>
  static __device__ __forceinline__ float base(float m, float scale) {
    if constexpr (MAY_BE_EMPTY) return m == neg_inf() ? 0.f : m * scale;
    return m * scale;
  }

  // The weight of logit x against base b (from base()): exp2(scale * x - b).
  static __device__ __forceinline__ float weight(float x, float scale, float b) {
    return exp2f(fmaf(x, scale, -b));
  }

  // Move the max to m_new (>= max) whose base is b: returns alpha, the factor that rescales
  // everything accumulated so far (sum here, the caller's accumulator likewise); 0 while
  // the old max was -inf.
  __device__ __forceinline__ float rescale(float m_new, float scale, float b) {
    const float alpha = weight(max, scale, b);
    max = m_new;
    sum *= alpha;
    return alpha;
  }

  // The same when m_new is known to be finite (the row has seen a logit): no base needed.
  __device__ __forceinline__ float rescale_finite(float m_new, float scale) {
    const float alpha = exp2f((max - m_new) * scale);
    max = m_new;
    sum *= alpha;
    return alpha;
  }

  // Join an attention sink: a logit that counts in the denominator and carries no value,
  // i.e. the state {sink, 1} merged into this one (FlashAttention's learnable sink,
  // gpt-oss). Returns alpha, the factor that rescales the caller's accumulator.
  // MAY_BE_EMPTY = false where the caller knows the row has seen a logit.
  template <bool MAY_BE_EMPTY = true>
  __device__ __forceinline__ float add_sink(float sink, float scale) {
    const float m = fmaxf(max, sink);
    const float b = base<MAY_BE_EMPTY>(m, scale);
    const float alpha = rescale(m, scale, b);
    sum += weight(sink, scale, b);
    return alpha;
  }

  // The normaliser of the accumulator: 1 / sum, or 0 for a row that saw nothing (zeros out).
  __device__ __forceinline__ float inv_sum() const { return sum > 0.f ? 1.f / sum : 0.f; }

  // The natural-log log-sum-exp of the row, -inf for a row that saw nothing. (scale * kLn2
  // folds to 1 for natural-log units, so an lse merged from lse values stays exact.)
  __device__ __forceinline__ float lse(float scale) const {
    return sum > 0.f ? fmaf(max, scale * kLn2, __log2f(sum) * kLn2) : neg_inf();
  }
};

}  // namespace cuattn
