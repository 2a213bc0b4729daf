"""Shared benchmark harness: timing, the device's own ceilings, tables.

Timing is by CUDA events, after warm-up, median of many reps, in one of three methods that
are never divided by one another: kernel-only (``CupyGraph``: several calls per CUDA-graph
replay, no Python between launches), eager back-to-back (``eager_ms``: many calls between
two events, no sync inside) and, for the older tables, one call per rep with a sync after
it (``median_ms`` without ``graph``). ``host_cost`` is the host's wall time per call.
Inputs are sized well past the 60 MB L2 of an H200, or rotated, or L2 is flushed
(``L2Flush``), so the numbers are memory numbers, not cache numbers.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import cupy
import numpy as np
from cupyx.profiler import benchmark

L2_FLUSH_BYTES = 256 << 20


def randn(*shape, dtype=None) -> cupy.ndarray:
    """Standard normal values of ``shape``, drawn in float32 and cast to ``dtype`` (default
    bfloat16), on CuPy's current stream."""
    import ml_dtypes
    x = cupy.random.standard_normal(shape, dtype=np.float32)
    return x.astype(ml_dtypes.bfloat16 if dtype is None else dtype, copy=False)


def median_ms(fn, *, n_warmup: int = 10, n_repeat: int = 50, flush_l2: bool | str = False,
              graph: int = 0, settle_s: float = 0.0) -> float:
    """Median GPU time of ``fn()`` in milliseconds.

    ``graph=n`` captures n back-to-back calls of ``fn`` in a CUDA graph and times its
    replays (per call): the GPU time of the kernels alone, without the Python launch
    path in between (see ``CupyGraph``). Without it, one call between two events with a
    sync after each rep (the host launch time of a short call lands inside). ``flush_l2``
    empties the L2 of ``fn``'s data before every rep, outside the timed region (see
    ``L2Flush``): ``True`` or ``"clean"``, or ``"dirty"``. ``settle_s``: see
    ``event_median_ms`` (graph replays only).
    """
    flush = L2Flush(flush_l2) if flush_l2 else None
    if graph:
        return CupyGraph(fn, graph).median_ms(n_warmup=n_warmup, n_repeat=n_repeat, flush=flush,
                                              settle_s=settle_s)
    if flush is None:
        res = benchmark(fn, n_warmup=n_warmup, n_repeat=n_repeat)
        return float(np.median(res.gpu_times[0]) * 1e3)
    return event_median_ms(fn, cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.get_elapsed_time,
                           n_warmup=n_warmup, n_repeat=n_repeat, before=flush)


def event_median_ms(body, start, stop, elapsed_ms, *, n_warmup: int, n_repeat: int,
                    per: int = 1, before=None, settle_s: float = 0.0) -> float:
    """Median over ``n_repeat`` reps (after ``n_warmup``) of the time between ``start`` and
    ``stop`` recorded around ``body()`` on the current stream, divided by ``per``.

    Works with CuPy events (``elapsed_ms=cupy.cuda.get_elapsed_time``) and torch events
    (``elapsed_ms=lambda a, b: a.elapsed_time(b)``): both record on their library's current
    stream. ``before(i)`` runs before each rep, outside the timed region; the host waits for
    ``stop`` after each rep, so reps never overlap.

    ``settle_s``: first ``body()`` back to back for that many seconds, untimed, so that the
    reps run at the clocks of a sustained load of ``body`` rather than the boost clocks an
    idle spell (a capture, a compile, the previous measurement's host work) leaves behind.
    A power-bound kernel needs it: on the H200 a 690 W attention load takes the SM clock
    from about 1980 MHz to 1500-1650 MHz within about half a second, and rates measured in
    that half second read up to 15% high (bench/NOTES.md, "Eager at S 2048").
    """
    if settle_s > 0:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < settle_s:
            body()
            stop.record()
            stop.synchronize()
    times = []
    for i in range(n_warmup + n_repeat):
        if before is not None:
            before(i)
        start.record()
        body()
        stop.record()
        stop.synchronize()
        if i >= n_warmup:
            times.append(elapsed_ms(start, stop) / per)
    return float(statistics.median(times))


def repeat_calls(fn, calls: int) -> None:
    for _ in range(calls):
        fn()


def _capture(fn, calls: int, stream, end_capture):
    """Device sync, one eager ``fn()`` on ``stream``, then ``calls`` calls captured there;
    returns ``end_capture()`` (which ends the capture even when a call raised)."""
    cupy.cuda.Device().synchronize()
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            repeat_calls(fn, calls)
        finally:
            captured = end_capture()
    return captured


class CupyGraph:
    """``calls`` back-to-back calls of ``fn`` captured once in a CUDA graph, replayed on a
    private non-blocking stream: kernel-only time (no Python between the launches).

    Before capturing: the whole device is synchronised (inputs made on another stream are
    ready: a non-blocking stream does not wait for the null stream), then ``fn`` runs once
    eagerly on the capture stream (compile / load outside the capture; an exception there
    means ``fn`` refuses its inputs and propagates). ``fn`` must not synchronise the host;
    what it allocates while capturing must stay alive (cuattn keeps its split scratch).
    """

    def __init__(self, fn, calls: int = 1):
        self.calls = calls
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graph = _capture(fn, calls, self.stream, self.stream.end_capture)

    def median_ms(self, *, n_warmup: int = 3, n_repeat: int = 20, flush=None,
                  settle_s: float = 0.0) -> float:
        """Median per call over ``n_repeat`` replays (after ``n_warmup``), each between two
        events on the replay stream; ``flush(i)`` (an ``L2Flush``) runs on the same stream
        before every replay, outside the timed region; ``settle_s`` as event_median_ms."""
        with self.stream:
            return event_median_ms(lambda: self.graph.launch(self.stream), cupy.cuda.Event(),
                                   cupy.cuda.Event(), cupy.cuda.get_elapsed_time,
                                   n_warmup=n_warmup, n_repeat=n_repeat, per=self.calls,
                                   before=flush, settle_s=settle_s)


def eager_ms(fn, *, calls: int = 20, n_warmup: int = 1, n_repeat: int = 5,
             settle_s: float = 0.0) -> float:
    """Eager back-to-back: ``calls`` calls of ``fn`` between two CuPy events on CuPy's
    current stream, no sync inside; the median over reps of time / calls.

    What a loop of eager calls costs per call: the GPU time when the kernels are longer
    than the host's launch path (the queue stays ahead), the host time when they are not,
    plus 1/calls of one launch path (the GPU waits for the first call). ``fn`` runs once
    first (compile / load), after a device sync; ``settle_s`` as event_median_ms.
    """
    cupy.cuda.Device().synchronize()
    fn()
    cupy.cuda.Device().synchronize()
    return event_median_ms(lambda: repeat_calls(fn, calls), cupy.cuda.Event(), cupy.cuda.Event(),
                           cupy.cuda.get_elapsed_time, n_warmup=n_warmup, n_repeat=n_repeat,
                           per=calls, settle_s=settle_s)


def wall_ms(fn, sync, *, calls: int = 10, n_warmup: int = 1, n_repeat: int = 3,
            settle_s: float = 0.0) -> float:
    """Wall clock: ``calls`` calls of ``fn`` back to back, then one ``sync(last result)``,
    timed with ``time.perf_counter``; the median over reps of time / calls, in ms.

    The method for libraries without a graph or event API that cuattn can share (JAX: ``fn``
    a jitted call, ``sync`` ``jax.block_until_ready``; cuattn beside it: ``sync`` a device
    synchronize). It counts the host's dispatch of the first call and the sync's wake-up, so
    it is only valid where one call's kernels take milliseconds. ``fn`` runs once first
    (compile), then back to back for ``settle_s`` seconds, untimed (event_median_ms)."""
    sync(fn())
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle_s:
        sync(fn())
    times = []
    for i in range(n_warmup + n_repeat):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        sync(fn())
        if i >= n_warmup:
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return float(statistics.median(times))


def kernel_launches(fn) -> int | None:
    """How many kernels one call of ``fn`` launches: the kernel nodes of a CUDA graph of one
    call (read through cuda.bindings' driver API), or None where that cannot be read.
    (CuPy's own ``Graph`` drops the graph once instantiated, so the capture here ends with
    the raw runtime call, which keeps it.)"""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    runtime = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        raw = _capture(fn, 1, stream, lambda: runtime.streamEndCapture(stream.ptr))
    except Exception:
        return None
    try:
        ok = driver.CUresult.CUDA_SUCCESS
        handle = driver.CUgraph(raw)
        err, _, count = driver.cuGraphGetNodes(handle, 0)
        if err != ok:
            return None
        err, nodes, count = driver.cuGraphGetNodes(handle, count)
        types = [driver.cuGraphNodeGetType(node) for node in nodes[:count]]
        if err != ok or any(e != ok for e, _ in types):
            return None
        kernel = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        return sum(1 for _, t in types if t == kernel)
    except Exception:
        return None
    finally:
        runtime.graphDestroy(raw)


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


@dataclass
class HostCost:
    us: float           # wall time per call: median over batches
    backlog_us: float   # median wait for the device after a batch's last call (sync included)
    calls: int          # calls per batch

    @property
    def gpu_kept_up(self) -> bool:
        """Whether the GPU finished each batch within a few us of its last launch, i.e. the
        loop was host-bound throughout (a GPU that falls behind ends a batch with a backlog
        that grows with the batch)."""
        return self.backlog_us <= max(50.0, 0.05 * self.us * self.calls)


def host_cost(fn, *, n: int = 200, batches: int = 7) -> HostCost:
    """Host-side wall time per call of ``fn()`` (its launch path), GPU work queued, not waited on.

    ``batches`` batches of ``n`` back-to-back calls, each starting with an idle device (a
    device-wide sync before it, so CuPy's and torch's streams alike), timed with
    ``time.perf_counter`` from before the first call to after the last; the median batch
    wins. ``n`` must stay well below the launch queue's depth (~1000 launches), so a batch
    never blocks on a full queue. After each batch the wait for the device is measured: a
    short wait says the GPU kept up, so the time is the host's alone (``gpu_kept_up``).
    """
    import time
    for _ in range(20):
        fn()
    cupy.cuda.Device().synchronize()
    per_call, backlog = [], []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        cupy.cuda.Device().synchronize()
        t2 = time.perf_counter()
        per_call.append((t1 - t0) / n * 1e6)
        backlog.append((t2 - t1) * 1e6)
    return HostCost(statistics.median(per_call), statistics.median(backlog), n)


def host_us_per_call(fn, *, n: int = 200) -> float:
    """Host-side microseconds per call (launch path cost): ``host_cost(fn, n=n).us``."""
    return host_cost(fn, n=n).us


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


def with_path_first(paths: list[str]) -> dict:
    """A copy of this process's environment with ``paths`` first on PYTHONPATH (for a
    subprocess that must import the same trees as this one)."""
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(list(paths) + [p for p in [env.get("PYTHONPATH")] if p])
    return env


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
