"""Lab: sweep the flash_forward tile shape on the current GPU (one call, a few minutes).

python bench/lab/flash_sweep.py [--seqlens 4096 16384]
For each (head dim, causal) of the benchmark configuration it times every candidate
(BLOCK_M, BLOCK_N, NUM_WARPS, STAGES) that compiles without spills, by swapping the
tuning table's choice, and prints TFLOP/s (CUDA-graph replays) with the best marked.
Results go into cuattn/tuning.py by hand, with the numbers in a comment.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import format_table, median_ms
from cuattn import tuning
from cuattn.tuning import FlashTiles

CANDIDATES = {   # all compile for sm_90 with no spills (checked with ptxas -v)
    64: [(64, 128, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 3),
         (64, 64, 4, 3)],
    128: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 4, 2),
          (128, 64, 8, 3)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = ap.parse_args()
    shipped = tuning.flash_tiles
    rows = []
    for hd, cands in CANDIDATES.items():
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // hd
            q, k, v = (cupy.random.standard_normal((b, s, h, hd), dtype=np.float32)
                       .astype(ml_dtypes.bfloat16) for _ in range(3))
            out = cupy.empty_like(q)
            for causal in (False, True):
                flops = 4 * b * h * s * s * hd / (2 if causal else 1)
                row = {"config": f"hd{hd} S{s} {'causal' if causal else 'full'}",
                       "shipped": str(shipped("sm_90", hd, causal))}
                best = (0.0, None)
                for c in cands:
                    tuning.flash_tiles = lambda arch, hd_, causal_, c=c: FlashTiles(*c)
                    try:
                        ms = median_ms(lambda: cuattn.flash_forward(q, k, v, causal=causal,
                                                                    out=out),
                                       graph=3, n_warmup=3, n_repeat=15)
                        tf = flops / ms / 1e9
                        row[str(c)] = round(tf)
                        best = max(best, (tf, c))
                    except Exception as exc:   # report, keep sweeping
                        row[str(c)] = f"error: {str(exc)[:40]}"
                    finally:
                        tuning.flash_tiles = shipped
                row["best"] = str(best[1])
                rows.append(row)
                print(row, flush=True)
            del q, k, v, out
            cupy.get_default_memory_pool().free_all_blocks()
    print(format_table(rows, "flash tile sweep, bf16, TFLOP/s (columns: BM, BN, warps, stages)"))


if __name__ == "__main__":
    main()
