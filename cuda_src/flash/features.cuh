// The knobs the flash kernels' traits share: where K and V come from (kKv*) and the FEATURES
// bits (kSoftcap ..), read by every forward and backward traits type through FlashFeatures.
#pragma once
#include "common/logits.cuh"

namespace cuattn {

// Where K and V come from (FlashFwdTraits KV; params/flash_fwd.cuh has the layouts).
enum : int { kKvDense = 0, kKvPagedNhd = 1, kKvPagedVllm = 2 };
// What a kernel does beyond plain attention (the traits' FEATURES, bits).
enum : int { kSoftcap = 1, kAlibi = 2, kSinks = 4, kPackGqa = 8 };

// The FEATURES bits as the flash kernels' traits read them (their base).
template <int FEATURES>
struct FlashFeatures {
  static constexpr bool SOFTCAP = (FEATURES & kSoftcap) != 0;
  static constexpr bool ALIBI = (FEATURES & kAlibi) != 0;
  static constexpr bool SINKS = (FEATURES & kSinks) != 0;
  static constexpr bool PACK_GQA = (FEATURES & kPackGqa) != 0;
  using Logits = LogitsHook<SOFTCAP, ALIBI>;            // the logits hook point
};

}  // namespace cuattn
