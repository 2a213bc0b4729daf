"""One flash_forward call (after a warm-up) for a profiler: fp8 (e4m3, unit descales) or bf16,
batch = 16384 // S, nheads = 2048 // hd (fp8_ab.py's shapes), full unless --causal.

    ncu --clock-control none -k regex:flash_fwd_sm90 --launch-skip 1 -c 1 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python bench/lab/fwd_one.py --dtype fp8 --hd 128 --seqlen 16384
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

import cuattn  # noqa: E402
from bench.harness import randn  # noqa: E402
from bench.suite_fp8 import fp8_randn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    s, d = a.seqlen, a.hd
    b, h = 16384 // s, 2048 // d
    mk = fp8_randn if a.dtype == "fp8" else randn
    q, k, v = (mk(b, s, h, d) for _ in range(3))
    out = cupy.empty((b, s, h, d), ml_dtypes.bfloat16)
    cupy.cuda.Device().synchronize()
    for _ in range(2):
        cuattn.flash_forward(q, k, v, causal=a.causal, out=out)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
