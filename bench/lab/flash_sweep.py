"""Lab: sweep the flash_forward tile shape and kernel knobs on the current GPU (~3 minutes).

python bench/lab/flash_sweep.py [--seqlens 4096 16384] [--hd 64 128] [--only SUBSTR ...]
For each (head dim, causal) of the benchmark configuration it times every candidate
FlashTiles (BLOCK_M, BLOCK_N, NUM_WARPS, STAGES and the knobs q_smem / kv_split / softmax,
see cuda_src/flash_fwd.cuh and bench/NOTES.md (flash)) by forcing it with
``cuattn.tuning.override(flash_tiles=...)`` (which drops the cached launch plans on entry and
exit), and prints TFLOP/s (CUDA-graph replays) with the best marked; the "shipped" column
is the tuning table's choice (cuattn.tuning.flash_tiles). Every candidate's output is
compared with the shipped kernel's (a wrong one is marked WRONG, never best); a candidate
that fails to compile or launch prints its error and the sweep goes on.
Results go into cuattn/tuning.py by hand, with the numbers in a comment.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuattn.tuning import FlashTiles  # noqa: E402  (light: no cupy)


def _t(bm, bn, w, st, **knobs):
    return FlashTiles(bm, bn, w, st, **knobs)


# Every candidate compiled for sm_90 with no spills and no stack, non-causal and causal
# except FULL_ONLY, when this list was written (tests/test_flash.py KNOB_TILES /
# test_knob_tiles_compile_for_sm90_without_spills keep checking the knob space that these
# reach). Registers / smem of each: bench/NOTES.md (flash) (v2 knobs).
# The first of each list was the tuned choice of the v1 measurement (the table's shipped
# choice now is printed in the "shipped" column); the labels are label(t).
CANDIDATES = {
    64: [
        _t(64, 64, 4, 3),                                   # tuned (302/313 | 280/308)
        _t(64, 64, 4, 2),
        _t(64, 128, 4, 2),
        _t(64, 64, 4, 3, kv_split=True),                    # knob 1: K / V groups
        _t(64, 64, 4, 2, kv_split=True),
        _t(64, 128, 4, 3, kv_split=True),
        _t(64, 64, 4, 3, softmax=1),                        # knob 4: branch-free rescale
        _t(128, 32, 4, 2),                                  # 32 rows / warp, Q resident
        _t(128, 32, 4, 3),
        _t(128, 64, 4, 2, q_smem=1),                     # knob 3: 32 rows / warp
        _t(128, 64, 4, 3, q_smem=1),
        _t(128, 64, 4, 3, q_smem=1, kv_split=True),
        _t(128, 128, 4, 2, q_smem=2, softmax=2),         # FA2's hd64 shape (full only)
    ],
    128: [
        _t(64, 64, 4, 2),                                   # tuned (319/353 | 308/358)
        _t(64, 64, 4, 3),
        _t(64, 64, 4, 2, kv_split=True),                    # knob 1
        _t(64, 64, 4, 3, kv_split=True),
        _t(64, 64, 4, 2, softmax=1),                        # knob 4
        _t(64, 32, 4, 3, q_smem=1),                      # 16 rows, <= 168 regs: 3 blocks/SM
        _t(64, 32, 4, 3, q_smem=1, kv_split=True),
        _t(128, 32, 4, 3, q_smem=1),                     # knob 3: 32 rows / warp
        _t(128, 32, 4, 3, q_smem=1, kv_split=True),
        _t(128, 32, 4, 3, q_smem=1, softmax=2),
        _t(128, 64, 4, 2, q_smem=1, softmax=2),          # FA2's hd128 shape (full only)
        _t(128, 64, 4, 2, q_smem=1, kv_split=True, softmax=2),
    ],
}
# Candidates that spill in their causal form (the boundary-tile mask code on top of 192
# accumulator registers): timed non-causal only.
FULL_ONLY = {(64, "128x128x4w2s+qs2+sm2"), (128, "128x64x4w2s+qs+sm2"),
             (128, "128x64x4w2s+qs+kvs+sm2")}


def label(t: FlashTiles) -> str:
    s = f"{t.block_m}x{t.block_n}x{t.num_warps}w{t.stages}s"
    if t.q_smem:
        s += "+qs" if t.q_smem == 1 else f"+qs{t.q_smem}"
    if t.kv_split:
        s += "+kvs"
    if t.softmax:
        s += f"+sm{t.softmax}"
    return s


def _precompile(cands, arch="sm_90", jobs=16):
    """Compile every candidate (non-causal and causal) in parallel before timing."""
    from concurrent.futures import ThreadPoolExecutor

    from cuattn import tuning
    from cuattn.jit import build
    from cuattn.constants import MASK_CAUSAL, MASK_NONE
    todo = {}
    for hd, ts in cands.items():
        for t in ts:
            with tuning.override(flash_tiles=t):
                for causal in (False,) if (hd, label(t)) in FULL_ONLY else (False, True):
                    v = tuning.flash_forward_variant(
                        "bf16", hd, mask=MASK_CAUSAL if causal else MASK_NONE, split=False,
                        arch=arch)
                    todo[v] = label(t)
    with ThreadPoolExecutor(max_workers=jobs) as pool:   # NVRTC releases the GIL
        futs = {pool.submit(build, v, arch): v for v in todo}
        for fut, v in futs.items():
            try:
                fut.result()
            except Exception as exc:   # the timing loop reports it again per config
                print(f"compile FAILED {v.name}: {str(exc)[:300]}", flush=True)


def main():
    import cupy
    import ml_dtypes
    import numpy as np

    import cuattn
    from bench.harness import format_table, median_ms
    from cuattn import tuning
    from cuattn.jit import arch_of_device

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--hd", type=int, nargs="+", default=sorted(CANDIDATES))
    ap.add_argument("--only", nargs="+", default=None,
                    help="time only candidates whose label contains one of these")
    args = ap.parse_args()
    cands = {hd: [t for t in CANDIDATES[hd]
                  if args.only is None or any(o in label(t) for o in args.only)]
             for hd in args.hd}
    arch = arch_of_device(cupy.cuda.Device().id)
    _precompile(cands, arch)
    rows = []
    for hd, ts in cands.items():
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // hd
            q, k, v = (cupy.random.standard_normal((b, s, h, hd), dtype=np.float32)
                       .astype(ml_dtypes.bfloat16) for _ in range(3))
            out = cupy.empty_like(q)
            for causal in (False, True):
                flops = 4 * b * h * s * s * hd / (2 if causal else 1)
                ref = cuattn.flash_forward(q, k, v, causal=causal).astype(np.float32)
                row = {"config": f"hd{hd} S{s} {'causal' if causal else 'full'}",
                       "shipped": label(tuning.flash_tiles(arch, hd, masked=causal))}
                best = (0.0, None)
                for t in ts:
                    if causal and (hd, label(t)) in FULL_ONLY:
                        row[label(t)] = "-"
                        continue
                    try:
                        with tuning.override(flash_tiles=t):
                            ms = median_ms(lambda: cuattn.flash_forward(q, k, v, causal=causal,
                                                                        out=out),
                                           graph=3, n_warmup=3, n_repeat=15)
                        tf = flops / ms / 1e9
                        err = float(cupy.abs(out.astype(np.float32) - ref).max())
                        if not err <= 0.02:   # NaN too
                            row[label(t)] = f"WRONG {round(tf)} (max diff {err:.3g})"
                        else:
                            row[label(t)] = round(tf)
                            best = max(best, (tf, label(t)), key=lambda x: x[0])
                    except Exception as exc:   # report, keep sweeping
                        row[label(t)] = f"error: {type(exc).__name__}: {str(exc)[:60]}"
                row["best"] = str(best[1])
                rows.append(row)
                print(row, flush=True)
                del ref
            q = k = v = out = None   # free them (the timed lambda refers to them)
            cupy.get_default_memory_pool().free_all_blocks()
    print(format_table(rows, "flash sweep, bf16, TFLOP/s (BM x BN x warps w stages s "
                             "+ knobs: qs = q_smem, kvs = kv_split, smN = softmax N; "
                             "- = not timed)"))


if __name__ == "__main__":
    main()
