"""Lab: host microseconds per paged_attention call, separated from GPU back-pressure.

python bench/lab/paged_host.py -> for v1 / v2 / auto, a tiny problem (1 sequence of 16
tokens: the GPU never falls behind) and the decode suite's 1 x 4096 (8 KV heads), at
several queue lengths, plus the cProfile top functions of the tiny v2 call.
Shipped choices, public API only; each call after the first of its signature is a plan-cache
hit (cuattn._launch), which is the path measured. (Every public op at once:
python -m bench.suite_host [--profile].)
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import host_us_per_call

BF16 = np.dtype(ml_dtypes.bfloat16)


def inputs(ctx):
    kshape, vshape = cuattn.paged_kv_cache_shapes(ctx // 16 + 1, 8, 128, 16, BF16)
    k = cupy.zeros(kshape, BF16)
    v = cupy.zeros(vshape, BF16)
    bt = cupy.arange(ctx // 16, dtype=np.int32).reshape(1, -1)
    sl = cupy.full((1,), ctx, np.int32)
    q = cupy.zeros((1, 32, 128), BF16)
    return q, k, v, bt, sl


def main():
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for ctx in (16, 4096):
        args = inputs(ctx)
        out = cupy.empty_like(args[0])
        for version in ("v1", "v2", "auto"):
            def call(version=version):
                cuattn.paged_attention(*args, version=version, out=out)
            row = [f"{host_us_per_call(call, n=n):6.1f}" for n in (200, 500, 2000)]
            print(f"ctx {ctx:5d} {version:4s} host us/call at n = 200 / 500 / 2000: "
                  f"{' / '.join(row)}")

    args = inputs(16)
    out = cupy.empty_like(args[0])
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        cuattn.paged_attention(*args, version="v2", out=out)
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
