// Which keys a query row sees: every key, a causal band aligned to the bottom-right corner,
// or a (left, right) window around that diagonal (FlashAttention >= 2.1's conventions).
// Query i of sq sees key j of sk when j < sk and, with diag = sk - sq,
//   causal: j <= i + diag;   window: i + diag - left <= j <= i + diag + right.
#pragma once

namespace cuattn {

enum : int { kMaskNone = 0, kMaskCausal = 1, kMaskWindow = 2 };

template <int MASK>
struct BandMask {
  static_assert(MASK == kMaskNone || MASK == kMaskCausal || MASK == kMaskWindow, "mask kind");
  static constexpr bool BAND = MASK != kMaskNone;      // a right edge (causal or window)
  static constexpr bool LEFT = MASK == kMaskWindow;    // a left edge too

  int diag;    // sk - sq: the bottom-right alignment
  int left;    // window only (a huge value = unbounded)
  int right;   // 0 for causal; window only otherwise

  __device__ __forceinline__ BandMask(int sq, int sk, int window_left, int window_right)
      : diag(sk - sq), left(LEFT ? window_left : 0),
        right(MASK == kMaskWindow ? window_right : 0) {}

  // For query rows [i0, i1] of a tile: the keys [begin, end) any row sees, and the keys
  // [full_begin, full_end) every row sees (their tiles need no mask).
  struct Range {
    int begin, end, full_begin, full_end;
  };
  __device__ __forceinline__ Range keys(int i0, int i1, int sk) const {
    Range r{0, sk, 0, sk};
    if (BAND) {
      r.end = min(sk, i1 + diag + right + 1);
      r.full_end = max(0, min(sk, i0 + diag + right + 1));
    }
    if (LEFT) {
      r.begin = max(0, i0 + diag - left);
      r.full_begin = max(0, i1 + diag - left);
    }
    return r;
  }

  // The mirror for the backward: for keys [j0, j1] of a tile (j1 < sk) and queries [0, sq),
  // the rows [begin, end) that see any of them and [full_begin, full_end) that see all.
  __device__ __forceinline__ Range rows(int j0, int j1, int sq) const {
    Range r{0, sq, 0, sq};
    if (BAND) {
      r.begin = max(0, j0 - diag - right);
      r.full_begin = max(0, j1 - diag - right);
    }
    if (LEFT) {
      r.end = min(sq, j1 - diag + left + 1);
      r.full_end = max(0, min(sq, j0 - diag + left + 1));
    }
    return r;
  }

  __device__ __forceinline__ bool visible(int i, int j, int sk) const {
    bool ok = j < sk;
    if (BAND) ok = ok && j <= i + diag + right;
    if (LEFT) ok = ok && j >= i + diag - left;
    return ok;
  }
};

}  // namespace cuattn
