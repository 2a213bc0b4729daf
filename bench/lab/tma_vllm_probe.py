"""Probe (lab, one warpgroup): can TMA lay vLLM's paged K / V out as wgmma reads them?

vLLM's K cache (num_blocks, kvh, hd / 8, block, 8) holds, per cache block, chunk c (8
columns) of 8 consecutive keys as one 128-byte no-swizzle core matrix. A 5-d tensor map
(64 elements = 8 keys x 8 columns, chunk c, key group g, KV head, cache block) -- strides
not increasing: the chunk's (block x 16 bytes) before the group's (128) -- lands a box per
cache block as [group][chunk][8 keys][8 columns], so that a whole tile of boxes is one
no-swizzle K-major operand (LBO 128, SBO head_dim x 16) across cache blocks. V (num_blocks,
kvh, hd, block) lands per cache block as rows of `block` keys (one per dim): a K-major B of
O += P V with 32-byte swizzle (block 16), 64-byte (block 32) or none (block 8).

Checks, per block size 8 / 16 / 32 (hd 64, 32 keys = 4 / 2 / 1 cache blocks, bf16):
  the maps encode; the boxes' shared-memory bytes equal the layouts above; S = Q K^T
  (SS wgmma, the K descriptor no-swizzle) and O = P V (RS wgmma, B K-major) equal NumPy.

    PYTHONPATH=. python bench/lab/tma_vllm_probe.py
"""
from __future__ import annotations

import ctypes
import os
import tempfile

import cupy as cp
import ml_dtypes
import numpy as np

from cuattn import _tma
from cuattn.jit import compiler

HD, N = 64, 32
SRC = r"""
#include "common/mma.cuh"
#include "common/wgmma.cuh"
using namespace cuattn;
using bf16 = __nv_bfloat16;

// O += P V with B K-major (imm-trans-b 0), N = 64
__device__ __forceinline__ void rs_kmajor(float (&d)[8][4], const unsigned (&a)[4], u64 b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo, u32 layout) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
         ((u64)layout << 62);
}
struct Maps { TmaDescriptor q, k, v; };

extern "C" __global__ void __launch_bounds__(128) probe(
    const __grid_constant__ Maps maps, const int* pages, const bf16* Q, const bf16* P,
    float* S, float* O, unsigned char* k_raw, unsigned char* v_raw, int box, int kvh) {
  __shared__ __align__(1024) unsigned char sm[3 * 8192 + 64];
  const u32 q = smem_addr(sm), k = q + 8192, v = q + 16384, bar = q + 24576;
  const int tid = threadIdx.x, nboxes = 32 / box;
  if (tid == 0) { mbar_init(bar, 1); fence_mbar_init(); }
  __syncthreads();
  if (tid == 0) {
    mbar_arrive_expect_tx(bar, 2 * 32 * 64 * 2);
    for (int i = 0; i < nboxes; ++i) {
      tma_load_5d(k + i * box * 128, maps.k, bar, 0, 0, 0, kvh, pages[i]);
      tma_load_4d(v + i * box * 128, maps.v, bar, 0, 0, kvh, pages[i]);
    }
  }
  // Q: 64 x 64, one 128-byte-swizzled column block
  for (int c = tid; c < 64 * 8; c += 128) {
    const int r = c / 8, ch = c % 8;
    const uint4 x = *reinterpret_cast<const uint4*>(Q + r * 64 + ch * 8);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(q + sw128_offset<64>(r, ch)), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
  }
  fence_proxy_async();
  __syncthreads();
  mbar_wait(bar, 0);
  for (int i = tid; i < 8192; i += 128) { k_raw[i] = sm[8192 + i]; v_raw[i] = sm[16384 + i]; }

  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  float s[4][4] = {};
  wgmma_fence();
  for (int ks = 0; ks < 4; ++ks) {
    Wgmma<bf16, 32>::ss(s, desc_advance(sw128_desc(q), ks * 32), desc(k + ks * 256, 128, 64 * 16, 0),
                        ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
  for (int j = 0; j < 4; ++j)
    for (int e = 0; e < 4; ++e)
      S[(warp * 16 + g + (e / 2) * 8) * 32 + 8 * j + 2 * t4 + e % 2] = s[j][e];

  float o[8][4] = {};
  const u32 layout = box == 8 ? 0 : box == 16 ? 3 : 2;
  const u32 lbo = box == 8 ? 64 * 16 : 16, sbo = box == 8 ? 128 : 8 * box * 2;
  for (int kk = 0; kk < 2; ++kk) {
    unsigned a[4];
    for (int i = 0; i < 4; ++i) {
      const int r = warp * 16 + g + (i % 2) * 8, c = 16 * kk + 2 * t4 + (i / 2) * 8;
      a[i] = *reinterpret_cast<const unsigned*>(P + r * 32 + c);
    }
    const u32 start = v + (16 * kk / box) * box * 128 + (16 * kk % box) * 2;
    wgmma_fence();
    rs_kmajor(o, a, desc(start, lbo, sbo, layout));
    wgmma_commit();
    wgmma_wait<0>();
  }
  fence_regs(o);
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e)
      O[(warp * 16 + g + (e / 2) * 8) * 64 + 8 * j + 2 * t4 + e % 2] = o[j][e];
}
"""


def encode(ptr, dims, strides, box, swizzle):
    c = ctypes
    buf = c.create_string_buffer(_tma.MAP_BYTES + 64)
    at = (c.addressof(buf) + 63) & ~63
    n = len(dims)
    err = _tma._driver_encode()(at, _tma.DATA_TYPE["bf16"], n, ptr, (c.c_uint64 * n)(*dims),
                                (c.c_uint64 * (n - 1))(*strides), (c.c_uint32 * n)(*box),
                                (c.c_uint32 * n)(*([1] * n)), 0, swizzle, 3, 0)
    return err, c.string_at(at, _tma.MAP_BYTES)


def sw(a: np.ndarray, row_bytes: int) -> np.ndarray:
    """Byte offset a after the TMA / wgmma swizzle of rows of `row_bytes`."""
    return a ^ (((a >> 7) & (row_bytes // 16 - 1)) << 4) if row_bytes > 16 else a


def main():
    res = compiler.compile_cubin(SRC, "tma_vllm_probe", "sm_90a")
    path = os.path.join(tempfile.mkdtemp(), "probe.cubin")
    with open(path, "wb") as f:
        f.write(res.cubin)
    mod = cp.RawModule(path=path)
    kern = mod.get_function("probe")
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    ok_all = True
    for bs in (8, 16, 32):
        nb, nkv, kvh = 8, 2, 1
        kc = rng.standard_normal((nb, nkv, HD // 8, bs, 8)).astype(bf)
        vc = rng.standard_normal((nb, nkv, HD, bs)).astype(bf)
        pages = np.array([5, 2, 7, 0][: N // bs], np.int32)
        q = rng.standard_normal((64, HD)).astype(bf)
        pm = rng.standard_normal((64, N)).astype(bf)
        dk, dv = cp.asarray(kc), cp.asarray(vc)
        e = 2
        err_k, mk = encode(dk.data.ptr, (64, HD // 8, bs // 8, nkv, nb),
                           (bs * 16, 128, HD * bs * e, nkv * HD * bs * e),
                           (64, HD // 8, bs // 8, 1, 1), 0)
        swz = {16: 0, 32: 1, 64: 2}[bs * 2]
        err_v, mv = encode(dv.data.ptr, (bs, HD, nkv, nb), (bs * e, HD * bs * e, nkv * HD * bs * e),
                           (bs, HD, 1, 1), swz)
        print(f"block {bs}: encode K (strides not increasing) -> CUresult {err_k}, "
              f"V (swizzle {swz}) -> {err_v}")
        if err_k or err_v:
            ok_all = False
            continue
        maps = np.frombuffer(b"\0" * 128 + mk + mv, _tma.MAPS_DTYPE)[0]
        S = cp.zeros((64, N), np.float32)
        O = cp.zeros((64, HD), np.float32)
        kraw = cp.zeros(8192, np.uint8)
        vraw = cp.zeros(8192, np.uint8)
        dq, dp, dpg = cp.asarray(q), cp.asarray(pm), cp.asarray(pages)
        cp.cuda.runtime.deviceSynchronize()
        kern((1,), (128,), (maps, dpg, dq, dp, S, O, kraw, vraw, np.int32(bs), np.int32(kvh)))
        cp.cuda.runtime.deviceSynchronize()
        # gathered keys: key i -> page pages[i // bs], slot i % bs
        kg = np.stack([kc[pages[i // bs], kvh, :, i % bs, :].reshape(HD) for i in range(N)])
        vg = np.stack([vc[pages[i // bs], kvh, :, i % bs] for i in range(N)])
        # expected smem bytes
        kb = kraw.get().view(bf)[: N * HD]
        exp_k = np.zeros(N * HD, bf)
        for i in range(N):
            for c in range(HD // 8):
                off = ((i // 8) * (HD // 8) * 128 + c * 128 + (i % 8) * 16) // 2
                exp_k[off: off + 8] = kg[i, c * 8: c * 8 + 8]
        vb = vraw.get()
        exp_v = np.zeros(8192, np.uint8)
        vbytes = np.zeros(N * HD * 2, np.uint8)
        for b in range(N // bs):
            blockv = vc[pages[b], kvh].view(np.uint8).reshape(HD, bs * 2)   # [dim][keys]
            for d in range(HD):
                for ch in range(bs * 2 // 16):
                    a = d * bs * 2 + ch * 16
                    dst = b * bs * HD * 2 + int(sw(np.int64(a), bs * 2))
                    vbytes[dst: dst + 16] = blockv[d, ch * 16: ch * 16 + 16]
        exp_v[: N * HD * 2] = vbytes
        s_ref = q.astype(np.float64) @ kg.astype(np.float64).T
        o_ref = pm.astype(np.float64) @ vg.astype(np.float64)
        k_ok = np.array_equal(kb.view(np.uint16), exp_k.view(np.uint16))
        v_ok = np.array_equal(vb, exp_v)
        s_err = float(np.abs(S.get() - s_ref).max())
        o_err = float(np.abs(O.get() - o_ref).max())
        print(f"  K smem layout as expected: {k_ok}; V smem layout as expected: {v_ok}; "
              f"S max err {s_err:.3e}; O max err {o_err:.3e}")
        ok_all &= k_ok and v_ok and s_err < 1e-2 and o_err < 1e-2
    print("PROBE", "PASSED" if ok_all else "FAILED")


if __name__ == "__main__":
    main()
