"""Lab: what the L2 state left by the flush costs a decode call.

For a few decode shapes, time (a) the plain read kernel over a contiguous buffer of the same
K+V bytes and (b) paged_attention (auto), each after a "dirty" flush (a 256 MB buffer
written: L2 full of dirty lines the timed kernel must write back) and after a "clean" flush
(the buffer read: L2 full of clean lines). CUDA-graph replays, median of 30.

python bench/lab/decode_flush.py
bf16, 32 query heads, head 128, block 16, random block table over a 1 GB+ cache.
Public API only (shipped choices): nothing is overridden.
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
from bench.harness import format_table, measure_ceilings, median_ms, plain_read_ms

BF16 = np.dtype(ml_dtypes.bfloat16)
HEADS, HS, BS = 32, 128, 16
SHAPES = [(8, 1, 32768), (8, 8, 4096), (8, 1, 4096), (32, 1, 32768), (8, 32, 4096)]


def main():
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    ceil = measure_ceilings(quick=True)
    rows = []
    for kvh, batch, ctx in SHAPES:
        nblk = ctx // BS
        num_blocks = max(batch * nblk, (1 << 30) // (2 * kvh * HS * BS * 2))
        kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, kvh, HS, BS, BF16)
        k = cupy.empty(kshape, BF16)
        v = cupy.empty(vshape, BF16)
        k.view(np.uint16).fill(0x3F40)
        v.view(np.uint16).fill(0x3F40)
        perm = cupy.random.permutation(num_blocks)[: batch * nblk].astype(np.int32)
        bt = perm.reshape(batch, nblk)
        sl = cupy.full((batch,), ctx, np.int32)
        q = cupy.random.standard_normal((batch, HEADS, HS), dtype=np.float32).astype(BF16)
        out = cupy.empty_like(q)
        nbytes = batch * ctx * kvh * HS * 2 * 2

        def decode():
            cuattn.paged_attention(q, k, v, bt, sl, out=out)
        row = {"kv heads": kvh, "batch": batch, "ctx": ctx, "K+V MB": nbytes / 1e6,
               "floor us": nbytes / ceil.read_gbps / 1e3}
        for mode in ("dirty", "clean"):
            row[f"read us ({mode})"] = 1e3 * plain_read_ms(nbytes, flush_l2=mode)
            row[f"paged us ({mode})"] = 1e3 * median_ms(decode, n_warmup=5, n_repeat=30,
                                                        flush_l2=mode, graph=1)
        row["% read BW (clean)"] = 100 * row["floor us"] / row["paged us (clean)"]
        rows.append(row)
        k = v = None   # free the caches (a closure above refers to them)
        cupy.get_default_memory_pool().free_all_blocks()
    print(format_table([ceil.row()], "ceilings"))
    print(format_table(rows, "dirty vs clean L2 before the timed call"))


if __name__ == "__main__":
    main()
