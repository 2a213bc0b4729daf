"""flash suite: flash_forward TFLOP/s against the device's bf16 matmul rate and peers.

Configuration (issue 3, FlashAttention's own benchmark): bf16, headdim 64 and 128,
seqlen 512..16384, batch = 16384 // seqlen, nheads = 2048 // headdim, causal and not.
FLOPs = 4 * B * H * S * S * D, halved for causal. Peers on the same inputs, each only when
available: PyTorch SDPA with the FLASH_ATTENTION and CUDNN_ATTENTION backends (tensors
shared through DLPack, passed as (B, H, S, D) views), and a naive CuPy attention
(matmul + softmax, materialised scores; only where the scores fit).
"""
from __future__ import annotations

import math

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import median_ms

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096)
HEAD_DIMS = (64, 128)
NAIVE_MAX_SCORE_BYTES = 8 << 30     # fp32 scores of the naive peer must stay under this


def _torch():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if not torch.cuda.is_available():
            return None
        return torch, SDPBackend, sdpa_kernel
    except Exception:
        return None


def _sdpa_ms(tt, q, k, v, causal, backend_name):
    """Median ms of torch SDPA with one backend, or None if it refuses the shape.

    Timed with torch's own events on torch's current stream (median of 20 after warm-up),
    so no stream is shared between the two libraries.
    """
    torch, SDPBackend, sdpa_kernel = tt
    backend = getattr(SDPBackend, backend_name, None)
    if backend is None:
        return None
    cupy.cuda.get_current_stream().synchronize()
    # (B, S, H, D) CuPy -> torch without a copy -> (B, H, S, D) views.
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    try:
        call()
        torch.cuda.synchronize()
    except Exception:   # backend not built / not supported for this shape
        return None
    for _ in range(5):
        call()
    times = []
    for _ in range(20):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def _naive(q, k, v, causal):
    """Materialised attention in CuPy: fp32 scores, softmax, P V."""
    b, s, h, d = q.shape
    qt = q.transpose(0, 2, 1, 3).astype(np.float32)
    kt = k.transpose(0, 2, 3, 1).astype(np.float32)
    vt = v.transpose(0, 2, 1, 3).astype(np.float32)
    scores = cupy.matmul(qt, kt) * (1.0 / math.sqrt(d))
    if causal:
        scores += cupy.triu(cupy.full((s, s), -cupy.inf, dtype=np.float32), 1)
    scores -= scores.max(axis=-1, keepdims=True)
    cupy.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return cupy.matmul(scores, vt).astype(q.dtype)


def run(ceilings, quick: bool) -> list[dict]:
    rows = []
    tt = _torch()
    dtype = ml_dtypes.bfloat16
    for d in HEAD_DIMS:
        for s in (QUICK_SEQLENS if quick else SEQLENS):
            b, h = 16384 // s, 2048 // d
            shape = (b, s, h, d)
            q, k, v = (cupy.random.standard_normal(shape, dtype=np.float32).astype(dtype)
                       for _ in range(3))
            out = cupy.empty_like(q)
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)

                def tflops(ms):
                    return None if ms is None else flops / ms / 1e9

                def call():
                    cuattn.flash_forward(q, k, v, causal=causal, out=out)

                # Kernel time from CUDA-graph replays (no split at these shapes, so the
                # call allocates nothing); the eager time includes the Python launch path,
                # as the SDPA columns do.
                ms = median_ms(call, graph=5, n_warmup=3, n_repeat=20)
                eager = median_ms(call, n_warmup=3, n_repeat=20)
                row = {
                    "config": f"hd{d} S{s} B{b} H{h} {'causal' if causal else 'full'}",
                    "cuattn ms": ms, "cuattn TFLOP/s": tflops(ms),
                    "% matmul": 100 * tflops(ms) / ceilings.matmul_tflops,
                    "cuattn eager TFLOP/s": tflops(eager),
                }
                if tt is not None:
                    fa = _sdpa_ms(tt, q, k, v, causal, "FLASH_ATTENTION")
                    cu = _sdpa_ms(tt, q, k, v, causal, "CUDNN_ATTENTION")
                    row["SDPA flash TFLOP/s"] = tflops(fa)
                    row["SDPA cudnn TFLOP/s"] = tflops(cu)
                    row["x vs SDPA flash"] = None if fa is None else fa / ms
                if b * h * s * s * 4 <= NAIVE_MAX_SCORE_BYTES and s <= 4096:
                    naive = median_ms(lambda: _naive(q, k, v, causal), n_warmup=2, n_repeat=5)
                    row["naive cupy TFLOP/s"] = tflops(naive)
                rows.append(row)
            del q, k, v, out
            cupy.get_default_memory_pool().free_all_blocks()
    return rows
