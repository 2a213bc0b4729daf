"""prefill suite: cuattn.paged_prefill against the same attention without paging, and
speculative verification against single-token decode on the same cache (issue 11).

bf16, head 128, 32 query / 8 KV heads, random block tables (a permutation of the cache's
blocks). Kernel-only times (CUDA-graph replays, harness.median_ms graph=...) for every row.
- prefill: chunks of CHUNK new tokens at the end of contexts of 4k, 16k, 32k tokens
  (batch = 16384 // CHUNK, so about 16k new tokens run), layouts vllm/16, nhd/16, nhd/64,
  beside flash_varlen_forward on the same K/V laid out contiguously (causal, bottom-right).
  FLOPs = 4 * H * D * (keys each new token sees), summed. "varlen/paged" > 0.95 is the
  target: what paging costs (the four calls of a context in ROUNDS rounds, in turn).
  On Hopper both run the Hopper kernel where it takes the call (both layouts;
  tuning.paged_prefill_path), and "mma.sync us" is the same paged call forced onto the
  mma.sync kernel (tuning.override(flash_path="mma"); the kernel before it).
- verify: 2, 4, 8 new tokens per sequence, batch 32 and 64, contexts 4k and 16k, vllm/16,
  beside paged_attention (one token, same cache); L2 flushed ("clean") before every replay,
  so K/V come from memory. "% read BW": K+V bytes / time over the read ceiling of this run.
  paged_prefill runs its few-token form (multi-token decode); "flash-form us" is the same
  call forced onto the flash kernel (tuning.override(prefill_form="flash")).
- hooks: softcap 30, sinks, and a window of every key but one (the last row's first key; the
  cost of the window code, not of fewer keys; a window of every key runs as the call
  without it) against the same call without them.

    python bench/run.py --suite prefill [--quick]
"""
from __future__ import annotations

import statistics

import cupy
import numpy as np

import cuattn
from cuattn import tuning
from bench.harness import median_ms, randn

NUM_HEADS, KV_HEADS, HEAD = 32, 8, 128
CHUNK = 2048
PREFILL_CONTEXTS = (4096, 16384, 32768)
PREFILL_LAYOUTS = (("vllm", 16), ("nhd", 16), ("nhd", 64))
VERIFY_Q = (2, 4, 8)
VERIFY = ((32, 4096), (64, 4096), (32, 16384), (64, 16384))
QUICK_PREFILL_CONTEXTS = (16384,)
QUICK_VERIFY = ((32, 4096), (64, 16384))
GRAPH_CALLS, GRAPH_REPS = 3, 10
# The prefill rows are compute-bound and compared across kernels: each measurement first runs
# untimed this long, so that each is timed at sustained clocks (bench/NOTES.md, session 7).
SETTLE_S = 0.3
ROUNDS = 3


def new_queries(batch: int, q_len: int):
    """(q, cu_seqlens_q): q_len new tokens for each of batch sequences, packed."""
    return (randn(batch * q_len, NUM_HEADS, HEAD),
            cupy.arange(0, (batch + 1) * q_len, q_len, dtype=np.int32))


class PagedCase:
    """batch sequences of ctx tokens each in a paged cache of ``layout`` / ``block_size``,
    their K/V also contiguous (the same values), and q_len new tokens each at their end."""

    def __init__(self, batch: int, ctx: int, q_len: int, layout: str, block_size: int,
                 contiguous: bool = False):
        self.batch, self.ctx, self.q_len, self.layout = batch, ctx, q_len, layout
        bf16 = randn(1).dtype
        nblk = ctx // block_size
        num_blocks = batch * nblk
        kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, KV_HEADS, HEAD, block_size,
                                                      bf16, kv_layout=layout)
        self.k_cache = randn(*kshape)
        self.v_cache = randn(*vshape)
        self.block_tables = cupy.random.permutation(num_blocks).astype(np.int32).reshape(
            batch, nblk)
        self.seq_lens = cupy.full((batch,), ctx, dtype=np.int32)
        self.q, self.cu_q = new_queries(batch, q_len)
        self.out = cupy.empty_like(self.q)
        if contiguous:
            self.k, self.v = self._gather(self.k_cache, "k"), self._gather(self.v_cache, "v")
            self.cu_k = cupy.arange(0, (batch + 1) * ctx, ctx, dtype=np.int32)

    def _gather(self, cache, which):
        """(batch * ctx, KV_HEADS, HEAD) of the cache's tokens in sequence order."""
        t = self.block_tables.reshape(-1)
        if self.layout == "nhd":                          # (blocks, bs, h, d)
            x = cache[t]
        elif which == "k":                                # (blocks, h, d / 8, bs, 8)
            x = cache[t].transpose(0, 3, 1, 2, 4)
        else:                                             # (blocks, h, d, bs)
            x = cache[t].transpose(0, 3, 1, 2)
        return cupy.ascontiguousarray(x.reshape(-1, KV_HEADS, HEAD))

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.ctx * KV_HEADS * HEAD * 2 * 2

    @property
    def flops(self) -> float:
        keys = sum(self.ctx - self.q_len + i + 1 for i in range(self.q_len))
        return 4.0 * self.batch * NUM_HEADS * HEAD * keys

    def prefill(self, **kw):
        return lambda: cuattn.paged_prefill(
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.cu_q,
            self.q_len, kv_layout=self.layout, out=self.out, **kw)


def _graph_ms(fn, flush=False, settle_s=0.0) -> float:
    return median_ms(fn, graph=GRAPH_CALLS if not flush else 1, n_warmup=2, n_repeat=GRAPH_REPS,
                     flush_l2="clean" if flush else False, settle_s=settle_s)


def prefill_rows(quick: bool) -> list[dict]:
    """Per context: flash_varlen_forward and the three layouts' paged_prefill in ROUNDS
    rounds, taken in turn (_rounds_ms); then each layout once on the mma.sync kernel."""
    rows = []
    for ctx in (QUICK_PREFILL_CONTEXTS if quick else PREFILL_CONTEXTS):
        batch = 16384 // CHUNK
        cases = {f"{layout}/{bs}": PagedCase(batch, ctx, CHUNK, layout, bs, contiguous=i == 0)
                 for i, (layout, bs) in enumerate(PREFILL_LAYOUTS)}
        first = next(iter(cases.values()))      # its K/V also contiguous: the varlen call's
        ms = _rounds_ms({"varlen": lambda: cuattn.flash_varlen_forward(
            first.q, first.k, first.v, first.cu_q, first.cu_k, CHUNK, ctx, causal=True,
            out=first.out), **{name: case.prefill() for name, case in cases.items()}})
        varlen_ms = ms.pop("varlen")
        for name, case in cases.items():
            with tuning.override(flash_path="mma"):
                mma_ms = _graph_ms(case.prefill(), settle_s=SETTLE_S)
            rows.append({"config": f"{batch} x {CHUNK} new / ctx {ctx}", "layout": name,
                         "paged us": ms[name] * 1e3, "varlen us": varlen_ms * 1e3,
                         "paged TFLOP/s": case.flops / ms[name] / 1e9,
                         "varlen/paged": varlen_ms / ms[name], "mma.sync us": mma_ms * 1e3})
        del cases, first, case
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def verify_rows(ceilings, quick: bool) -> list[dict]:
    """Per shape: single-token paged_attention and paged_prefill with each VERIFY_Q new
    tokens in ROUNDS rounds, taken in turn, L2 flushed (_rounds_ms; measured once each in a
    row, the first two calls on a 64 x 4096 cache read ~13% slow in two runs); then each
    on the flash form once."""
    rows = []
    for batch, ctx in (QUICK_VERIFY if quick else VERIFY):
        case = PagedCase(batch, ctx, 1, "vllm", 16)     # its q: one token a sequence
        calls = {1: lambda: cuattn.paged_attention(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, out=case.out)}
        for q_len in VERIFY_Q:
            q, cu_q = new_queries(batch, q_len)
            calls[q_len] = lambda q=q, out=cupy.empty_like(q), cu_q=cu_q, q_len=q_len: \
                cuattn.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables,
                                     case.seq_lens, cu_q, q_len, out=out)
        ms = _rounds_ms(calls, flush=True)
        decode_ms = ms[1]
        for q_len in VERIFY_Q:
            with tuning.override(prefill_form="flash"):
                flash_ms = _graph_ms(calls[q_len], flush=True)
            gbps = case.kv_bytes / ms[q_len] / 1e6
            rows.append({"config": f"{batch} x ctx {ctx}", "new tokens": q_len,
                         "verify us": ms[q_len] * 1e3, "decode us": decode_ms * 1e3,
                         "verify/decode": ms[q_len] / decode_ms, "GB/s": gbps,
                         "% read BW": 100 * gbps / ceilings.read_gbps,
                         "flash-form us": flash_ms * 1e3})
        del case, calls
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _rounds_ms(calls: dict, flush: bool = False) -> dict:
    """Each call's median over ROUNDS rounds of settled graph times, the calls taken in turn
    within a round, so that a drift of the clocks lands on all of them alike (one
    measurement of a call without a hook, taken first, once read 17% slow)."""
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            times[name].append(_graph_ms(fn, flush=flush, settle_s=SETTLE_S))
    return {name: statistics.median(t) for name, t in times.items()}


def hook_rows(quick: bool) -> list[dict]:
    """Each hook against the same call without it (kernel-only, each measurement settled,
    ROUNDS rounds of the call and its hooked forms in turn)."""
    rows = []
    sinks = cupy.random.uniform(-1, 2, NUM_HEADS).astype(np.float32)
    def hooks(ctx, right=0):
        return (("softcap 30", dict(softcap=30.0)), ("sinks", dict(sinks=sinks)),
                ("window, all keys but one", dict(window_size=(ctx - 2, right))))
    cases = [("prefill 8 x 2048 / ctx 16384 nhd/16", PagedCase(8, 16384, CHUNK, "nhd", 16))]
    if not quick:
        cases.append(("verify 4 new, 64 x ctx 4096", PagedCase(64, 4096, 4, "vllm", 16)))
    for name, case in cases:
        ms = _rounds_ms({None: case.prefill(),
                         **{hook: case.prefill(**kw) for hook, kw in hooks(case.ctx)}})
        base = ms.pop(None)
        rows += [{"call": f"paged_prefill {name}", "hook": hook, "us": t * 1e3,
                  "without us": base * 1e3, "cost": t / base - 1} for hook, t in ms.items()]
        del case
    q, k, v = (randn(4, 4096, 32, 128) for _ in range(3))
    out = cupy.empty_like(q)
    for causal in (False, True):
        call = dict(causal=causal, out=out)
        ms = _rounds_ms({None: lambda: cuattn.flash_forward(q, k, v, **call),
                         **{hook: lambda kw=kw: cuattn.flash_forward(q, k, v, **call, **kw)
                            for hook, kw in hooks(4096, 0 if causal else 4094)}})
        base = ms.pop(None)
        rows += [{"call": f"flash_forward hd128 S4096 B4 {'causal' if causal else 'full'}",
                  "hook": hook, "us": t * 1e3, "without us": base * 1e3, "cost": t / base - 1}
                 for hook, t in ms.items()]
    return rows


def run(ceilings, quick: bool) -> list[dict]:
    from bench.harness import format_table
    prefill = prefill_rows(quick)
    print(format_table(prefill, "prefill: paged_prefill vs flash_varlen_forward (graph)"),
          flush=True)
    verify = verify_rows(ceilings, quick)
    print(format_table(verify, "verify: paged_prefill vs paged_attention (graph, L2 flushed)"),
          flush=True)
    hooks = hook_rows(quick)
    print(format_table(hooks, "hooks: cost against the same call without (graph)"), flush=True)
    return prefill + verify + hooks
