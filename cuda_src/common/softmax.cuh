// The online-softmax state shared by every kernel: a running (max, sum) pair, its
// merge (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the
// FlashAttention rescale), and the log-sum-exp conventions at the API boundary.
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

// exp(x - max) that is 0, not NaN, when both are -inf (every input empty).
__device__ __forceinline__ float exp_minus(float x, float max) {
  return max == neg_inf() ? 0.f : __expf(x - max);
}

}  // namespace cuattn
