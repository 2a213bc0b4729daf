// The key tiles a forward block visits: the band its rows see under the mask, cut to its
// split-KV share, the boundary tiles (which need the mask) first, then the unmasked middle.
#pragma once
#include "common/mask.cuh"

namespace cuattn {

// The band of the tile's rows [m0, m_last] under its mask, cut to this block's split. Tiles
// in [full_lo, full_hi) need no mask (every key visible to every valid row). Visiting
// order: the boundary tiles first (left ones, then right ones: the diagonal sets the row
// max early), then the unmasked middle; step n visits tile_of(n).
struct KeyTiles {
  int s_lo, full_lo, full_hi;
  int n_left;     // boundary tiles left of the unmasked middle
  int n_masked;   // all boundary tiles
  int n_steps;

  __device__ __forceinline__ int tile_of(int n) const {
    return n < n_left ? s_lo + n : (n < n_masked ? full_hi + (n - n_left)
                                                 : full_lo + (n - n_masked));
  }
};

template <typename Tr>
__device__ __forceinline__ KeyTiles key_tiles(const typename Tr::Mask& mask, int m0, int m_last,
                                              int sk, int split, int num_splits) {
  constexpr int BN = Tr::BLOCK_N;
  const auto keys = mask.keys(m0, m_last, sk);
  const int t_lo = keys.begin / BN;
  const int t_hi = keys.end > keys.begin ? (keys.end + BN - 1) / BN : t_lo;
  int s_lo = t_lo, s_hi = t_hi;
  if (Tr::SPLIT) {
    const int per_split = (t_hi - t_lo + num_splits - 1) / num_splits;
    s_lo = min(t_hi, t_lo + split * per_split);
    s_hi = min(t_hi, s_lo + per_split);
  }
  KeyTiles t;
  t.s_lo = s_lo;
  t.full_lo = min(max((keys.full_begin + BN - 1) / BN, s_lo), s_hi);
  t.full_hi = min(max(keys.full_end / BN, t.full_lo), s_hi);
  t.n_left = t.full_lo - s_lo;
  t.n_masked = t.n_left + (s_hi - t.full_hi);
  t.n_steps = s_hi - s_lo;
  return t;
}

}  // namespace cuattn
