// Logits hooks: what a kernel does to a score, in its softmax units, after Q K^T and before
// the mask and the softmax (FlashInfer's LogitsTransform). A kernel's traits name its hook;
// one with ACTIVE = false compiles to nothing. q_pos and k_pos are the positions of the
// query and the key in the sequence. The kernel builds a hook per query head from the values
// it needs (and reads them only for the parts that are on).
//
// Two parts, in FlashAttention-2's order (softcap, then the ALiBi bias):
//   softcap (Gemma 2): a scaled score s becomes cap * tanh(s / cap). In the kernel's units
//     u = s / unit (flash_fwd keeps raw scores: unit = softmax_scale; paged keeps log2
//     units: unit = 1 / log2(e)) that is u -> cap_out * tanh(u * cap_in) with
//     cap_in = unit / cap and cap_out = cap / unit.
//   ALiBi (Press et al. 2022): - slope * |k_pos - q_pos|, the slope of the query's head in
//     the kernel's units (FlashAttention-2's bias; for keys at or before the query, as in
//     causal attention and decode, it is slope * (k_pos - q_pos)).
#pragma once

namespace cuattn {

// tanh on the MUFU unit (sm_75+): max relative error 2^-10.99, FlashAttention-2's
// cutlass::fast_tanh.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <bool SOFTCAP, bool ALIBI>
struct LogitsHook {
  static constexpr bool ACTIVE = SOFTCAP || ALIBI;
  // Softcap alone is increasing in the score and the same for every position, so the
  // hooked max of a row is the hook of its raw max (of_max).
  static constexpr bool MONOTONE = SOFTCAP && !ALIBI;
  float slope;     // ALiBi, in the kernel's units
  float cap_in;    // softcap: unit / cap
  float cap_out;   // softcap: cap / unit

  __device__ __forceinline__ explicit LogitsHook(float slope_ = 0.f, float cap_in_ = 0.f,
                                                 float cap_out_ = 0.f)
      : slope(slope_), cap_in(cap_in_), cap_out(cap_out_) {}

  __device__ __forceinline__ float operator()(float x, int q_pos, int k_pos) const {
    if constexpr (SOFTCAP) x = cap_out * tanh_approx(x * cap_in);
    if constexpr (ALIBI) x -= slope * fabsf(float(k_pos - q_pos));
    return x;
  }

  // The same with its derivative d hook / d x beside it (the backward's chain rule):
  // softcap's 1 - tanh^2 (cap_out * cap_in = 1), ALiBi's 1.
  __device__ __forceinline__ float operator()(float x, int q_pos, int k_pos, float& dx) const {
    dx = 1.f;
    if constexpr (SOFTCAP) {
      const float t = tanh_approx(x * cap_in);
      x = cap_out * t;
      dx = fmaf(-t, t, 1.f);
    }
    if constexpr (ALIBI) x -= slope * fabsf(float(k_pos - q_pos));
    return x;
  }

  // MONOTONE: the max of the hooked scores from the max of the raw ones (-inf: none).
  __device__ __forceinline__ float of_max(float raw_max) const {
    static_assert(MONOTONE, "a hook that is increasing and the same at every position");
    return raw_max == -__int_as_float(0x7f800000) ? raw_max : (*this)(raw_max, 0, 0);
  }
};

using NoLogitsHook = LogitsHook<false, false>;

}  // namespace cuattn
