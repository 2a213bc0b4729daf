"""Lab: measure the split-KV rule of flash_forward (num_splits=0) on the current GPU.

python bench/lab/flash_splits.py
For short-query / long-key shapes (decode-like prefill, chunked prefill) it times
num_splits = 1, 2, 4, ..., 64 and the automatic choice, and prints microseconds with the
best marked, so the rule (cuattn.tuning.flash_num_splits) and FLASH_MIN_TILES_PER_SPLIT /
FLASH_MAX_SPLITS in cuattn/tuning.py can be checked against measurement. Public API only
(num_splits is an argument of flash_forward): nothing is overridden.
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

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim)
    (1, 1, 8192, 32, 8, 128), (1, 1, 65536, 32, 8, 128), (4, 1, 16384, 32, 8, 128),
    (1, 16, 32768, 32, 32, 128), (1, 64, 16384, 16, 16, 128), (8, 128, 8192, 32, 8, 128),
    (2, 512, 4096, 16, 16, 64),
]
SPLITS = (1, 2, 4, 8, 16, 32, 64)


def main():
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = []
    for b, sq, sk, h, hkv, d in SHAPES:
        q = cupy.random.standard_normal((b, sq, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
        k, v = (cupy.random.standard_normal((b, sk, hkv, d), dtype=np.float32)
                .astype(ml_dtypes.bfloat16) for _ in range(2))
        row = {"shape (b, sq, sk, h, hkv, d)": f"{b},{sq},{sk},{h},{hkv},{d}"}
        times = {}
        for n in (0,) + SPLITS:
            # graph replays (kernel time; the split scratch comes from the pool, which the
            # warm-up call filled, and nothing else allocates during the replays)
            ms = median_ms(lambda: cuattn.flash_forward(q, k, v, causal=True, num_splits=n),
                           graph=3, n_warmup=5, n_repeat=30)
            times[n] = ms
            row["auto" if n == 0 else f"s{n}"] = round(ms * 1e3, 1)
        best = min(SPLITS, key=lambda n: times[n])
        row["best"] = f"s{best}"
        row["auto/best"] = round(times[0] / times[best], 2)
        rows.append(row)
        print(row, flush=True)
    print(format_table(rows, "flash_forward split-KV: microseconds (graph replays), causal, bf16"))


if __name__ == "__main__":
    main()
