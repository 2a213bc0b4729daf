"""Probe (lab, one warpgroup): the building blocks of the FP8 forward (issue 36, bench/NOTES.md
"FP8 forward ... the design") before they go into flash_fwd_sm90.cuh.

Checks, hd 128, 64 query rows, 128 keys, e4m3:
  S = Q K^T on `Wgmma<__nv_fp8_e4m3, 128>::ss` (k32; Q and K 128-byte swizzled, K-major, the
  forward's descriptor arithmetic) matches NumPy's float64 product (within the FP8 tensor
  cores' accumulation, main());
  V^T made in shared memory from a row-major V tile by 4 x 4-byte blocks (ld.shared.b32,
  prmt, st.shared.b32), its keys permuted within each 32-key group (phys(L) below);
  P = p_mul x S packed to e4m3 straight from the accumulators (cvt.rn.satfinite.e4m3x2.f32,
  no shuffles: the permutation puts each thread's own keys where the A fragment wants them)
  and O = P V on `Wgmma<__nv_fp8_e4m3, 128>::rs` matches NumPy's quantize(P) @ V.

    PYTHONPATH=. python bench/lab/fp8_wgmma_probe.py
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, ".")

from cuattn.jit import compiler                            # noqa: E402
from tests.reference import quantize_e4m3                # noqa: E402

M, BN, D = 64, 128, 128
SMEM_BYTES = 1024 + 8192 + 3 * 16384
SRC = r"""
#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "common/wgmma_fp8_ops.cuh"
using namespace cuattn;
using fp8 = __nv_fp8_e4m3;
constexpr int M = 64, BN = 128, D = 128;   // D and BN: one 128-byte column block

// The key a logical position L (0..31) of a 32-key group holds: the A fragment's columns
// 4 t .. 4 t + 3 of thread t are the accumulator's keys 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t.
__device__ __forceinline__ int phys(int L) {
  return 16 * (L / 16) + 2 * ((L % 16) / 4) + (L % 2) + 8 * ((L % 4) / 2);
}

extern "C" __global__ void __launch_bounds__(128) probe(
    const fp8* Q, const fp8* K, const fp8* V, float* S_out, float* O_out, float p_mul) {
  // Q [64][128 B] (8 KB), K [128][128 B] (16 KB), V row-major (16 KB), V^T [128 dims][128 B]
  extern __shared__ __align__(1024) unsigned char sm[];   // SMEM_BYTES, 1024 of slack
  const u32 q = (smem_addr(sm) + 1023u) & ~1023u, k = q + 8192, v = k + 16384, vt = v + 16384;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  auto st16 = [](u32 addr, const uint4& x) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w) : "memory");
  };
  for (int c = tid; c < M * 8; c += 128) {
    st16(q + sw128_offset<M>(c / 8, c % 8), reinterpret_cast<const uint4*>(Q)[c]);
  }
  for (int c = tid; c < BN * 8; c += 128) {
    st16(k + sw128_offset<BN>(c / 8, c % 8), reinterpret_cast<const uint4*>(K)[c]);
    st16(v + c * 16, reinterpret_cast<const uint4*>(V)[c]);
  }
  __syncthreads();
  // V^T: block (dims d0 .. d0 + 3, logical keys L0 .. L0 + 3) per step
  for (int blk = tid; blk < (D / 4) * (BN / 4); blk += 128) {
    const int d0 = (blk % (D / 4)) * 4, L0 = (blk / (D / 4)) * 4;
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = (L0 / 32) * 32 + phys(L0 % 32 + i);
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w[i]) : "r"(v + key * D + d0));
    }
    // out[e] = bytes e of w[0..3]
    const u32 lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
    const u32 lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
    const u32 out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                        __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      asm volatile("st.shared.b32 [%0], %1;\n"
                   :: "r"(vt + sw128_offset<D>(d0 + e, L0 / 16) + L0 % 16), "r"(out[e])
                   : "memory");
    }
  }
  fence_proxy_async();   // generic-proxy writes, read next by wgmma
  __syncthreads();

  float s[BN / 8][4];
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
    Wgmma<fp8, BN>::ss(s, desc_advance(sw128_desc(q), ks * 32),
                       desc_advance(sw128_desc(k), ks * 32), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
  const int r0 = warp * 16 + g;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    S_out[r0 * BN + 8 * j + 2 * t] = s[j][0];
    S_out[r0 * BN + 8 * j + 2 * t + 1] = s[j][1];
    S_out[(r0 + 8) * BN + 8 * j + 2 * t] = s[j][2];
    S_out[(r0 + 8) * BN + 8 * j + 2 * t + 1] = s[j][3];
  }
  u32 a[BN / 32][4];
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) {
    const int j = 4 * kk;
    a[kk][0] = pack_e4m3x4(p_mul * s[j][0], p_mul * s[j][1], p_mul * s[j + 1][0],
                           p_mul * s[j + 1][1]);
    a[kk][1] = pack_e4m3x4(p_mul * s[j][2], p_mul * s[j][3], p_mul * s[j + 1][2],
                           p_mul * s[j + 1][3]);
    a[kk][2] = pack_e4m3x4(p_mul * s[j + 2][0], p_mul * s[j + 2][1], p_mul * s[j + 3][0],
                     p_mul * s[j + 3][1]);
    a[kk][3] = pack_e4m3x4(p_mul * s[j + 2][2], p_mul * s[j + 2][3], p_mul * s[j + 3][2],
                     p_mul * s[j + 3][3]);
  }
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 32; ++kk) {
    Wgmma<fp8, D>::rs(o, a[kk], desc_advance(sw128_desc(vt), kk * 32), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    O_out[r0 * D + 8 * n + 2 * t] = o[n][0];
    O_out[r0 * D + 8 * n + 2 * t + 1] = o[n][1];
    O_out[(r0 + 8) * D + 8 * n + 2 * t] = o[n][2];
    O_out[(r0 + 8) * D + 8 * n + 2 * t + 1] = o[n][3];
  }
}
"""


def build() -> bytes:
    """The probe's cubin for sm_90a (NVRTC runs on the CPU: the compile check needs no GPU)."""
    return compiler.compile_cubin(SRC, "fp8_wgmma_probe", "sm_90a").cubin


def main() -> int:
    cubin = build()
    import cupy as cp
    path = os.path.join(tempfile.mkdtemp(), "probe.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    kern = cp.RawModule(path=path).get_function("probe")
    kern.max_dynamic_shared_size_bytes = SMEM_BYTES
    rng = np.random.default_rng(0)
    q8, k8, v8 = (quantize_e4m3(rng.standard_normal(shape) * 2, 1.0)
                  for shape in ((M, D), (BN, D), (BN, D)))
    dev = [cp.asarray(x.view(np.uint8)) for x in (q8, k8, v8)]
    s_out = cp.zeros((M, BN), cp.float32)
    o_out = cp.zeros((M, D), cp.float32)
    p_mul = np.float32(1 / 16)
    kern((1,), (128,), (*dev, s_out, o_out, p_mul), shared_mem=SMEM_BYTES)
    cp.cuda.Device().synchronize()
    s_ref = q8.astype(np.float64) @ k8.astype(np.float64).T
    s_got = s_out.get()
    s_err = np.abs(s_got - s_ref).max() / np.abs(s_ref).max()
    p8 = quantize_e4m3(s_got * p_mul, 1.0).astype(np.float64)
    o_ref = p8 @ v8.astype(np.float64)
    o_err = np.abs(o_out.get() - o_ref).max() / np.abs(o_ref).max()
    # The e4m3 GEMMs are not fp32-exact: Hopper's FP8 tensor cores keep fewer accumulator
    # bits (first run, H100: 2.6e-4 / 3.4e-4 of the max); a layout or permutation error
    # shows as errors of order 1.
    ok = s_err < 2e-3 and o_err < 2e-3
    print(f"S = Q K^T (e4m3 ss, k32): max rel err {s_err:.2e}; "
          f"O = P V (P packed with the key permutation, V^T by prmt): max rel err {o_err:.2e}; "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
