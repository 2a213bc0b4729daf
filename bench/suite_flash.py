"""flash suite: flash_forward TFLOP/s beside PyTorch's FlashAttention-2 and cuDNN, each by
the same method in the same run.

Configuration (issue 3, FlashAttention's own benchmark): bf16, headdim 64 and 128, seqlen
512..16384, plus headdim 256 at seqlen 2048 and 8192; batch = 16384 // seqlen, nheads =
2048 // headdim, causal and not. FLOPs = 4 * B * H * S * S * D, halved for causal. Inputs
are 3 x 64 MB, past the H200's 60 MB L2.

Every library is timed two ways, and a ratio only ever divides two times of one method:
- graph (kernel-only): ``GRAPH_CALLS`` back-to-back calls captured once in a CUDA graph,
  median per call over ``GRAPH_REPS`` replays: cuattn in a CuPy graph
  (``harness.CupyGraph``), SDPA in a ``torch.cuda.CUDAGraph`` (``torch_peers.graph_ms``).
- eager (back-to-back): ``EAGER_CALLS`` eager calls between two CUDA events with no sync
  inside, median of time / calls over ``EAGER_REPS`` reps (``harness.eager_ms``,
  ``torch_peers.eager_ms``): what a loop of calls costs, host launch path included where it
  is longer than the kernel.
Before every measurement of either method the measured calls run untimed for ``SETTLE_S``
seconds, so every library is timed at the clocks of its own sustained load: attention at
these sizes is power-bound on the H200 (about 690 W), whose SM clock falls from its boost
to 1500-1650 MHz within half a second of load, and a measurement that starts after an idle
spell reads up to 15% high (bench/NOTES.md, "Eager at S 2048").
Peers: SDPA forced to FLASH_ATTENTION ("FA2", PyTorch's bundled FlashAttention-2) and to
CUDNN_ATTENTION, on the same memory (DLPack, (B, H, S, D) views of the (B, S, H, D) arrays),
each only where torch is importable and the backend accepts the shape (else empty cells).
cuattn writes into a preallocated ``out=``; SDPA allocates its output (from torch's caching
allocator). "cuattn/FA2" is cuattn's TFLOP/s over FA2's (> 1: cuattn is faster). On sm_90
"cuattn" is the wgmma kernel (the default there) and "cuattn-mma" the mma.sync kernel
forced with tuning.override(flash_path="mma"), in the same run.
The naive CuPy attention (materialised fp32 scores) allocates per call, so it is timed
eager only, where its scores fit (seqlen <= 4096); it has no ratio column.
Varlen rows (issue 12's target): flash_varlen_forward over 16 sequences of mixed lengths
(VARLEN_LENGTHS, 16384 tokens, hd128, 16 heads) beside the dense call of the same total
(batch 16 x seqlen 1024) in the same row, both in TFLOP/s of the work each does (the
varlen FLOPs are 4 H D sum(len^2), halved for causal), cuattn only (SDPA has no varlen).
"""
from __future__ import annotations

import math
import sys

import cupy
import numpy as np

import cuattn
from bench import torch_peers
from cuattn import tuning
from cuattn.jit import arch_of_device
from bench.harness import eager_ms, median_ms, randn

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096)
HEAD_DIMS = (64, 128)
HD256_SEQLENS = (2048, 8192)          # issue 12's table
QUICK_HD256_SEQLENS = (2048,)
NAIVE_MAX_SCORE_BYTES = 8 << 30       # fp32 scores of the naive peer must stay under this
GRAPH_CALLS, GRAPH_REPS = 5, 20
EAGER_CALLS, EAGER_REPS = 20, 5
SETTLE_S = 0.3
PEERS = (("FA2", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION"))
VARLEN_LENGTHS = (3071, 2049, 1536, 1279, 1025, 1024, 1023, 896, 769, 767, 640, 513, 511,
                  512, 385, 384)                  # 16 sequences, 16384 tokens


def configs(quick: bool) -> list[tuple[int, int]]:
    """(head_dim, seqlen) pairs of the suite (also the A/B's flash configurations)."""
    seqlens = QUICK_SEQLENS if quick else SEQLENS
    hd256 = QUICK_HD256_SEQLENS if quick else HD256_SEQLENS
    return [(d, s) for d in HEAD_DIMS for s in seqlens] + [(256, s) for s in hd256]


def standard_inputs(d: int, s: int):
    """(q, k, v) bf16 (B, S, H, D) with B = 16384 // S, H = 2048 // D, standard normal."""
    return tuple(randn(16384 // s, s, 2048 // d, d) for _ in range(3))


def label(d: int, s: int, causal: bool) -> str:
    return f"hd{d} S{s} B{16384 // s} H{2048 // d} {'causal' if causal else 'full'}"


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


def _rates(rates: dict) -> str:
    return " ".join(f"{lib} {'-' if r is None else f'{r:.0f}'}" for lib, r in rates.items())


def _ratio(a, b):
    return None if a is None or b is None else a / b


def run(ceilings, quick: bool) -> list[dict]:
    rows = []
    tt = torch_peers.load()
    arch = arch_of_device(cupy.cuda.Device().id)
    for d, s in configs(quick):
        two_paths = tuning.flash_path(arch, d) == "wgmma"
        q, k, v = standard_inputs(d, s)
        b, h = q.shape[0], q.shape[2]
        out = cupy.empty_like(q)
        views = torch_peers.bhsd_views(tt, q, k, v)
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)

            def tflops(ms):
                return None if ms is None else flops / ms / 1e9

            def call():
                cuattn.flash_forward(q, k, v, causal=causal, out=out)

            # No split at these shapes (the grid fills the GPU), so the call allocates nothing.
            def graph_rate():
                return tflops(median_ms(call, graph=GRAPH_CALLS, n_warmup=2,
                                        n_repeat=GRAPH_REPS, settle_s=SETTLE_S))

            def eager_rate():
                return tflops(eager_ms(call, calls=EAGER_CALLS, n_repeat=EAGER_REPS,
                                       settle_s=SETTLE_S))

            graph, eager = {"cuattn": graph_rate()}, {"cuattn": eager_rate()}
            if two_paths:   # the mma.sync kernel too, where the default is the wgmma one
                with tuning.override(flash_path="mma"):
                    graph["cuattn-mma"], eager["cuattn-mma"] = graph_rate(), eager_rate()
            for name, backend in PEERS:
                g_ms = e_ms = None
                if views is not None:
                    g_ms, e_ms = torch_peers.sdpa_times(
                        tt, *views, causal=causal, backend_name=backend, graph_calls=GRAPH_CALLS,
                        eager_calls=EAGER_CALLS, graph_reps=GRAPH_REPS, eager_reps=EAGER_REPS,
                        settle_s=SETTLE_S)
                graph[name], eager[name] = tflops(g_ms), tflops(e_ms)
            row = {"config": label(d, s, causal),
                   "% matmul (graph)": 100 * graph["cuattn"] / ceilings.matmul_tflops}
            for method, rates in (("graph", graph), ("eager", eager)):
                row.update({f"{lib} TFLOP/s ({method})": rates[lib] for lib in rates})
                row.update({f"cuattn/{name} ({method})": _ratio(rates["cuattn"], rates[name])
                            for name, _ in PEERS})
            if b * h * s * s * 4 <= NAIVE_MAX_SCORE_BYTES and s <= 4096:
                row["naive cupy TFLOP/s (eager)"] = tflops(
                    eager_ms(lambda: _naive(q, k, v, causal), calls=3, n_repeat=3))
            rows.append(row)
            # progress (stderr: the table comes at the end), so that a cut-off run still tells
            print(row["config"], "graph", _rates(graph), "| eager", _rates(eager),
                  file=sys.stderr, flush=True)
        del q, k, v, out, views
        if tt is not None:
            tt.torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
    rows += varlen_rows(quick)
    return rows


def varlen_rows(quick: bool) -> list[dict]:
    total, h, d = sum(VARLEN_LENGTHS), 16, 128
    n = len(VARLEN_LENGTHS)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(VARLEN_LENGTHS)]), dtype=np.int32)
    q, k, v = (randn(total, h, d) for _ in range(3))
    dq, dk, dv = (x.reshape(n, total // n, h, d) for x in (q, k, v))
    out = cupy.empty_like(q)
    longest = max(VARLEN_LENGTHS)
    rows = []
    for causal in (False,) if quick else (False, True):
        half = 2 if causal else 1
        work = {"varlen": 4 * h * d * sum(x * x for x in VARLEN_LENGTHS) / half,
                "dense": 4 * n * h * d * (total // n) ** 2 / half}
        calls = {"varlen": lambda: cuattn.flash_varlen_forward(q, k, v, cu, cu, longest, longest,
                                                               causal=causal, out=out),
                 "dense": lambda: cuattn.flash_forward(dq, dk, dv, causal=causal,
                                                       out=out.reshape(dq.shape))}
        rates = {name: work[name] / median_ms(fn, graph=GRAPH_CALLS, n_warmup=2,
                                              n_repeat=GRAPH_REPS, settle_s=SETTLE_S) / 1e9
                 for name, fn in calls.items()}
        rows.append({"config": f"varlen hd{d} {n} seqs {total} tokens "
                               f"{'causal' if causal else 'full'}",
                     "cuattn TFLOP/s (graph)": rates["varlen"],
                     f"dense B{n}xS{total // n} TFLOP/s (graph)": rates["dense"],
                     "varlen/dense (graph)": rates["varlen"] / rates["dense"]})
    return rows
