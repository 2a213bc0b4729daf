"""fp8 suite (issue 36): flash_forward on float8_e4m3fn inputs (the Hopper kernel's FP8 form)
beside cuattn's own bf16 forward on the same shapes, in the same run, by the same methods.

Configuration (the issue's): head dims 128 and 256, seqlen 4096..16384 (quick: 4096 and
16384), batch = 16384 // seqlen, nheads = 2048 // headdim, causal and not; FLOPs = 4 B H S
S D, halved for causal. FP8 inputs are standard normal values rounded to e4m3 (descales
of 1: a descale costs two loads per row tile), bf16 inputs standard normal; both write bf16
into a preallocated out=.
Methods as the flash suite's (bench/suite_flash.py): kernel-only (CuPy graph of GRAPH_CALLS
calls, median of GRAPH_REPS replays) and eager back-to-back, each after SETTLE_S of
untimed load; "fp8/bf16" divides two times of one method.
Then paged_rows (the issue's paged_prefill rows): FP8 math over an fp8 NHD cache beside the
same call over a bf16 cache, kernel-only, in the same run.
cuDNN's FP8 SDPA as a peer: tried through PyTorch (SDPA forced to CUDNN_ATTENTION on
float8_e4m3fn tensors); where the installed PyTorch refuses, its column is empty and the
reason goes to stderr.
"""
from __future__ import annotations

import sys

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench import torch_peers
from bench.harness import eager_ms, median_ms, randn

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
HEAD_DIMS = (128, 256)
SEQLENS = (4096, 8192, 16384)
QUICK_SEQLENS = (4096, 16384)
GRAPH_CALLS, GRAPH_REPS = 5, 20
EAGER_CALLS, EAGER_REPS = 20, 5
SETTLE_S = 0.3


_RNG = np.random.default_rng(0)


def fp8_randn(*shape) -> cupy.ndarray:
    """Standard normal values rounded to e4m3 (on the host: ml_dtypes' rounding), uploaded
    as bytes and viewed as float8_e4m3fn (each call new values)."""
    x = _RNG.standard_normal(shape, dtype=np.float32).astype(E4M3)
    return cupy.asarray(x.view(np.uint8)).view(E4M3)


def _cudnn_fp8_ms(tt, q, k, v, causal):
    """(graph ms, eager ms) of SDPA forced to cuDNN on float8 tensors, or (None, None) with
    the refusal on stderr."""
    if tt is None:
        return None, None
    try:
        torch = tt.torch
        views = [torch.from_dlpack(x.view(cupy.uint8)).view(torch.float8_e4m3fn)
                 .permute(0, 2, 1, 3) for x in (q, k, v)]
        return torch_peers.sdpa_times(tt, *views, causal=causal, backend_name="CUDNN_ATTENTION",
                                      graph_calls=GRAPH_CALLS, eager_calls=EAGER_CALLS,
                                      graph_reps=GRAPH_REPS, eager_reps=EAGER_REPS,
                                      settle_s=SETTLE_S)
    except Exception as e:       # the peer is optional: say why it is missing
        print(f"cuDNN FP8 SDPA not reachable: {type(e).__name__}: {str(e)[:200]}",
              file=sys.stderr)
        return None, None


def run(ceilings, quick: bool) -> list[dict]:
    rows = []
    tt = torch_peers.load()
    for d in HEAD_DIMS:
        for s in QUICK_SEQLENS if quick else SEQLENS:
            b, h = 16384 // s, 2048 // d
            inputs = {"fp8": tuple(fp8_randn(b, s, h, d) for _ in range(3)),
                      "bf16": tuple(randn(b, s, h, d) for _ in range(3))}
            out = cupy.empty((b, s, h, d), ml_dtypes.bfloat16)
            cupy.cuda.Device().synchronize()
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                graph, eager = {}, {}
                for name, (q, k, v) in inputs.items():
                    def call(q=q, k=k, v=v):
                        cuattn.flash_forward(q, k, v, causal=causal, out=out)
                    graph[name] = flops / median_ms(call, graph=GRAPH_CALLS, n_warmup=2,
                                                    n_repeat=GRAPH_REPS, settle_s=SETTLE_S) / 1e9
                    eager[name] = flops / eager_ms(call, calls=EAGER_CALLS, n_repeat=EAGER_REPS,
                                                   settle_s=SETTLE_S) / 1e9
                g_ms, e_ms = _cudnn_fp8_ms(tt, *inputs["fp8"], causal)
                graph["cuDNN fp8"] = None if g_ms is None else flops / g_ms / 1e9
                eager["cuDNN fp8"] = None if e_ms is None else flops / e_ms / 1e9
                row = {"config": f"hd{d} S{s} B{b} H{h} {'causal' if causal else 'full'}"}
                for method, rates in (("graph", graph), ("eager", eager)):
                    row.update({f"{lib} TFLOP/s ({method})": r for lib, r in rates.items()})
                    row[f"fp8/bf16 ({method})"] = rates["fp8"] / rates["bf16"]
                rows.append(row)
                print(row["config"], {k: None if v is None else round(v) for k, v in
                                      graph.items()}, file=sys.stderr, flush=True)
            del inputs, out
            cupy.get_default_memory_pool().free_all_blocks()
    return rows + paged_rows()


# paged_prefill (the rows): chunks of CHUNK new tokens against contexts of 16384 in
# NHD caches of these block sizes, the prefill suite's heads (bench/suite_prefill.py)
PAGED_BLOCK_SIZES = (16, 64)


def paged_rows() -> list[dict]:
    """paged_prefill over an fp8 NHD cache on FP8 math (q_scale: the call quantizes its bf16
    q) and on 16-bit math (no q_scale: the cache widened in the kernel) beside the same call
    over a bf16 cache, kernel-only (graph replays; the FP8 call's time includes its q
    quantization launch). The fp8 caches hold random finite e4m3 bytes."""
    from bench.suite_prefill import CHUNK, PagedCase
    rows = []
    for bs in PAGED_BLOCK_SIZES:
        case = PagedCase(16384 // CHUNK, 16384, CHUNK, "nhd", bs)

        def rate(**kw):
            ms = median_ms(case.prefill(**kw), graph=GRAPH_CALLS, n_warmup=2,
                           n_repeat=GRAPH_REPS, settle_s=SETTLE_S)
            return case.flops / ms / 1e9
        bf16 = rate()
        case.k_cache, case.v_cache = (cupy.random.randint(0, 0x77, x.shape, dtype=np.uint8)
                                      .view(E4M3) for x in (case.k_cache, case.v_cache))
        fp8_math = rate(k_scale=0.05, v_scale=0.05, q_scale=0.05)
        widened = rate(k_scale=0.05, v_scale=0.05)
        rows.append({"config": f"paged_prefill nhd/{bs} B{case.batch} {CHUNK} new / ctx 16384",
                     "fp8 TFLOP/s (graph)": fp8_math, "bf16 TFLOP/s (graph)": bf16,
                     "fp8/bf16 (graph)": fp8_math / bf16,
                     "fp8 cache, 16-bit math TFLOP/s (graph)": widened})
        print(rows[-1]["config"], round(fp8_math), round(bf16), round(widened),
              file=sys.stderr, flush=True)
        del case
        cupy.get_default_memory_pool().free_all_blocks()
    return rows
