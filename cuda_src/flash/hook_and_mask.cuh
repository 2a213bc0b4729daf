// The logits hook and the mask on one tile of scores in mma.sync's accumulator layout (both
// forward kernels: the Hopper kernel's consumers hold their scores in the same layout).
#pragma once
#include "common/softmax.cuh"   // neg_inf

namespace cuattn {

// Row (mt, hr) of this thread (rows g and g + 8 of m16 tile mt) is query row_of(mt, hr) (the
// mask's row index) with logits hook hook_of(mt, hr); element e of its n8 tile nt is key
// key0 + 8 nt + 2 t4 + e % 2. The hook on every score, then, on a boundary tile (masked),
// -inf for keys past the sequence or outside the band.
template <typename Tr, typename RowOf, typename HookOf>
__device__ __forceinline__ void hook_and_mask(float (&s)[Tr::M_TILES][Tr::S_N_TILES][4],
                                              bool masked, int key0, int t4,
                                              const typename Tr::Mask& mask, int sk,
                                              RowOf row_of, HookOf hook_of) {
  if (Tr::Logits::ACTIVE || masked) {
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row_of(mt, e / 2);
          const int j = key0 + nt * 8 + 2 * t4 + (e % 2);
          if (Tr::Logits::ACTIVE) s[mt][nt][e] = hook_of(mt, e / 2)(s[mt][nt][e], i + mask.diag, j);
          if (masked && !mask.visible(i, j, sk)) s[mt][nt][e] = neg_inf();
        }
      }
    }
  }
}

}  // namespace cuattn
