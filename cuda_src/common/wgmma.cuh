// Hopper (sm_90a) warpgroup plumbing: shared-memory matrix descriptors (128-byte-swizzled
// tiles, 32-byte-swizzled rows, no-swizzle core matrices), the wgmma fence / commit / wait,
// mbarriers (the producer / consumer pipeline), TMA tensor copies, setmaxnreg and named
// barriers. The instructions are wrapped by common/wgmma_ops.cuh; layouts follow the PTX ISA
// ("Matrix Descriptor Format", "Shared Memory Matrix Layout"), as CUTLASS's GmmaDescriptor
// and fast.cu encode them.
#pragma once
#include "wgmma_ops.cuh"

namespace cuattn {

using u64 = unsigned long long;

// ---- 128-byte-swizzled tiles ----------------------------------------------------------------
// A tile of ROWS rows x D 16-bit columns is stored as D / 64 column blocks, each ROWS rows of
// 128 bytes (64 columns), and 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its
// row: the Swizzle<3,4,3> that wgmma's 128-byte mode expects of a 1024-byte-aligned tile.
// The byte offset of 16-byte chunk `ch` (8 columns) of row r:
template <int ROWS>
__device__ __forceinline__ u32 sw128_offset(int r, int ch) {
  return (ch / 8) * (ROWS * 128) + r * 128 + (((ch % 8) ^ (r % 8)) << 4);
}

// Descriptor of a 128-byte-swizzled operand starting at shared address `addr`:
//   K-major (rows = M or N, 64 K columns per 128-byte row): SBO = 1024 (8-row groups),
//     LBO unused (1); the k16 step s of a column block starts 32 s bytes in.
//   MN-major (rows = K, the MN columns contiguous; B of O += P V with V as [key][dim]):
//     SBO = 1024 (8-key groups), LBO = the bytes between 64-column blocks.
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo_bytes = 16) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo_bytes >> 4) << 16) |
         ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

// Descriptor of a K-major operand without swizzle (layout type 0) at `addr`: 8-row x 16-byte
// core matrices of 128 contiguous bytes, `lbo_bytes` apart along K (the next 8 columns) and
// `sbo_bytes` apart along M / N (the next 8 rows); the tile of vLLM's paged K and V
// (flash_fwd_sm90.cuh).
__device__ __forceinline__ u64 plain_desc(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo_bytes >> 4) << 16) |
         ((u64)(sbo_bytes >> 4) << 32);
}

// Descriptor of a K-major operand of 32-byte-swizzled rows (layout type 3): rows of 16
// 16-bit K columns (one k16 step), 8-row groups 256 bytes apart (SBO); LBO unused (1).
// The tile of vLLM's paged V, blocks of 16 keys and more (flash_fwd_sm90.cuh).
__device__ __forceinline__ u64 sw32_desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(256 >> 4) << 32) | (3ull << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) past desc's: its start field is
// the address / 16 in 14 bits, which every shared address fits, so the sum never carries.
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

// stmatrix x4 (the inverse of ldmatrix_x4, common/mma.cuh): lane l gives the address of row
// (l % 8) of 8x8 b16 matrix (l / 8); register i holds matrix i's row l / 4, elements
// 2 (l % 4) and 2 (l % 4) + 1.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// threadIdx.x read anew at each use (asm volatile: neither hoisted nor merged), for a value
// the compiler would otherwise hold in a register across a long loop, or spill.
__device__ __forceinline__ int thread_index_now() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

// x as this point of the program has it (asm volatile: the compiler neither hoists the
// value's computation out of a loop nor keeps it live from an earlier one), for a
// parameter a thread with few registers should re-read where used rather than hold.
__device__ __forceinline__ int value_now(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// ---- ordering --------------------------------------------------------------------------------
// Before a wgmma whose accumulators (or register A) ordinary instructions wrote.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Keep the compiler from moving reads or writes of accumulators across a wait: each register
// is "rewritten" here, after the wait in program order.
template <int R, int C>
__device__ __forceinline__ void fence_regs(float (&d)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
#pragma unroll
    for (int j = 0; j < C; ++j) asm volatile("" : "+f"(d[i][j]) :: "memory");
  }
}

// Orders this thread's generic-proxy shared-memory writes (st.shared, cp.async) before
// later async-proxy accesses (wgmma operands, TMA) of the same memory.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- mbarriers (PTX ISA "Parallel Synchronization and Communication: mbarrier") ------------
// A barrier completes a phase when `count` arrivals have landed; waiters name the parity
// of the phase they wait for (a fresh barrier counts its phase "-1", parity 1, as complete,
// so a producer's first wait on an empty slot passes at once).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// Makes the barriers initialised by this thread visible to the others (before a barrier).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
// One arrival once every cp.async this thread issued so far has landed (the barrier's
// count includes it: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  u32 done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// One arrival that also expects `bytes` more to land by complete_tx (a TMA copy's).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(bar), "r"(bytes) : "memory");
}

// ---- TMA (PTX ISA "Tensor copy": cp.async.bulk.tensor) ---------------------------------------
// A tensor map as cuTensorMapEncodeTiled writes it on the host (CUtensorMap: 128 opaque bytes,
// 64-byte aligned; NVRTC has no cuda.h). Kernels take them as __grid_constant__ parameters.
struct alignas(64) TmaDescriptor {
  unsigned long long opaque[16];
};

__device__ __forceinline__ void tma_prefetch(const TmaDescriptor& map) {
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<u64>(&map)) : "memory");
}
// Copy the box at element coordinates (c0 innermost .. c3) of a 4-d tensor map to shared
// address `dst` (the map's swizzle applied); its bytes complete_tx on `bar`. Elements out of
// the tensor's bounds land as zeros.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDescriptor& map, u32 bar, int c0,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2),
         "r"(c3)
      : "memory");
}

// The same for a 5-d tensor map.
__device__ __forceinline__ void tma_load_5d(u32 dst, const TmaDescriptor& map, u32 bar, int c0,
                                            int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
      :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2),
         "r"(c3), "r"(c4)
      : "memory");
}

// ---- registers and named barriers -------------------------------------------------------------
// Move this warpgroup's register allocation to N per thread (every thread of the warpgroup
// executes it; the kernel needs a register cap at entry: __launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
// Barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (whole warps).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// Arrive on barrier `id` without waiting (the threads that sync on it wait for these).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

}  // namespace cuattn
