// Tensor-core and asynchronous-copy primitives for sm_80+ (Ampere, Ada, Hopper without
// wgmma): mma.sync m16n8k16 with fp32 accumulators, ldmatrix (x4, .trans), cp.async with
// zero fill, and the XOR swizzle that makes 16-byte-chunk tiles bank-conflict-free.
// Fragment layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k16").
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cuattn {

using u32 = unsigned int;   // NVRTC has no <stdint.h>

// ---- 16-bit pairs ----------------------------------------------------------------------

// Two floats -> one 32-bit register holding two T (low half = first), the A operand
// layout of mma.sync.
template <typename T> __device__ __forceinline__ u32 pack_pair(float lo, float hi);
template <> __device__ __forceinline__ u32 pack_pair<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<u32*>(&h);
}
template <> __device__ __forceinline__ u32 pack_pair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&h);
}

// Four floats -> four e4m3 bytes (x0 in the low byte), nearest even, saturated to +-448: the
// A operand of an e4m3 wgmma (flash_fwd_sm90.cuh's FP8 form).
__device__ __forceinline__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return u32(lo) | (u32(hi) << 16);
}

// One 32-bit register of two T -> two floats (the inverse of pack_pair).
template <typename T> __device__ __forceinline__ float2 unpack_pair(u32 x);
template <> __device__ __forceinline__ float2 unpack_pair<__half>(u32 x) {
  return __half22float2(*reinterpret_cast<__half2*>(&x));
}
template <> __device__ __forceinline__ float2 unpack_pair<__nv_bfloat16>(u32 x) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
}

// ---- mma.sync.aligned.m16n8k16.row.col, fp32 accumulate --------------------------------
// With g = lane / 4 and t = lane % 4:
//   A (16x16, row-major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
//                         a[3] = (g+8, 2t+8..)
//   B (16x8, "col" = stored N x K): b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
//   C (16x8): c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
template <typename T> struct MmaOp;
template <> struct MmaOp<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4],
                                             u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct MmaOp<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4],
                                             u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const u32 (&a)[4],
                                             u32 b0, u32 b1) {
  MmaOp<T>::run(c, a, b0, b1);
}

// ---- ldmatrix ---------------------------------------------------------------------------
// x4: lane l gives the address of row (l % 8) of 8x8 matrix (l / 8); register i receives
// matrix i with thread l holding row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1.
// .trans delivers the transpose: thread l holds column l / 4, rows 2 (l % 4), +1.
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- movmatrix ----------------------------------------------------------------------------
// An 8x8 matrix of 16-bit pairs in the mma fragment layout (lane l: row l / 4, columns
// 2 (l % 4), +1) -> its transpose in the same layout.
__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
  u32 y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---- cp.async (global -> shared, 16 bytes, L2 only) ---------------------------------------
// src_bytes < 16 fills the rest of the 16 bytes with zeros (0 = a pure zero fill; the
// source address must still be a valid one).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes));
}
// 8 bytes (through L1: .cg takes 16 only); src_bytes < 8 zero-fills the rest.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes));
}
// 4 bytes (through L1); src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes));
}
// The same with an L2 cache policy (from l2_evict_first_policy): for data read exactly once,
// such as a KV cache in decode, so that its lines are the first to go and neither evict
// lines the next kernels want nor wait on dirty lines being written back.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes,
                                            unsigned long long policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
}
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// ---- swizzle -----------------------------------------------------------------------------
// A tile of rows of CHUNKS 16-byte chunks. ldmatrix reads one chunk column of 8
// consecutive rows at once, cp.async writes 8 consecutive chunks per quarter warp; both
// are conflict-free when the 8 chunks land in 8 different 16-byte bank groups.
//   CHUNKS % 8 == 0 (rows of >= 128 bytes): chunk ^ (row % 8).
//   CHUNKS % 8 == 4 (64, 192, 320 ... bytes): two rows share a 128-byte line in
//   alternating halves; chunk ^ ((row / 2) % 4) within each group of four chunks.
template <int CHUNKS>
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) {
  static_assert(CHUNKS % 4 == 0, "swizzled rows must hold a multiple of 4 chunks (64 bytes)");
  if constexpr (CHUNKS % 8 == 0) {
    return chunk ^ (row & 7);
  } else {
    return chunk ^ ((row >> 1) & 3);
  }
}

// Byte offset of (row, chunk) in a swizzled tile.
template <int CHUNKS>
__device__ __forceinline__ u32 swizzled_offset(int row, int chunk) {
  return static_cast<u32>((row * CHUNKS + swizzle_chunk<CHUNKS>(row, chunk)) * 16);
}

// ldmatrix walks a fixed lane pattern over k/n steps: lane l reads row (row0 + l-fixed
// part) and logical chunk 2 s + c(l) at step s. The swizzle XOR only touches the low
// log2(PERIOD) bits of the chunk and depends on row % 8, which the step does not change,
// so the physical chunk is (2 s) & ~(PERIOD - 1) plus one of PERIOD / 2 lane-dependent
// values: precompute those (a few registers) instead of one address per step.
// COMPACT: one register instead of PERIOD / 2, and one XOR per step: since 2 s is even and
// c is 0 or 1, (2 s + c) ^ sw = (2 s) ^ (c ^ sw) on the low bits, so the in-period offset of
// step s is lane_off[0] ^ ((2 s) % PERIOD) * 16.
template <int CHUNKS, bool COMPACT = false>
struct SwizzledSteps {
  static constexpr int PERIOD = CHUNKS % 8 == 0 ? 8 : 4;
  static constexpr int N = COMPACT ? 1 : PERIOD / 2;
  u32 lane_off[N];   // byte offset of chunk (2 j + c) ^ swizzle, within its period

  __device__ __forceinline__ SwizzledSteps(int row, int c) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      lane_off[j] = static_cast<u32>((swizzle_chunk<CHUNKS>(row, 2 * j + c) & (PERIOD - 1)) * 16);
    }
  }
  // Byte offset of step s within a row (add row * CHUNKS * 16 for the row).
  __device__ __forceinline__ u32 at(int s) const {
    if constexpr (COMPACT) {
      return static_cast<u32>(((2 * s) & ~(PERIOD - 1)) * 16) +
             (lane_off[0] ^ static_cast<u32>(((2 * s) & (PERIOD - 1)) * 16));
    } else {
      return static_cast<u32>(((2 * s) & ~(PERIOD - 1)) * 16) + lane_off[s % N];
    }
  }
};

}  // namespace cuattn
