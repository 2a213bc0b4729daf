"""Shared benchmark harness: timing, the device's own ceilings, tables.

Timing is ``cupyx.profiler.benchmark`` (CUDA events around each rep, after warm-up);
we report the median GPU time. Inputs are sized well past the 60 MB L2 of an H200, or
rotated, so the numbers are memory numbers, not cache numbers.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import cupy
import numpy as np
from cupyx.profiler import benchmark

L2_FLUSH_BYTES = 256 << 20


def median_ms(fn, *, n_warmup: int = 10, n_repeat: int = 50, flush_l2: bool | str = False,
              graph: int = 0) -> float:
    """Median GPU time of ``fn()`` in milliseconds.

    ``graph=n`` captures n back-to-back calls of ``fn`` in a CUDA graph and times its
    replays (per call): the GPU time of the kernels alone, without the Python launch
    path in between (``fn`` must allocate nothing). ``flush_l2`` empties the L2 of
    ``fn``'s data before every rep, outside the timed region (see ``L2Flush``): ``True``
    or ``"clean"``, or ``"dirty"``.
    """
    if graph:
        return _graph_median_ms(fn, graph, n_warmup, n_repeat, flush_l2)
    if not flush_l2:
        res = benchmark(fn, n_warmup=n_warmup, n_repeat=n_repeat)
        return float(np.median(res.gpu_times[0]) * 1e3)
    flush = L2Flush(flush_l2)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(n_warmup + n_repeat):
        flush(i)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= n_warmup:
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(statistics.median(times))


def _graph_median_ms(fn, calls, n_warmup, n_repeat, flush_l2) -> float:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()                              # compile / load outside the capture
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls):
            fn()
        g = stream.end_capture()
        flush = L2Flush(flush_l2) if flush_l2 else None
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for i in range(n_warmup + n_repeat):
            if flush is not None:
                flush(i)
            start.record(stream)
            g.launch(stream)
            stop.record(stream)
            stop.synchronize()
            if i >= n_warmup:
                times.append(cupy.cuda.get_elapsed_time(start, stop) / calls)
    return float(statistics.median(times))


class L2Flush:
    """Evicts the timed function's data from L2 by streaming a 256 MB buffer through it.

    ``"clean"`` (the default) reads the buffer: L2 is left full of clean lines, and any
    dirty line is written back here, outside the timed region. ``"dirty"`` writes it
    (``fill``, what most harnesses do): L2 is left full of dirty lines, and the timed
    kernel pays their write-back as its reads evict them. On the H200 that cost 4 us to
    the plain read kernel over 134 MB (35.1 -> 39.3 us) and 8 us to a batch-1 decode call
    of the same bytes (41.6 -> 50.0 us; bench/lab/decode_flush.py). A decode step follows
    GEMMs that read their weights, so its L2 holds mostly clean lines: "clean" is the
    realistic state, "dirty" the pessimistic one. The ceilings (2 GB, no flush) pay neither.
    """

    def __init__(self, mode: bool | str = "clean"):
        mode = "clean" if mode is True else mode
        if mode not in ("clean", "dirty"):
            raise ValueError(f"flush_l2: expected True, 'clean' or 'dirty', got {mode!r}")
        self.mode = mode
        self.buf = cupy.zeros(L2_FLUSH_BYTES, dtype=np.uint8)
        self._read = ReadPass(streaming=False)   # plain loads: every line allocated in L2

    def __call__(self, i: int = 0) -> None:
        if self.mode == "dirty":
            self.buf.fill(i & 0xFF)
        else:
            self._read(self.buf, L2_FLUSH_BYTES)


def host_us_per_call(fn, *, n: int = 300) -> float:
    """Host-side microseconds per call (launch path cost), GPU work queued, not waited on."""
    import time
    for _ in range(50):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.get_current_stream().synchronize()
    return (t1 - t0) / n * 1e6


@dataclass
class Ceilings:
    copy_gbps: float        # device-to-device copy, bytes read + written
    read_gbps: float        # 16-byte-load read-only kernel
    matmul_tflops: float    # large bf16 (or fp16) matmul
    device: str

    def row(self) -> dict:
        return {"device": self.device, "copy GB/s": round(self.copy_gbps),
                "read GB/s": round(self.read_gbps), "matmul TFLOP/s": round(self.matmul_tflops)}


_READ_KERNEL = r"""
extern "C" __global__ void read_pass(const uint4* %(qual)s x, long long n, unsigned* out) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    uint4 v = %(load)s;
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;   // keeps the loads alive
}
"""


class ReadPass:
    """Reads a device buffer once, 16 bytes per load, 4 blocks of 512 threads per SM.

    ``streaming=True``: ``__ldcs`` (evict-first) loads, the read-ceiling kernel;
    ``streaming=False``: plain loads, which allocate every line in L2 (L2Flush).
    """

    def __init__(self, streaming: bool = True):
        src = _READ_KERNEL % ({"qual": "__restrict__", "load": "__ldcs(x + i)"} if streaming
                              else {"qual": "", "load": "x[i]"})
        self._kernel = cupy.RawKernel(src, "read_pass")
        self._sink = cupy.zeros(1, dtype=np.uint32)
        self._grid = (cupy.cuda.Device().attributes["MultiProcessorCount"] * 4,)

    def __call__(self, buf: cupy.ndarray, nbytes: int) -> None:
        """Read the first nbytes (rounded down to 16) of buf, on the current stream."""
        self._kernel(self._grid, (512,), (buf, np.int64(nbytes // 16), self._sink),
                     stream=cupy.cuda.get_current_stream())


def plain_read_ms(nbytes: int, *, flush_l2: bool | str = "clean") -> float:
    """The read-ceiling kernel over a contiguous buffer of ``nbytes`` (rounded down to 16),
    timed like a decode call (CUDA-graph replays, L2 flushed): what reading that many bytes
    costs at that size, launch ramp-up and tail included."""
    read = ReadPass()
    buf = cupy.ones(nbytes // 16 * 2, dtype=np.uint64)
    return median_ms(lambda: read(buf, nbytes), n_warmup=5, n_repeat=30, flush_l2=flush_l2,
                     graph=1)


def measure_ceilings(quick: bool = False) -> Ceilings:
    """The device's own copy, read and matmul ceilings, measured now."""
    nbytes = (512 << 20) if quick else (2 << 30)
    src = cupy.random.randint(0, 255, nbytes, dtype=np.uint8)
    dst = cupy.empty_like(src)
    t = median_ms(lambda: cupy.copyto(dst, src), n_repeat=20)
    copy_gbps = 2 * nbytes / t / 1e6

    read = ReadPass()
    t = median_ms(lambda: read(src, nbytes), n_repeat=20)
    read_gbps = nbytes / t / 1e6
    del src, dst

    n = 4096 if quick else 8192
    try:
        import ml_dtypes
        a = cupy.random.standard_normal((n, n), dtype=np.float32).astype(ml_dtypes.bfloat16)
        cupy.matmul(a, a)
    except Exception:  # CuPy without a bf16 GEMM: fp16 runs at the same tensor rate
        a = cupy.random.standard_normal((n, n), dtype=np.float32).astype(np.float16)
    b = a.T.copy()
    t = median_ms(lambda: cupy.matmul(a, b), n_warmup=5, n_repeat=20)
    matmul_tflops = 2 * n ** 3 / t / 1e9
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return Ceilings(copy_gbps, read_gbps, matmul_tflops, name)


def format_table(rows: list[dict], title: str = "") -> str:
    """A GitHub-style Markdown table of a list of dicts (union of keys, in first-seen order)."""
    if not rows:
        return f"{title}\n(no rows)\n"
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)
    lines = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
    lines += [f"| {' | '.join(cell(r.get(c)) for c in cols)} |" for r in rows]
    return (f"### {title}\n" if title else "") + "\n".join(lines) + "\n"
