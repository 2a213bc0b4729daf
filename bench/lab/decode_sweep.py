"""Lab: sweep the paged_attention knobs on the decode configurations that miss their targets.

python bench/lab/decode_sweep.py [--repeat 20] [--knobs LABEL ...] [--flush clean|dirty]

bf16, 32 query heads, head 128, block 16 (the decode suite's shapes). For each configuration
it times every candidate (version x partition_size x the form -- the CUDA-core
PagedSimtVariant or the tensor-core PagedMmaVariant -- and, for the tensor-core form, its
ring: PagedMmaTiles num_warps / stages), each forced with ``cuattn.tuning.override(
paged_form=..., paged_mma=...)`` (which drops the cached launch plans on entry and exit),
with L2 flushed and CUDA graph replays, and prints one Markdown table per configuration with
the best marked, then the host microseconds per call of paged_attention at batch 1 x 4096
(shipped choices, fresh plans). A candidate that fails (compile error, launch error, wrong
result) prints its error in its row. Every candidate's output is checked against the
CUDA-core v2 kernel's (which passed the GPU tests).
Results go into cuattn/tuning.py by hand ("paged" section): paged_form, paged_mma_tiles,
paged_mma_partition / paged_mma_plan, PAGED_SIMT_PARTITION_SIZE / paged_simt_plan.

Retired sweep dimensions: measured, then removed from the kernels (commit d694b98); the
sweeps that measured them are this script at commit d8d8b39 and earlier (git history):
- the CUDA-core form's software PIPELINE, min_blocks and num_threads (bench/NOTES.md "paged
  round 2"): no pipeline, min_blocks 1, threads fixed at tuning.PAGED_SIMT_NUM_THREADS;
- the tensor-core form's 32-token tile and P hi/lo split (p_split) (bench/NOTES.md "paged
  round 3") and L2 evict-first policy (evict_first) ("paged round 4"): 16-token tiles, P
  split and evict-first always on.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import format_table, host_us_per_call, measure_ceilings, median_ms
from cuattn import _launch, jit, tuning
from cuattn.paged.forms import form_for
from cuattn.tuning import PagedMmaTiles

NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 128, 16
BF16 = np.dtype(ml_dtypes.bfloat16)
MIN_CACHE_BYTES = 1 << 30

# (kv heads, batch, ctx, target % of read BW). The misses of the H200 table, plus a control.
CONFIGS = [
    (8, 32, 4096, 90),     # 128k tokens: CUDA-core v2 76%
    (8, 128, 2048, 90),    # 256k tokens: CUDA-core v1 85%, v2 80%
    (8, 8, 32768, 90),     # 256k tokens: CUDA-core v2 80%
    (8, 1, 32768, 75),     # split across partitions: CUDA-core v2 58%
    (32, 32, 4096, 90),    # group 1 (the CUDA-core form's best case): 95%
    (32, 1, 32768, 80),    # group 1, split: 83%
]

# Candidates: (label, form ("simt" = CUDA cores, "mma" = tensor cores), PagedMmaTiles of the
# tensor-core form or None). The first (the CUDA-core form as shipped, which passed the GPU
# tests) is the reference every other output is checked against. The rings are those of
# tests/test_paged.py MMA_RINGS (compiled and checked there); "mma w4 st3" is the table's
# ring at head 128 (tuning.paged_mma_tiles).
KNOBS = [
    (f"cuda-core t{tuning.PAGED_SIMT_NUM_THREADS}", "simt", None),
    ("mma w4 st3", "mma", PagedMmaTiles(num_warps=4, stages=3)),
    ("mma st4", "mma", PagedMmaTiles(stages=4)),
    ("mma st2", "mma", PagedMmaTiles(stages=2)),
    ("mma w8", "mma", PagedMmaTiles(num_warps=8)),
    ("mma w2 st4", "mma", PagedMmaTiles(num_warps=2, stages=4)),
]
# (version, partition_size); v1 only where the whole context is short.
VERSIONS = [("v1", 512), ("v2", 256), ("v2", 512), ("v2", 1024)]


def _use(form, ring):
    """The override that points paged_attention at one candidate (plans dropped on entry
    and exit)."""
    return tuning.override(paged_form=form, **({} if ring is None else {"paged_mma": ring}))


def _make_inputs(kvh, batch, ctx, k_cache, v_cache, num_blocks, rng):
    nblk = ctx // BLOCK_SIZE
    perm = rng.permutation(num_blocks)[: batch * nblk].astype(np.int32)
    block_tables = cupy.asarray(perm.reshape(batch, nblk))
    seq_lens = cupy.full((batch,), ctx, dtype=np.int32)
    q = cupy.asarray(rng.standard_normal((batch, NUM_HEADS, HEAD_SIZE)).astype(BF16))
    return q, block_tables, seq_lens


def _caches(kvh, need_blocks):
    block_bytes = 2 * kvh * HEAD_SIZE * BLOCK_SIZE * BF16.itemsize
    num_blocks = max(need_blocks, -(-MIN_CACHE_BYTES // block_bytes))
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, kvh, HEAD_SIZE, BLOCK_SIZE, BF16)
    k_cache, v_cache = cupy.empty(kshape, dtype=BF16), cupy.empty(vshape, dtype=BF16)
    # Random values (so the result check means something), generated per slab to bound memory.
    for c in (k_cache, v_cache):
        flat = c.reshape(num_blocks, -1)
        for i in range(0, num_blocks, 4096):
            sl = flat[i:i + 4096]
            sl[...] = cupy.random.standard_normal(sl.shape, dtype=np.float32).astype(BF16)
    return k_cache, v_cache, num_blocks


def _variant(kvh, form, ring, ver, ps):
    """The main kernel's key paged_attention runs for this candidate."""
    group = tuning.paged_group(NUM_HEADS // kvh)
    with _use(form, ring):
        return form_for("bf16", HEAD_SIZE, group).variant(
            "bf16", "bf16", HEAD_SIZE, BLOCK_SIZE, group, 0 if ver == "v1" else ps, False)


def _variants(kvh, knobs, versions):
    return [_variant(kvh, form, ring, ver, ps) for _, form, ring in knobs
            for ver, ps in versions]


def _precompile(variants, arch):
    """Compile every candidate in parallel before timing (NVRTC releases the GIL)."""
    def one(v):
        try:
            jit.build(v, arch)
            return None
        except Exception as exc:   # reported again when the candidate runs
            return f"{v.name}: {type(exc).__name__}"
    with ThreadPoolExecutor(8) as pool:
        errs = [e for e in pool.map(one, variants) if e]
    for e in errs:
        print("compile failed:", e, file=sys.stderr)


def _regs(kvh, form, ring, ver, ps):
    v = _variant(kvh, form, ring, ver, ps)
    try:
        f = jit.get_kernel(v, cupy.cuda.Device().id)
        drv = cupy.cuda.driver
        return drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_NUM_REGS, f.ptr)
    except Exception:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--knobs", nargs="*", help="labels of the candidates to time (default: all)")
    ap.add_argument("--flush", default="clean", choices=("clean", "dirty"),
                    help="L2 state before each rep (bench.harness.L2Flush)")
    args = ap.parse_args()
    knobs = [k for k in KNOBS if not args.knobs or k[0] in args.knobs]
    t_start = time.time()
    dev = cupy.cuda.Device()
    arch = jit.arch_of_device(dev.id)
    sms = dev.attributes["MultiProcessorCount"]
    ceil = measure_ceilings(quick=True)
    print(format_table([ceil.row()], "ceilings"))
    print(f"L2 flush before each rep: {args.flush}")
    print(f"defaults: PAGED_SIMT_NUM_THREADS={tuning.PAGED_SIMT_NUM_THREADS}, "
          f"paged_mma_tiles({HEAD_SIZE})={tuning.paged_mma_tiles(HEAD_SIZE)}, "
          f"PAGED_REDUCE_GROUPS={tuning.PAGED_REDUCE_GROUPS}, SMs={sms}\n")
    _precompile([v for kvh in sorted({c[0] for c in CONFIGS})
                 for v in _variants(kvh, knobs, VERSIONS)]
                + [tuning.paged_reduce_variant("bf16", HEAD_SIZE)], arch)
    print(f"(precompiled in {time.time() - t_start:.0f} s)\n", flush=True)

    rng = np.random.default_rng(0)
    summary = []
    for kvh in sorted({c[0] for c in CONFIGS}):
        cfgs = [c for c in CONFIGS if c[0] == kvh]
        k_cache, v_cache, num_blocks = _caches(kvh, max(b * c for _, b, c, _ in cfgs) // BLOCK_SIZE)
        for _, batch, ctx, target in cfgs:
            q, bt, sl = _make_inputs(kvh, batch, ctx, k_cache, v_cache, num_blocks, rng)
            out = cupy.empty_like(q)
            kv_bytes = batch * ctx * kvh * HEAD_SIZE * BF16.itemsize * 2
            with _use(KNOBS[0][1], KNOBS[0][2]):   # the reference candidate, v2
                ref = cuattn.paged_attention(q, k_cache, v_cache, bt, sl, version="v2")
                ref = ref.get().astype(np.float32)
            rows, best = [], None
            for label, form, ring in knobs:
                for ver, ps in VERSIONS:
                    if ver == "v1" and ctx > 4096:
                        continue
                    if ver == "v2" and ps >= ctx:
                        continue
                    row = {"knobs": label, "version": ver if ver == "v1" else f"v2 p{ps}"}
                    try:
                        with _use(form, ring):
                            def call(ver=ver, ps=ps):
                                cuattn.paged_attention(q, k_cache, v_cache, bt, sl,
                                                       version=ver, partition_size=ps, out=out)
                            call()
                            err = float(np.abs(out.get().astype(np.float32) - ref).max())
                            if not err <= 2e-3 + 1e-2 * float(np.abs(ref).max()):
                                raise AssertionError(f"max |out - default| = {err:.3g}")
                            ms = median_ms(call, n_warmup=3, n_repeat=args.repeat,
                                           flush_l2=args.flush, graph=1)
                        gbps = kv_bytes / ms / 1e6
                        pct = 100.0 * gbps / ceil.read_gbps
                        row.update({"regs": _regs(kvh, form, ring, ver, ps), "us": ms * 1e3,
                                    "GB/s": gbps, "% read BW": pct})
                        if best is None or ms < best[0]:
                            best = (ms, len(rows), pct)
                    except Exception as exc:   # report the failure, keep sweeping
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:90]}"
                    rows.append(row)
            if best is not None:
                rows[best[1]]["best"] = "**best**"
                summary.append({"kv heads": kvh, "batch": batch, "ctx": ctx,
                                "best": f"{rows[best[1]]['knobs']} / {rows[best[1]]['version']}",
                                "us": best[0] * 1e3, "% read BW": best[2], "target %": target,
                                "met": "yes" if best[2] >= target else "NO"})
            print(format_table(rows, f"kv heads {kvh}, batch {batch}, ctx {ctx} "
                                     f"(target {target}% of read BW)"), flush=True)
        del k_cache, v_cache
        cupy.get_default_memory_pool().free_all_blocks()
    print(format_table(summary, "best per configuration"))

    # Host cost of the whole Python path at batch 1 x 4096 (8 KV heads), shipped defaults
    # (no override is active here), from fresh plans.
    _launch.clear_plans()
    k_cache, v_cache, num_blocks = _caches(8, 4096 // BLOCK_SIZE)
    q, bt, sl = _make_inputs(8, 1, 4096, k_cache, v_cache, num_blocks, rng)
    out = cupy.empty_like(q)
    host = []
    for ver in ("v1", "v2", "auto"):
        for with_out in (True, False):
            def call(ver=ver, with_out=with_out):
                cuattn.paged_attention(q, k_cache, v_cache, bt, sl, version=ver,
                                       out=out if with_out else None)
            try:
                host.append({"version": ver, "out=": "given" if with_out else "allocated",
                             "host us/call": host_us_per_call(call, n=2000)})
            except Exception as exc:
                host.append({"version": ver, "error": f"{type(exc).__name__}: {exc}"[:100]})
    print(format_table(host, "host cost per call, batch 1 x 4096, 8 KV heads"))
    print(f"total wall time {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
