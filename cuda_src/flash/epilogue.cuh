// The two epilogues of a forward row tile, shared by both forward kernels: the output
// (store_output) or, split-KV, the fp32 partials the combine merges (store_partials), each
// from the rows WarpSoftmax::finish gives.
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "flash/seqlen.cuh"
#include "flash/softmax.cuh"

namespace cuattn {

// Split-KV: the warp's normalised fp32 partial rows and their lse into oaccum / lseaccum.
template <typename Tr>
__device__ __forceinline__ void store_partials(
    const FlashFwdParams& p, const typename WarpSoftmax<Tr>::Rows& rows,
    const float (&o_acc)[Tr::M_TILES][Tr::O_N_TILES][4], int b, const QueryRows<Tr::PACK_GQA>& qrows,
    int num_rows, int split, const SeqRange& qr, int m0, int warp, int g, int t4,
    int head_dim_chunks) {
  const long long row_base = (p.cu_seqlens_q == nullptr ? (long long)b * p.seqlen_q : 0) +
                             qr.start;
  float* oacc = static_cast<float*>(p.oaccum);
  float* lacc = static_cast<float*>(p.lseaccum);
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int R = m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8;
      if (R >= num_rows) continue;
      const int h = qrows.head(R);
      const float inv = rows.inv_sum[mt][hr];
      const long long tok = row_base + qrows.token(R);
      float* orow = oacc + (((long long)split * p.total_q + tok) * p.num_heads + h) * p.head_dim;
#pragma unroll
      for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
        if (nt < head_dim_chunks) {
          float2 v2 = make_float2(o_acc[mt][nt][2 * hr] * inv, o_acc[mt][nt][2 * hr + 1] * inv);
          *reinterpret_cast<float2*>(orow + nt * 8 + 2 * t4) = v2;
        }
      }
      if (t4 == 0) {
        lacc[((long long)split * p.num_heads + h) * p.total_q + tok] = rows.lse[mt][hr];
      }
    }
  }
}

// The output: O -> T in this warp's own rows of a BLOCK_M x HEAD_DIM shared-memory tile at
// smem_o (flash_fwd_kernel: the Q tile), then 16-byte stores; and the lse when asked.
template <typename Tr>
__device__ __forceinline__ void store_output(
    const FlashFwdParams& p, const typename WarpSoftmax<Tr>::Rows& rows,
    const float (&o_acc)[Tr::M_TILES][Tr::O_N_TILES][4], u32 smem_o, int b,
    const QueryRows<Tr::PACK_GQA>& qrows, int num_rows, const SeqRange& qr, int m0, int warp,
    int lane, int g, int t4, int head_dim_chunks) {
  using T = typename Tr::OutT;
  constexpr int D_CHUNKS = Tr::D_CHUNKS;
  // The warp's last ldmatrix of Q read these rows (in the key loop, or before it when the
  // loop ran no tile and so no barrier came between): order those reads before the writes.
  // (compute-sanitizer racecheck flagged the missing barrier on rows that see no key.)
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = warp * Tr::WARP_M + mt * 16 + g + hr * 8;
      const float inv = rows.inv_sum[mt][hr];
#pragma unroll
      for (int nt = 0; nt < Tr::O_N_TILES; ++nt) {
        const u32 packed = pack_pair<T>(o_acc[mt][nt][2 * hr] * inv, o_acc[mt][nt][2 * hr + 1] * inv);
        const u32 addr = smem_o + swizzled_offset<D_CHUNKS>(r, nt) + t4 * 4;
        asm volatile("st.shared.u32 [%0], %1;\n" :: "r"(addr), "r"(packed));
      }
    }
  }
  __syncwarp();
  T* o_ptr = static_cast<T*>(p.out) + b * p.o_stride_batch +
             (long long)qr.start * p.o_stride_row;
  const int row0 = warp * Tr::WARP_M;
#pragma unroll (Tr::STORE_UNROLL)
  for (int it = 0; it < Tr::Q_LOADS_PER_LANE; ++it) {
    const int c = it * 32 + lane;
    const int r = row0 + c / D_CHUNKS, ch = c % D_CHUNKS;
    const int R = m0 + r;
    if (R < num_rows && ch < head_dim_chunks) {
      Vec16 v16;
      const u32 addr = smem_o + swizzled_offset<D_CHUNKS>(r, ch);
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v16.raw.x), "=r"(v16.raw.y), "=r"(v16.raw.z), "=r"(v16.raw.w)
                   : "r"(addr));
      store16(o_ptr + (long long)qrows.token(R) * p.o_stride_row +
                  qrows.head(R) * p.o_stride_head + ch * 8,
              v16);
    }
  }
  if (p.lse != nullptr && t4 == 0) {
    float* lse_ptr = static_cast<float*>(p.lse) + b * p.lse_stride_batch +
                     (long long)qr.start * p.lse_stride_row;
#pragma unroll
    for (int mt = 0; mt < Tr::M_TILES; ++mt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int R = m0 + warp * Tr::WARP_M + mt * 16 + g + hr * 8;
        if (R < num_rows) {
          lse_ptr[(long long)qrows.token(R) * p.lse_stride_row +
                  qrows.head(R) * p.lse_stride_head] = rows.lse[mt][hr];
        }
      }
    }
  }
}

}  // namespace cuattn
