"""A/B of two cuattn trees in one process: is any configuration slower in the new tree?

    scripts/ab_prepare.sh OLD_COMMIT DIR        # DIR/cuattn_old/ + DIR/cuda_src/
    PYTHONPATH=. python bench/ab.py --old DIR [--suites flash decode merge verify bwd cpasync] [--quick]
        [--settle S] [--flash-path wgmma|mma] [--json F]

"new" is the ``cuattn`` of this checkout (the tree holding this file), "old" is
``DIR/cuattn_old`` (the old commit's package, renamed; it finds its own kernels in
``DIR/cuda_src``). Both compile into the same ``CUATTN_CACHE_DIR``, where their entries'
digests differ wherever the sources do.
Before timing, both trees' ``python -m <package> precompile`` run side by side (NVRTC in
parallel threads); a variant neither ships compiles at its first call, outside the timing.

Each configuration builds its inputs once; both trees run on those same inputs (each into
its own output). Each tree's call is captured once in a CUDA graph (``harness.CupyGraph``:
``calls`` back-to-back calls per replay), then ``ROUNDS`` (--rounds) rounds alternate the trees
(old, new / new, old / ...), each round one replay median per tree; a tree's time is the
median of its rounds. Kernel-only on both sides, so the host path never enters. ``--settle S``
replays each graph back to back for S seconds before each measurement: without it the
times are those after an idle spell (boost clocks), with 0.3 those of a sustained load,
where a kernel with more instructions per byte than decode may read slower. Decode and
split-KV flash (memory-bound shapes) replay one call after a clean L2 flush
(``harness.L2Flush``), as bench/suite_decode.py does; prefill and merge replay 5 and 10
calls with no flush, as their suites do. "max abs diff" is the largest difference of the
two outputs (a sanity check that both computed the same thing, not a tolerance test);
"spread %" the largest round-to-round spread of either tree, for reading a small ratio.

Configurations: the flash suite's (hd 64 / 128 at S 512..16384 and hd 256 at 2048 / 8192,
causal and not), three split-KV shapes (the num_splits=0 rule splits them), varlen (16
sequences of mixed lengths, 16384 tokens), the decode suite's (kv heads 8 and 32, its
CONFIGS, v1 / v2 / auto), fp8 decode (the CUDA-core form), the merge suite's, and
merge_states with 4 states; "verify" (not run by default): paged_prefill with 2 / 4 / 8
new tokens per sequence, the prefill suite's verify rows; "hooks" (not run by default):
softcap beside the same calls without it (hook_cases); "windows" (not run by default):
flash_forward with sliding windows beside the causal call (window_cases); "bwd" (not run
by default): flash_backward on the backward suite's grid (bwd_cases; a tree without it is
timed on one side only); "cpasync" (not run by default): flash_forward on K/V views that
the Hopper kernel's cp.async producer loads (cpasync_cases). ``--flash-path`` runs the new
tree's calls under ``tuning.override(flash_path=...)``: an A/B of one path's kernels when the
new tree's default path differs from the old one's.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from bench import suite_bwd, suite_decode, suite_flash, suite_merge, suite_prefill  # noqa: E402
from bench.harness import CupyGraph, L2Flush, format_table, randn, with_path_first  # noqa: E402

SLOWER = 1.02                 # new/old above this is flagged
ROUNDS = 3
REPLAYS = {False: (2, 10), True: (3, 20)}     # flush -> (warm-up, timed) replays per round
SPLIT_SHAPES = [  # (batch, seqlen_q, seqlen_k, heads), hd 128, causal: tuning.py's split cases
    (1, 1, 16384, 32), (4, 1, 16384, 32), (1, 64, 16384, 16)]
MERGE_STATES = (4, 16384, 32, 128)                # states, tokens, heads, head size
PRECOMPILE_TIMEOUT_S = 240
AB_SUITES = ("flash", "decode", "merge", "verify", "hooks", "windows", "bwd", "cpasync")
DEFAULT_SUITES = ("flash", "decode", "merge")


@dataclass
class Case:
    """One configuration. ``make(tree)`` returns (the call, its output array) for a tree,
    on inputs the case's generator built once; it raises where the tree refuses them."""
    suite: str
    config: str
    make: Callable
    calls: int = 5            # calls per graph replay
    flush: bool = False       # clean L2 flush before every replay
    detail: Callable | None = None    # detail(tree) -> str shown after the config (auto's pick)


def flash_cases(quick: bool) -> Iterator[Case]:
    for d, s in suite_flash.configs(quick):
        q, k, v = suite_flash.standard_inputs(d, s)
        for causal in (False, True):
            def make(ca, causal=causal):
                out = cupy.empty_like(q)
                return (lambda: ca.flash_forward(q, k, v, causal=causal, out=out)), out
            yield Case("flash", suite_flash.label(d, s, causal), make)


def split_cases(quick: bool) -> Iterator[Case]:
    for b, sq, sk, h in SPLIT_SHAPES[:1] if quick else SPLIT_SHAPES:
        q, k, v = randn(b, sq, h, 128), randn(b, sk, h, 128), randn(b, sk, h, 128)

        def make(ca):
            out = cupy.empty_like(q)
            return (lambda: ca.flash_forward(q, k, v, causal=True, out=out)), out
        yield Case("flash split", f"hd128 B{b} Sq{sq} Sk{sk} H{h} causal", make, calls=1,
                   flush=True)


def _varlen_inputs():
    """The flash suite's varlen sequences (hd128, 16 heads): cu_seqlens, q, k, v, longest."""
    lengths = suite_flash.VARLEN_LENGTHS
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]), dtype=np.int32)
    q, k, v = (randn(sum(lengths), 16, 128) for _ in range(3))
    return cu, q, k, v, max(lengths)


def varlen_cases(quick: bool) -> Iterator[Case]:
    cu, q, k, v, longest = _varlen_inputs()
    total, h = q.shape[0], q.shape[1]
    for causal in (False, True):
        def make(ca, causal=causal):
            out = cupy.empty_like(q)
            return (lambda: ca.flash_varlen_forward(q, k, v, cu, cu, longest, longest,
                                                    causal=causal, out=out)), out
        yield Case("flash varlen", f"hd128 H{h} 16 seqs {total} tokens "
                   f"{'causal' if causal else 'full'}", make)


def decode_cases(quick: bool, new) -> Iterator[Case]:
    versions = ("auto",) if quick else suite_decode.VERSIONS
    for c in suite_decode.decode_cases(new, quick):
        for version in versions:
            def make(ca, version=version):
                out = cupy.empty_like(c.q)
                return (lambda: ca.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables,
                                                   c.seq_lens, version=version, out=out)), out

            def detail(ca):
                return suite_decode.auto_pick(ca, c.q.shape, c.kv_heads, suite_decode.BLOCK_SIZE,
                                              c.max_blocks)
            yield Case("decode", f"kvh{c.kv_heads} {c.batch}x{c.ctx} {version}", make, calls=1,
                       flush=True, detail=detail if version == "auto" else None)


FP8_DECODE = [(8, 32, 4096), (8, 8, 32768), (32, 32, 4096), (8, 1, 32768)]  # kvh, batch, ctx


def fp8_decode_cases(quick: bool) -> Iterator[Case]:
    """The CUDA-core form (fp8 e4m3 caches as uint8, k_scale = v_scale = 0.05): 32 q heads,
    head 128, block 16, random block tables over a cache of >= 1 GB, versions auto and v1."""
    nblk_cache = 1 << 16
    for kvh, batch, ctx in FP8_DECODE[:1] if quick else FP8_DECODE:
        shape_k = (nblk_cache, kvh, 8, 16, 16)                    # x = 16 fp8 values
        shape_v = (nblk_cache, kvh, 128, 16)
        k_cache = cupy.full(shape_k, 0x38, dtype=np.uint8)        # e4m3 1.0
        v_cache = cupy.full(shape_v, 0x30, dtype=np.uint8)        # e4m3 0.5
        nblk = ctx // 16
        tables = cupy.random.permutation(nblk_cache)[: batch * nblk].astype(np.int32)
        tables = tables.reshape(batch, nblk)
        lens = cupy.full((batch,), ctx, dtype=np.int32)
        q = randn(batch, 32, 128)
        for version in ("auto",) if quick else ("auto", "v2"):
            def make(ca, version=version):
                out = cupy.empty_like(q)
                return (lambda: ca.paged_attention(q, k_cache, v_cache, tables, lens,
                                                   k_scale=0.05, v_scale=0.05, version=version,
                                                   out=out)), out
            yield Case("decode fp8", f"kvh{kvh} {batch}x{ctx} {version}", make, calls=1,
                       flush=True)
        del k_cache, v_cache


def merge_cases(quick: bool) -> Iterator[Case]:
    for t, h, d in suite_merge.configs(quick):
        a, la, b, lb = suite_merge.merge_inputs(t, h, d)

        def make(ca):
            out, out_lse = cupy.empty_like(a), cupy.empty_like(la)
            return (lambda: ca.merge_attn_states(a, la, b, lb, out=out, out_lse=out_lse)), out
        yield Case("merge", f"{t}x{h}x{d}", make, calls=10)
    k, t, h, d = MERGE_STATES
    outs, lses = suite_merge.merge_inputs(t, h, d, states=k)

    def make_states(ca):
        out, out_lse = cupy.empty((t, h, d), dtype=outs.dtype), cupy.empty((h, t), np.float32)
        return (lambda: ca.merge_states(outs, lses, out=out, out_lse=out_lse)), out
    yield Case("merge", f"merge_states k{k} {t}x{h}x{d}", make_states, calls=10)


def verify_cases(quick: bool) -> Iterator[Case]:
    """paged_prefill with a few new tokens per sequence (the prefill suite's verify rows):
    vLLM layout, block 16, L2 flushed."""
    for batch, ctx in suite_prefill.QUICK_VERIFY if quick else suite_prefill.VERIFY:
        case = suite_prefill.PagedCase(batch, ctx, 1, "vllm", 16)
        for q_len in suite_prefill.VERIFY_Q:
            q, cu = suite_prefill.new_queries(batch, q_len)

            def make(ca, q=q, cu=cu, q_len=q_len, c=case):
                out = cupy.empty_like(q)
                return (lambda: ca.paged_prefill(q, c.k_cache, c.v_cache, c.block_tables,
                                                 c.seq_lens, cu, q_len, out=out)), out
            yield Case("verify", f"{batch}x{ctx} {q_len} new", make, calls=1, flush=True)


HOOK_HEAD_DIMS = (64, 128, 256)
HOOK_SEQLEN = 4096
HOOKS = (("none", {}), ("softcap", {"softcap": 30.0}))


def hook_cases(quick: bool) -> Iterator[Case]:
    """Softcap (cap 30) beside the same call without it: flash_forward at S 4096 (the flash
    suite's shapes, hd 64 / 128 / 256, full and causal; quick: hd128), flash_varlen_forward
    (varlen_cases' sequences, causal) and paged_prefill 8 x 2048 new tokens / ctx 16384 (the
    prefill suite's hooks row; nhd/16 and vllm/16). Both trees' cost of the hook is the ratio
    of a row to its "none" row."""
    for d in (128,) if quick else HOOK_HEAD_DIMS:
        q, k, v = suite_flash.standard_inputs(d, HOOK_SEQLEN)
        for causal in (False, True):
            for hook, kw in HOOKS:
                def make(ca, causal=causal, kw=kw):
                    out = cupy.empty_like(q)
                    return (lambda: ca.flash_forward(q, k, v, causal=causal, out=out, **kw)), out
                yield Case("hooks", f"{suite_flash.label(d, HOOK_SEQLEN, causal)} {hook}", make)
    cu, q, k, v, longest = _varlen_inputs()
    for hook, kw in HOOKS:
        def make_varlen(ca, kw=kw):
            out = cupy.empty_like(q)
            return (lambda: ca.flash_varlen_forward(q, k, v, cu, cu, longest, longest,
                                                    causal=True, out=out, **kw)), out
        yield Case("hooks", f"varlen hd128 H16 {q.shape[0]} tokens causal {hook}", make_varlen)
    for layout in ("nhd",) if quick else ("nhd", "vllm"):
        c = suite_prefill.PagedCase(8, 16384, suite_prefill.CHUNK, layout, 16)
        for hook, kw in HOOKS:
            def make_paged(ca, c=c, kw=kw):
                out = cupy.empty_like(c.q)
                return (lambda: ca.paged_prefill(
                    c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.cu_q, c.q_len,
                    kv_layout=c.layout, out=out, **kw)), out
            yield Case("hooks", f"paged_prefill 8 x 2048 / ctx 16384 {layout}/16 {hook}",
                       make_paged, calls=3)


# (head dim, seqlen, causal, window_size): a causal call, and windows that cover every key
# (run as the causal kernel where the host drops the side), all keys but one (the window
# form over the causal call's keys), and windows that exclude keys.
WINDOWS = ((128, 4096, True, (-1, -1)), (128, 4096, True, (4095, 0)),
           (128, 4096, True, (4094, 0)), (128, 4096, True, (1024, 0)),
           (128, 4096, False, (256, 256)), (128, 4096, False, (1024, -1)),
           (64, 4096, True, (-1, -1)), (64, 4096, True, (4094, 0)), (64, 4096, True, (1024, 0)),
           (256, 4096, True, (-1, -1)), (256, 4096, True, (4094, 0)),
           (128, 16384, True, (-1, -1)), (128, 16384, True, (4096, 0)))


def window_cases(quick: bool) -> Iterator[Case]:
    """flash_forward (the flash suite's shapes) with the windows of WINDOWS (quick: hd128
    at S 4096)."""
    shape = None
    for d, s, causal, window in WINDOWS:
        if quick and (d, s) != (128, 4096):
            continue
        if (d, s) != shape:       # WINDOWS lists each shape's rows together
            shape, (q, k, v) = (d, s), suite_flash.standard_inputs(d, s)

        def make(ca, q=q, k=k, v=v, causal=causal, window=window):
            out = cupy.empty_like(q)
            return (lambda: ca.flash_forward(q, k, v, causal=causal, window_size=window,
                                             out=out)), out
        yield Case("windows", f"{suite_flash.label(d, s, causal)} window {window}", make)


def bwd_cases(quick: bool) -> Iterator[Case]:
    """flash_backward on the backward suite's rows (suite_bwd.configs: the standard grid and
    the GQA rows), default path, into preallocated gradients; each tree's backward reads its
    own forward's out and lse, computed once when the case is made."""
    shape = None
    for c in suite_bwd.configs(quick):
        if c.shape != shape:      # configs() lists the rows of one shape together
            shape, (q, k, v, dout) = c.shape, suite_bwd.inputs(c)

        def make(ca, c=c, q=q, k=k, v=v, dout=dout):
            out, lse = ca.flash_forward(q, k, v, causal=c.causal, return_lse=True)
            dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
            return (lambda: ca.flash_backward(dout, q, k, v, out, lse, causal=c.causal, dq=dq,
                                              dk=dk, dv=dv)), dq
        yield Case("bwd", c.label, make, calls=3)


def cpasync_cases(quick: bool) -> Iterator[Case]:
    """flash_forward through the Hopper kernel's cp.async producer: K and V as views with
    their rows reversed (a negative stride no tensor map takes), the flash suite's shapes at
    hd 64 / 128 (quick: hd128 S 4096), full and causal."""
    for d, s in suite_flash.configs(quick):
        if d == 256 or (quick and (d, s) != (128, 4096)):
            continue
        q, k, v = suite_flash.standard_inputs(d, s)
        k, v = k[:, ::-1], v[:, ::-1]
        for causal in (False, True):
            def make(ca, q=q, k=k, v=v, causal=causal):
                out = cupy.empty_like(q)
                return (lambda: ca.flash_forward(q, k, v, causal=causal, out=out)), out
            yield Case("cpasync", suite_flash.label(d, s, causal) + " K/V rows reversed", make)


def cases(suites: list[str], quick: bool, new) -> Iterator[Case]:
    if "flash" in suites:
        yield from flash_cases(quick)
        yield from split_cases(quick)
        yield from varlen_cases(quick)
    if "decode" in suites:
        yield from decode_cases(quick, new)
        yield from fp8_decode_cases(quick)
    if "merge" in suites:
        yield from merge_cases(quick)
    if "verify" in suites:
        yield from verify_cases(quick)
    if "hooks" in suites:
        yield from hook_cases(quick)
    if "windows" in suites:
        yield from window_cases(quick)
    if "bwd" in suites:
        yield from bwd_cases(quick)
    if "cpasync" in suites:
        yield from cpasync_cases(quick)


def _max_diff(a, b) -> float | None:
    if a is None or b is None:
        return None
    return float(cupy.abs(a.astype(np.float32) - b.astype(np.float32)).max())


def ab_one(case: Case, trees: dict, flush: L2Flush, rounds: int = ROUNDS,
           settle_s: float = 0.0) -> dict:
    """Time one case on every tree: capture each, then interleaved rounds of replays
    (each measurement settled for ``settle_s`` first: harness.event_median_ms)."""
    graphs, outs, notes = {}, {}, []
    for name, tree in trees.items():
        try:
            fn, outs[name] = case.make(tree)
            graphs[name] = CupyGraph(fn, case.calls)     # runs fn once first: compile / load
        except Exception as exc:                         # refused (e.g. v1 too long): no time
            notes.append(f"{name}: {type(exc).__name__}: {str(exc).split(';')[0]}"[:90])
            outs.pop(name, None)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    order = list(graphs)
    n_warmup, n_repeat = REPLAYS[case.flush]
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(1e3 * graphs[name].median_ms(
                n_warmup=n_warmup, n_repeat=n_repeat, flush=flush if case.flush else None,
                settle_s=settle_s))
    us = {name: statistics.median(t) for name, t in times.items()}
    config = case.config
    if case.detail is not None:
        config += " (" + ", ".join(f"{name} {case.detail(tree)}" for name, tree in trees.items()) \
                  + ")"
    ratio = us["new"] / us["old"] if "new" in us and "old" in us else None
    flag = ("SLOWER" if ratio is not None and ratio > SLOWER else
            "ONE SIDE" if len(us) == 1 else "")
    row = {"suite": case.suite, "config": config, "old us": us.get("old"), "new us": us.get("new"),
           "new/old": ratio, "flag": flag,
           "max abs diff": _max_diff(outs.get("old"), outs.get("new")),
           "spread %": max((100 * (max(t) - min(t)) / statistics.median(t) for t in times.values()),
                           default=None)}
    if notes:
        row["note"] = "; ".join(notes)
    return row


def precompile(trees: dict) -> float:
    """Both trees' ``python -m <package> precompile``, side by side; seconds taken. A failure
    is reported, not fatal: the first calls compile what is missing."""
    t0 = time.perf_counter()
    jobs = max(1, (os.cpu_count() or 2) // len(trees))
    arch = "sm_" + cupy.cuda.Device().compute_capability
    procs = {}
    for name, tree in trees.items():
        env = with_path_first([str(Path(tree.__file__).resolve().parent.parent)])
        cmd = [sys.executable, "-m", tree.__name__, "precompile", "--arch", arch, "-q",
               "-j", str(jobs)]
        procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    for name, proc in procs.items():
        try:
            out = proc.communicate(timeout=PRECOMPILE_TIMEOUT_S)[0].strip().splitlines()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = [f"killed after {PRECOMPILE_TIMEOUT_S} s"] + proc.communicate()[0].splitlines()
        print(f"precompile {name}: {'ok' if proc.returncode == 0 else 'FAILED'}: "
              f"{out[-1] if out else ''}", flush=True)
    return time.perf_counter() - t0


def load_trees(old_dir: Path) -> dict:
    """{"old": cuattn_old from old_dir, "new": this checkout's cuattn}, checked to be two
    different packages that read two different kernel source trees."""
    if not ((old_dir / "cuattn_old" / "__init__.py").is_file() and (old_dir / "cuda_src").is_dir()):
        sys.exit(f"ab: {old_dir} lacks cuattn_old/ or cuda_src/ (scripts/ab_prepare.sh)")
    sys.path.append(str(old_dir))
    new = importlib.import_module("cuattn")
    old = importlib.import_module("cuattn_old")
    sources = {}
    for name, tree in (("old", old), ("new", new)):
        try:
            sources[name] = importlib.import_module(tree.__name__ + ".jit.compiler").cuda_src_dir()
        except Exception:             # internal: may have moved in the new tree
            sources[name] = "?"
        print(f"{name}: {Path(tree.__file__).parent} (kernel sources {sources[name]})")
    if Path(old.__file__).resolve() == Path(new.__file__).resolve() or (
            sources["old"] != "?" and sources["old"] == sources["new"]):
        sys.exit("ab: old and new resolve to the same package or kernel sources")
    return {"old": old, "new": new}


def _warm_gpu(seconds: float = 1.0) -> None:
    """A second of fp16 matmuls, so the first case does not start at idle clocks."""
    a = cupy.ones((4096, 4096), dtype=np.float16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        cupy.matmul(a, a)
        cupy.cuda.Device().synchronize()


def summary(rows: list[dict]) -> list[str]:
    compared = [r for r in rows if r["new/old"] is not None]
    lines = []
    if compared:
        worst = max(compared, key=lambda r: r["new/old"])
        slower = [r for r in compared if r["new/old"] > SLOWER]
        lines.append(f"worst new/old: {worst['new/old']:.3f} ({worst['suite']} {worst['config']})")
        lines.append(f"over {SLOWER}: {len(slower)} of {len(compared)} configurations compared")
    one_side = [r for r in rows if r["flag"] == "ONE SIDE"]
    if one_side:
        lines.append(f"timed on one side only (the other refused or failed): {len(one_side)}: "
                     + "; ".join(f"{r['suite']} {r['config']}" for r in one_side))
    neither = len(rows) - len(compared) - len(one_side)
    if neither:
        lines.append(f"refused by both trees (e.g. v1 past its length limit): {neither}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=Path,
                        help="directory holding cuattn_old/ and cuda_src/ (scripts/ab_prepare.sh)")
    parser.add_argument("--suites", nargs="+", default=list(DEFAULT_SUITES),
                        choices=AB_SUITES)
    parser.add_argument("--quick", action="store_true", help="a few configurations per suite")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"interleaved rounds per configuration (default {ROUNDS})")
    parser.add_argument("--settle", type=float, default=0.0, metavar="S",
                        help="replay each tree's graph back to back for S seconds, untimed, "
                             "before each measurement: the clocks of a sustained load (the "
                             "suites use 0.3); default 0, the clocks after an idle spell")
    parser.add_argument("--flash-path", choices=("wgmma", "mma"),
                        help="the new tree's flash kernels (forward and backward), forced by "
                             "tuning.override(flash_path=...)")
    parser.add_argument("--json", help="write the rows and the summary to this file")
    parser.add_argument("--no-precompile", action="store_true",
                        help="skip the precompile step (first calls compile on demand)")
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    trees = load_trees(args.old.resolve())
    forced = contextlib.ExitStack()     # held for the whole run (the process ends with it)
    if args.flash_path:
        forced.enter_context(trees["new"].tuning.override(flash_path=args.flash_path))
    seconds = {"precompile": 0.0 if args.no_precompile else precompile(trees)}
    flush = L2Flush("clean")
    _warm_gpu()
    rows = []
    t0 = time.perf_counter()
    for case in cases(args.suites, args.quick, trees["new"]):
        rows.append(ab_one(case, trees, flush, args.rounds, args.settle))
        r = rows[-1]
        print(f"{r['suite']:12s} {r['config']:48s} old {r['old us'] or float('nan'):10.1f} us  "
              f"new {r['new us'] or float('nan'):10.1f} us  {r['flag']}", flush=True)
    seconds["timing"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start
    print()
    shown = [{**r, "new/old": None if r["new/old"] is None else f"{r['new/old']:.3f}"}
             for r in rows]
    title = (f"A/B: new ({Path(trees['new'].__file__).parent}) vs old "
             f"({Path(trees['old'].__file__).parent}), kernel-only (CUDA-graph replays), "
             f"us per call, settled {args.settle:g} s")
    print(format_table(shown, title))
    lines = summary(rows) + [f"seconds: precompile {seconds['precompile']:.0f}, "
                             f"timing {seconds['timing']:.0f}, total {seconds['total']:.0f}"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": lines, "seconds": seconds,
                                               "old": str(args.old)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
