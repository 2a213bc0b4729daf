// The online softmax of a warp's query rows in mma.sync's accumulator layout (WarpSoftmax over
// common/softmax.cuh's SoftmaxState), shared by both forward kernels; the sinks join at finish().
#pragma once
#include "common/softmax.cuh"
#include "common/mma.cuh"

namespace cuattn {

// Rows (mt, g) and (mt, g + 8) of this thread, in raw-score units (scale = scale_log2);
// each state's sum is this thread's part (its columns only), added over the quad in finish().
template <typename Tr>
struct WarpSoftmax {
  static constexpr int M_TILES = Tr::M_TILES;
  SoftmaxState row[M_TILES][2];
  float scale;

  __device__ __forceinline__ explicit WarpSoftmax(float scale_log2) : scale(scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) row[mt][0] = row[mt][1] = SoftmaxState::empty();
  }

  // One tile of S (scores, -inf where masked) -> P = exp2(scale * S - base) in place; O and
  // the sums rescaled to the new row max. EARLY_PACK: P of each m16 tile is also packed to
  // T into `p_pack` as soon as its two row halves are done (half the registers of the fp32
  // S from there to O += P V); MAY_BE_EMPTY = false (EARLY_PACK without a band) drops the
  // -inf guard on the row max: then every tile a block visits holds a key < seqlen_k, so
  // each row max is finite from the first tile on.
  template <bool MAY_BE_EMPTY, typename PPack>
  __device__ __forceinline__ void update(float (&s)[M_TILES][Tr::S_N_TILES][4],
                                         float (&o_acc)[M_TILES][Tr::O_N_TILES][4],
                                         PPack& p_pack) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        SoftmaxState& st = row[mt][hr];
        const float mx = row_max(s, mt, hr);
        const float b = SoftmaxState::base<MAY_BE_EMPTY>(mx, scale);
        // Branch-free: alpha = 1 exactly when the max stayed (the same product twice), 0
        // from -inf. Otherwise only a row whose max moved (from -inf or up, so to a finite
        // value) rescales.
        if (Tr::BRANCH_FREE_RESCALE || mx != st.max) {
          const float alpha = Tr::BRANCH_FREE_RESCALE ? st.rescale(mx, scale, b)
                                                      : st.rescale_finite(mx, scale);
#pragma unroll
          for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
            o_acc[mt][nt][2 * hr] *= alpha;
            o_acc[mt][nt][2 * hr + 1] *= alpha;
          }
        }
        st.sum += row_exp(s, mt, hr, b - Tr::P_SHIFT);
      }
      if constexpr (Tr::EARLY_PACK) {
#pragma unroll
        for (int kk = 0; kk < Tr::PV_K_STEPS; ++kk) pack_p(p_pack[mt][kk], s, mt, kk);
      }
    }
  }

  // update() for a caller that rescales its accumulator later (the Hopper kernel, whose
  // previous O += P V may still be in flight): P in place, the sums moved to the new row
  // max, and alpha[mt][hr], the factor row (mt, hr)'s accumulator takes. Branch-free form.
  // TILE_MAX: the caller passes each row's max over this thread's columns of the tile
  // (tile_max) instead of its being read off s: the hook of the raw scores' max for a
  // monotone logits hook (Logits::of_max), so that no exp2 waits for the whole tile's hook.
  template <bool MAY_BE_EMPTY, bool TILE_MAX = false>
  __device__ __forceinline__ void update_scores(float (&s)[M_TILES][Tr::S_N_TILES][4],
                                                float (&alpha)[M_TILES][2],
                                                const float (&tile_max)[M_TILES][2] = {}) {
    static_assert(Tr::BRANCH_FREE_RESCALE, "alpha for every row, every tile");
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        SoftmaxState& st = row[mt][hr];
        const float mx = TILE_MAX ? quad_max(fmaxf(st.max, tile_max[mt][hr])) : row_max(s, mt, hr);
        const float b = SoftmaxState::base<MAY_BE_EMPTY>(mx, scale);
        alpha[mt][hr] = st.rescale(mx, scale, b);
        st.sum += row_exp(s, mt, hr, b - Tr::P_SHIFT);
      }
    }
  }

  // The two halves of a row's update: its new max over this tile (this thread's columns,
  // then the quad's), and P = exp2(scale * S - b) in place with this thread's part of the
  // row sum.
  __device__ __forceinline__ float row_max(const float (&s)[M_TILES][Tr::S_N_TILES][4], int mt,
                                           int hr) const {
    return quad_max(thread_max(s, mt, hr, row[mt][hr].max));
  }
  // The max of `mx` and row (mt, hr)'s scores in this thread's columns of the tile.
  static __device__ __forceinline__ float thread_max(const float (&s)[M_TILES][Tr::S_N_TILES][4],
                                                     int mt, int hr, float mx = neg_inf()) {
#pragma unroll
    for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
      mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hr], s[mt][nt][2 * hr + 1]));
    }
    return mx;
  }
  // The max over the quad that holds a row (its four threads' columns).
  static __device__ __forceinline__ float quad_max(float mx) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  }
  __device__ __forceinline__ float row_exp(float (&s)[M_TILES][Tr::S_N_TILES][4], int mt, int hr,
                                           float b) const {
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < Tr::S_N_TILES; ++nt) {
#pragma unroll
      for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
        const float pe = SoftmaxState::weight(s[mt][nt][e], scale, b);
        s[mt][nt][e] = pe;
        sum += pe;
      }
    }
    return sum;
  }

  // P of k16 step kk of m16 tile mt, packed to T: the A operand of O += P V. (The Hopper
  // kernel's e4m3 form packs its k32 steps itself: flash_fwd_sm90.cuh, pack_p_e4m3.)
  static __device__ __forceinline__ void pack_p(u32 (&pf)[4],
                                                const float (&s)[M_TILES][Tr::S_N_TILES][4],
                                                int mt, int kk) {
    using T = typename Tr::T;
    pf[0] = pack_pair<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
    pf[1] = pack_pair<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
    pf[2] = pack_pair<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
    pf[3] = pack_pair<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
  }

  // Whole rows at the end of a row tile (both forwards' tail): the quad's parts of each sum
  // added, each row's normaliser and lse. The sinks join here (WITH_SINKS), or (SPLIT) once,
  // in the combine: row (mt, hr)'s sink logit sink[mt][hr] (raw-score units) joins the
  // denominator as a state {sink, 1} of no value; the merged max may move, so inv_sum also
  // carries the factor that rescales the row's accumulator. Where V entered O += P V unscaled
  // (SCALE_V: the mma.sync kernel's FP8_CACHE, the Hopper kernel's E4M3), inv_sum takes
  // v_scale() too (a callable: read only then; by reference, as a closure passed by value
  // changed the Hopper kernel's code).
  static constexpr bool WITH_SINKS = Tr::SINKS && !Tr::SPLIT;
  struct Rows {
    float inv_sum[M_TILES][2];
    float lse[M_TILES][2];
  };
  template <bool SCALE_V, typename VScale>
  __device__ __forceinline__ Rows finish(const float (&sink)[M_TILES][2], VScale&& v_scale) {
    Rows r;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        SoftmaxState& st = row[mt][hr];
        st.sum += __shfl_xor_sync(0xffffffffu, st.sum, 1);
        st.sum += __shfl_xor_sync(0xffffffffu, st.sum, 2);
        // (P_SHIFT: the sum and the accumulator carry 2^P_SHIFT; the state takes the true sum)
        constexpr float P_UNIT = 1.f / (1 << Tr::P_SHIFT);
        if constexpr (Tr::P_SHIFT != 0) st.sum *= P_UNIT;
        const float alpha = WITH_SINKS ? st.add_sink(sink[mt][hr], scale) : 1.f;
        r.inv_sum[mt][hr] = alpha * st.inv_sum();
        if constexpr (Tr::P_SHIFT != 0) r.inv_sum[mt][hr] *= P_UNIT;
        r.lse[mt][hr] = st.lse(scale);
      }
    }
    if constexpr (SCALE_V) {
      const float vs = v_scale();
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        r.inv_sum[mt][0] *= vs;
        r.inv_sum[mt][1] *= vs;
      }
    }
    return r;
  }
};

}  // namespace cuattn
