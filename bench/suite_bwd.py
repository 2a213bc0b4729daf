"""bwd suite (issue 33): flash_backward TFLOP/s beside PyTorch's FlashAttention-2 and cuDNN
backward and FlashAttention-3's (flash-attn3-jax), each by the same method in the same run.

Configuration: the flash suite's grid (bf16, head dim 64 and 128 at seqlen 512..16384, head
dim 256 at 2048 and 8192; batch = 16384 // seqlen, heads = 2048 // head dim; causal and
full) plus GQA rows (32 query / 8 key-value heads, head dim 128, seqlen 4096 and 16384,
causal). ``--quick``: head dim 128 at 2048, 4096 and 16384, causal and full, and the GQA
rows. FLOPs of the backward = 2.5 x the forward's, the forward's = 4 B Hq Sq Sk D, halved
for causal. "floor ms" is those FLOPs at the run's matmul ceiling; "% matmul" cuattn's
rate over that ceiling.

Only the backward is timed: every library's forward runs once per row, outside the timing,
and its outputs are what its backward reads. dout is standard normal. Columns:
- cuattn: ``flash_backward`` on its default path (the H200's: the Hopper kernel at head dims
  64 and 128), into preallocated dq, dk, dv; cuattn-mma: the same with
  ``tuning.override(flash_path="mma")``; cuattn-det: the default path with
  ``deterministic=True``.
- FA2 / cuDNN: PyTorch's own backward ops of SDPA's FLASH_ATTENTION / CUDNN_ATTENTION
  backends on their forward ops' saved outputs (torch_peers.sdpa_backward_call; autograd
  only where an op refuses, said on stderr).
- FA3 (head dim 128 only): the ``flash-attn3-jax`` wheel's backward (bench.jax_peers), in
  the wall-clock table only; a row whose FA3 output or gradients are not all finite is
  left empty with a note (its non-causal outputs were inf in an earlier run).
Varlen rows (issue 35's target, the flash suite's sequences): flash_varlen_backward over 16
sequences of mixed lengths (suite_flash.VARLEN_LENGTHS, 16384 tokens, hd128, 16 heads)
beside the dense flash_backward of the same total (batch 16 x seqlen 1024), each in TFLOP/s
of the work it does (2.5 x 4 H D sum(len^2), halved for causal), graph-replayed, cuattn only
(SDPA has no varlen backward); their own table ("varlen").
Methods (a ratio only ever divides two rates of one method; "cuattn/FA2" is cuattn's
TFLOP/s over FA2's, > 1: cuattn is faster):
- graph (kernel-only): ``GRAPH_CALLS`` calls captured once in a CUDA graph (CuPy graph /
  torch.cuda.CUDAGraph), median per call over ``GRAPH_REPS`` replays;
- eager: ``EAGER_CALLS`` calls between two CUDA events, no sync inside, median of time /
  calls over ``EAGER_REPS`` reps;
- wall (JAX's only method): ``WALL_CALLS`` calls back to back, one sync, wall time / calls,
  median over ``WALL_REPS`` reps; for FA3 and, beside it, cuattn. Valid here because every
  backward call takes milliseconds (the host's first dispatch and the sync's wake-up are
  small beside it).
Before every measurement the measured call runs untimed for ``SETTLE_S`` seconds (the clocks
of a sustained load: suite_flash). Rep counts are lower than the flash suite's so that the
whole grid stays within about four minutes on an H200 (NVRTC compiles not counted).
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass

import cupy
import numpy as np

import cuattn
from bench import jax_peers, suite_flash, torch_peers
from bench.harness import eager_ms, median_ms, randn, wall_ms
from cuattn import tuning

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
HD256_SEQLENS = (2048, 8192)
QUICK_SEQLENS = (2048, 4096, 16384)       # head dim 128 only
QUICK_HEAD_DIMS = (128,)
GQA_HEADS = (32, 8)                       # query heads, key-value heads
GQA_HEAD_DIM = 128
GQA_SEQLENS = (4096, 16384)               # causal only
TOKENS = 16384                            # batch * seqlen of every row
HEAD_WIDTH = 2048                         # heads * head dim of the standard rows
VARLEN_LENGTHS = suite_flash.VARLEN_LENGTHS   # 16 sequences, 16384 tokens
VARLEN_HEADS, VARLEN_HEAD_DIM = 16, 128
GRAPH_CALLS, GRAPH_REPS = 3, 10
EAGER_CALLS, EAGER_REPS = 10, 3
WALL_CALLS, WALL_REPS = 10, 3
SETTLE_S = 0.2
TORCH_PEERS = (("FA2", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION"))
CUATTN_COLUMNS = ("cuattn", "cuattn-mma", "cuattn-det")
METHODS = ("graph", "eager", "wall")
VARLEN_TAG = "(varlen, graph)"


@dataclass(frozen=True)
class Config:
    head_dim: int
    seqlen: int
    causal: bool
    q_heads: int
    kv_heads: int

    @property
    def batch(self) -> int:
        return TOKENS // self.seqlen

    @property
    def shape(self) -> tuple:
        """What the inputs depend on (rows of one shape share them)."""
        return self.head_dim, self.seqlen, self.q_heads, self.kv_heads

    @property
    def label(self) -> str:
        heads = (f"H{self.q_heads}" if self.q_heads == self.kv_heads
                 else f"H{self.q_heads}/{self.kv_heads}")
        return (f"hd{self.head_dim} S{self.seqlen} B{self.batch} {heads} "
                f"{'causal' if self.causal else 'full'}")


def standard(d: int, s: int, causal: bool) -> Config:
    return Config(d, s, causal, HEAD_WIDTH // d, HEAD_WIDTH // d)


def configs(quick: bool) -> list[Config]:
    """The suite's rows, those of one shape together (full before causal)."""
    if quick:
        shapes = [(d, s) for d in QUICK_HEAD_DIMS for s in QUICK_SEQLENS]
    else:
        shapes = [(d, s) for d in HEAD_DIMS for s in SEQLENS] + [(256, s) for s in HD256_SEQLENS]
    rows = [standard(d, s, causal) for d, s in shapes for causal in (False, True)]
    return rows + [Config(GQA_HEAD_DIM, s, True, *GQA_HEADS) for s in GQA_SEQLENS]


def forward_flops(c: Config) -> float:
    """4 B Hq Sq Sk D (two GEMMs of 2 S S D each per head), halved for causal."""
    return 4 * c.batch * c.q_heads * c.seqlen * c.seqlen * c.head_dim / (2 if c.causal else 1)


def backward_flops(c: Config) -> float:
    """2.5 x the forward's (five GEMMs to the forward's two)."""
    return 2.5 * forward_flops(c)


def inputs(c: Config):
    """(q, k, v, dout) bf16 (B, S, H, D), standard normal; k and v with the kv heads."""
    b, s, d = c.batch, c.seqlen, c.head_dim
    return (randn(b, s, c.q_heads, d), randn(b, s, c.kv_heads, d), randn(b, s, c.kv_heads, d),
            randn(b, s, c.q_heads, d))


def _ratio(a, b):
    return None if a is None or b is None else a / b


def _rates(rates: dict) -> str:
    return " ".join(f"{lib} {'-' if r is None else f'{r:.0f}'}" for lib, r in rates.items())


class _Cuattn:
    """cuattn's backward on one row: the forward once (out, lse), preallocated gradients,
    one callable per column; a refusal (or a tree without flash_backward) leaves the
    column's cells empty and is said once per reason."""

    seen: set = set()

    def __init__(self, c: Config, q, k, v, dout):
        self.c = c
        self.args = (dout, q, k, v)
        self.grads = dict(zip(("dq", "dk", "dv"), (cupy.empty_like(x) for x in (q, k, v))))
        self.residuals = None
        try:
            self.residuals = cuattn.flash_forward(q, k, v, causal=c.causal, return_lse=True)
        except Exception as exc:
            self._say(exc)

    def _say(self, exc: Exception) -> None:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:140]
        if why not in self.seen:
            self.seen.add(why)
            print(f"cuattn backward refused ({self.c.label}): {why}", file=sys.stderr, flush=True)

    def call(self, column: str):
        """The column's callable (run under ``self.mode(column)``), or None."""
        backward = getattr(cuattn, "flash_backward", None)
        if self.residuals is None or backward is None:
            if backward is None:
                self._say(AttributeError("cuattn has no flash_backward in this tree"))
            return None
        out, lse = self.residuals
        deterministic = column == "cuattn-det"

        def call():
            backward(*self.args, out, lse, causal=self.c.causal, deterministic=deterministic,
                     **self.grads)
        return call

    @staticmethod
    def mode(column: str):
        return tuning.override(flash_path="mma") if column == "cuattn-mma" else nullcontext()

    def measure(self, column: str, method: str) -> float | None:
        """ms per call of one column by one method, or None where cuattn refuses."""
        fn = self.call(column)
        if fn is None:
            return None
        try:
            with self.mode(column):
                if method == "graph":
                    return median_ms(fn, graph=GRAPH_CALLS, n_warmup=2, n_repeat=GRAPH_REPS,
                                     settle_s=SETTLE_S)
                if method == "eager":
                    return eager_ms(fn, calls=EAGER_CALLS, n_repeat=EAGER_REPS,
                                    settle_s=SETTLE_S)
                return wall_ms(fn, lambda _: cupy.cuda.Device().synchronize(),
                               calls=WALL_CALLS, n_repeat=WALL_REPS, settle_s=SETTLE_S)
        except Exception as exc:
            self._say(exc)
            cupy.cuda.Device().synchronize()
            return None


def run(ceilings, quick: bool) -> list[dict]:
    rows = []
    tt = torch_peers.load()
    fa3 = jax_peers.load()
    if fa3 is not None:
        print("FA3 (flash-attn3-jax) is timed by wall clock (no graph API): valid where the "
              "kernels take milliseconds, as every backward row here does", flush=True)
    shape = None
    for c in configs(quick):
        if c.shape != shape:       # configs() lists the rows of one shape together
            shape, (q, k, v, dout) = c.shape, inputs(c)
            views = torch_peers.bhsd_views(tt, q, k, v, dout)
            if tt is not None:
                tt.torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()
        rows.append(measure_row(c, ceilings, q, k, v, dout, tt, views, fa3))
    del q, k, v, dout, views
    cupy.get_default_memory_pool().free_all_blocks()
    return rows + varlen_rows(quick)


def varlen_rows(quick: bool) -> list[dict]:
    """flash_varlen_backward over the flash suite's mixed lengths beside the dense call of
    the same total, kernel-only (none in a tree without the backward)."""
    if not hasattr(cuattn, "flash_varlen_backward"):
        return []
    lengths, h, d = VARLEN_LENGTHS, VARLEN_HEADS, VARLEN_HEAD_DIM
    total, n = sum(lengths), len(lengths)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]), dtype=np.int32)
    q, k, v, dout = (randn(total, h, d) for _ in range(4))
    dense = [x.reshape(n, total // n, h, d) for x in (q, k, v, dout)]
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    dense_grads = dict(zip(("dq", "dk", "dv"), (g.reshape(dense[0].shape) for g in grads)))
    longest = max(lengths)
    rows = []
    for causal in (False,) if quick else (False, True):
        half = 2 if causal else 1
        work = {"varlen": 2.5 * 4 * h * d * sum(x * x for x in lengths) / half,
                "dense": 2.5 * 4 * n * h * d * (total // n) ** 2 / half}
        out, lse = cuattn.flash_varlen_forward(q, k, v, cu, cu, longest, longest, causal=causal,
                                               return_lse=True)
        d_out, d_lse = cuattn.flash_forward(*dense[:3], causal=causal, return_lse=True)
        calls = {"varlen": lambda: cuattn.flash_varlen_backward(
                     dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal,
                     dq=grads[0], dk=grads[1], dv=grads[2]),
                 "dense": lambda: cuattn.flash_backward(dense[3], *dense[:3], d_out, d_lse,
                                                        causal=causal, deterministic=False,
                                                        **dense_grads)}
        rates = {name: work[name] / median_ms(fn, graph=GRAPH_CALLS, n_warmup=2,
                                              n_repeat=GRAPH_REPS, settle_s=SETTLE_S) / 1e9
                 for name, fn in calls.items()}
        mode = "causal" if causal else "full"
        row = {"config": f"varlen hd{d} {n} seqs {total} tokens {mode}",
               f"cuattn TFLOP/s {VARLEN_TAG}": rates["varlen"],
               f"dense B{n}xS{total // n} TFLOP/s {VARLEN_TAG}": rates["dense"],
               f"varlen/dense {VARLEN_TAG}": rates["varlen"] / rates["dense"]}
        print(row["config"], " ".join(f"{key} {value:.3g}" for key, value in row.items()
                                      if key != "config"), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def measure_row(c: Config, ceilings, q, k, v, dout, tt, views, fa3) -> dict:
    flops = backward_flops(c)

    def tflops(ms):
        return None if ms is None else flops / ms / 1e9

    rates = {m: {} for m in METHODS}
    ours = _Cuattn(c, q, k, v, dout)
    for column in CUATTN_COLUMNS:
        for method in ("graph", "eager"):
            rates[method][column] = tflops(ours.measure(column, method))
    for name, backend in TORCH_PEERS:
        g_ms = e_ms = None
        call, route = (None, "no torch") if views is None else torch_peers.sdpa_backward_call(
            tt, *views, causal=c.causal, backend_name=backend)
        if views is not None and route != "aten":
            print(f"{name} backward ({c.label}): {route}", file=sys.stderr, flush=True)
        if call is not None:
            g_ms, e_ms = torch_peers.both_methods(
                tt, call, f"{name} backward", graph_calls=GRAPH_CALLS, eager_calls=EAGER_CALLS,
                graph_reps=GRAPH_REPS, eager_reps=EAGER_REPS, settle_s=SETTLE_S)
        del call                   # its saved forward outputs go back to torch's cache
        rates["graph"][name], rates["eager"][name] = tflops(g_ms), tflops(e_ms)
    note = None
    if fa3 is not None and c.head_dim in jax_peers.FA3_HEAD_DIMS:
        call, finite = jax_peers.fa3_backward(fa3, q, k, v, dout, causal=c.causal)
        if call is None:
            note = f"FA3 {finite}"
        elif not finite:
            note = "FA3 output or gradients not finite: left out"
        else:
            rates["wall"]["FA3"] = tflops(jax_peers.fa3_wall_ms(
                fa3, call, calls=WALL_CALLS, n_repeat=WALL_REPS, settle_s=SETTLE_S))
            rates["wall"]["cuattn"] = tflops(ours.measure("cuattn", "wall"))
        del call
        if note:
            print(f"{c.label}: {note}", file=sys.stderr, flush=True)
    row = {"config": c.label, "floor ms": flops / ceilings.matmul_tflops / 1e9,
           "% matmul (graph)": _ratio(rates["graph"]["cuattn"], ceilings.matmul_tflops / 100)}
    for method in ("graph", "eager"):
        row.update({f"{lib} TFLOP/s ({method})": r for lib, r in rates[method].items()})
        row.update({f"cuattn/{name} ({method})": _ratio(rates[method]["cuattn"],
                                                        rates[method][name])
                    for name, _ in TORCH_PEERS})
    if rates["wall"]:
        row.update({f"{lib} TFLOP/s (wall)": r for lib, r in rates["wall"].items()})
        row["cuattn/FA3 (wall)"] = _ratio(rates["wall"].get("cuattn"), rates["wall"].get("FA3"))
    if note:
        row["note"] = note
    # progress (stderr: the tables come at the end), so that a cut-off run still tells
    print(c.label, " | ".join(f"{m} {_rates(r)}" for m, r in rates.items() if r),
          file=sys.stderr, flush=True)
    return row


def tables(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """The rows as one table per method (bench/run.py prints these; --json keeps the rows):
    each keeps the configuration and floor, and its own method's columns."""
    titles = {"graph": "kernel-only (CUDA graph replays), TFLOP/s",
              "eager": "eager back-to-back (CUDA events), TFLOP/s",
              "wall": "wall clock (N calls, one sync; JAX's method, valid for ms-long "
                      "kernels), TFLOP/s, head dim 128"}
    out = []
    varlen = [r for r in rows if any(key.endswith(VARLEN_TAG) for key in r)]
    rows = [r for r in rows if r not in varlen]
    for method in METHODS:
        tagged = f"({method})"
        table = []
        for r in rows:
            cells = {key: value for key, value in r.items() if key.endswith(tagged)}
            if method == "wall":
                if not cells and "note" not in r:
                    continue
                cells["note"] = r.get("note")
            table.append({"config": r["config"], "floor ms": r["floor ms"], **cells})
        if table:
            out.append((titles[method], table))
    if varlen:
        out.append(("varlen beside the dense call of the same total (CUDA graph replays), "
                    "TFLOP/s", varlen))
    return out
