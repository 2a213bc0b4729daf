"""One flash_backward call (after a warm-up) for a profiler: bf16, batch = 16384 // S,
nheads = 2048 // hd, causal unless --full.

    ncu --clock-control none -k regex:flash_bwd__ -c 1 --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        python bench/lab/bwd_one.py --hd 128 --seqlen 4096
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuattn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--full", action="store_true")
    a = ap.parse_args()
    s, d = a.seqlen, a.hd
    b, h = 16384 // s, 2048 // d
    rng = np.random.default_rng(0)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((b, s, h, d), np.float32)
                                  .astype(ml_dtypes.bfloat16)) for _ in range(4))
    out, lse = cuattn.flash_forward(q, k, v, causal=not a.full, return_lse=True)
    for _ in range(2):
        cuattn.flash_backward(dout, q, k, v, out, lse, causal=not a.full)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
