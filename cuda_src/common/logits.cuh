// Logits hooks: what a kernel does to a score, in its softmax units, after Q K^T and before
// the mask and the softmax (FlashInfer's LogitsTransform). A kernel's traits name its hook;
// one with ACTIVE = false compiles to nothing. q_pos and k_pos are the positions of the
// query and the key in the sequence. Hooks are built from the per-head value they need (the
// kernel reads it only when the hook is ACTIVE).
#pragma once

namespace cuattn {

struct NoLogitsHook {
  static constexpr bool ACTIVE = false;
  __device__ __forceinline__ explicit NoLogitsHook(float /*slope*/ = 0.f) {}
  __device__ __forceinline__ float operator()(float x, int /*q_pos*/, int /*k_pos*/) const {
    return x;
  }
};

// ALiBi (Press et al. 2022): x + slope * (k_pos - q_pos), the slope of the query's head in
// the kernel's softmax units.
struct AlibiHook {
  static constexpr bool ACTIVE = true;
  float slope;
  __device__ __forceinline__ explicit AlibiHook(float s = 0.f) : slope(s) {}
  __device__ __forceinline__ float operator()(float x, int q_pos, int k_pos) const {
    return x + slope * float(k_pos - q_pos);
  }
};

// A kernel templated on ALIBI (true / false) takes its hook from here.
template <bool ALIBI> struct AlibiOrNone { using type = NoLogitsHook; };
template <> struct AlibiOrNone<true> { using type = AlibiHook; };

}  // namespace cuattn
