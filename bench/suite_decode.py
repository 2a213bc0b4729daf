"""Decode benchmark: cuattn.paged_attention v1 / v2 / auto on docs/ARCHITECTURE.md's standard shapes.

bf16, 32 query heads, 8 and 32 KV heads, head 128, block 16. Each configuration's block
tables are a random permutation (blocks drawn without repetition) of a cache much larger
than L2, and L2 is flushed before every rep, so K/V come from memory; kernel time is timed from
CUDA-graph replays (no Python launch gaps). Bandwidth counts the
K+V bytes that must be read: batch * ctx * kv_heads * 128 * 2 B * 2.

The flush leaves L2 full of clean lines (harness.L2Flush "clean"), as the GEMMs before a
decode step leave it. The auto row also gives the time after a "dirty" flush (L2 full of
written lines the kernel pays to write back), and "read us" is the plain read kernel over a
contiguous buffer of the same bytes after the same clean flush: what reading that much costs
at this size, ramp-up and tail included.

    python -m bench.suite_decode [--quick]
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import cupy
import ml_dtypes
import numpy as np

from bench.harness import (Ceilings, format_table, host_us_per_call, measure_ceilings,
                           median_ms, plain_read_ms)

NUM_HEADS = 32
HEAD_SIZE = 128
BLOCK_SIZE = 16
KV_HEADS = (8, 32)
CONFIGS = [(1, 4096), (8, 4096), (32, 4096), (64, 4096), (128, 2048), (1, 32768), (8, 32768),
           (32, 16384)]
QUICK_CONFIGS = [(1, 4096), (32, 4096), (1, 32768), (8, 32768)]
MIN_CACHE_BYTES = 1 << 30          # >> the H200's 60 MB L2
VERSIONS = ("v1", "v2", "auto")


def auto_pick(cuattn_module, q_shape, kv_heads: int, block_size: int, max_blocks: int) -> str:
    """What version="auto" runs for a bf16 call of these shapes (the tree's own rule,
    ``cuattn.paged.auto_version``: "v1" or "v2 p<partition>"), or "?" where that internal
    function is missing or has moved."""
    try:
        return cuattn_module.paged.auto_version(q_shape, ml_dtypes.bfloat16, kv_heads, block_size,
                                                max_blocks, device_id=cupy.cuda.Device().id)
    except Exception:
        return "?"


@dataclass
class DecodeCase:
    """One configuration's inputs: q (batch, 32, 128) bf16 and its paged caches."""
    kv_heads: int
    batch: int
    ctx: int
    q: cupy.ndarray
    k_cache: cupy.ndarray
    v_cache: cupy.ndarray
    block_tables: cupy.ndarray      # a random permutation of the cache's blocks
    seq_lens: cupy.ndarray

    @property
    def kv_bytes(self) -> int:
        """The K and V bytes that must be read."""
        return self.batch * self.ctx * self.kv_heads * HEAD_SIZE * 2 * 2

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]


def decode_cases(cuattn_module, quick: bool):
    """The suite's configurations, kv heads outermost: one cache of >= 1 GB per kv-heads
    count (freed after its configurations), block tables drawn without repetition from it."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    configs = QUICK_CONFIGS if quick else CONFIGS
    for kvh in KV_HEADS:
        block_bytes = 2 * kvh * HEAD_SIZE * BLOCK_SIZE * bf16.itemsize      # K + V
        needed = max(b * c for b, c in configs) // BLOCK_SIZE
        num_blocks = max(needed, -(-MIN_CACHE_BYTES // block_bytes))
        kshape, vshape = cuattn_module.paged_kv_cache_shapes(num_blocks, kvh, HEAD_SIZE,
                                                             BLOCK_SIZE, bf16)
        k_cache = cupy.empty(kshape, dtype=bf16)
        v_cache = cupy.empty(vshape, dtype=bf16)
        # Speed does not depend on the values; a constant fill (bf16 0.75) costs no scratch
        # memory even for the 8.6 GB cache of 32 KV heads.
        k_cache.view(np.uint16).fill(0x3F40)
        v_cache.view(np.uint16).fill(0x3F40)
        for batch, ctx in configs:
            nblk = ctx // BLOCK_SIZE
            perm = cupy.random.permutation(num_blocks)[: batch * nblk].astype(np.int32)
            q = cupy.random.standard_normal((batch, NUM_HEADS, HEAD_SIZE),
                                            dtype=np.float32).astype(bf16)
            yield DecodeCase(kvh, batch, ctx, q, k_cache, v_cache, perm.reshape(batch, nblk),
                             cupy.full((batch,), ctx, dtype=np.int32))
        del k_cache, v_cache
        cupy.get_default_memory_pool().free_all_blocks()


def run(ceilings: Ceilings, quick: bool) -> list[dict]:
    import cuattn
    rows: list[dict] = []
    for case in decode_cases(cuattn, quick):
        out = cupy.empty_like(case.q)
        same_bytes_read_us = 1e3 * plain_read_ms(case.kv_bytes)
        pick = auto_pick(cuattn, case.q.shape, case.kv_heads, BLOCK_SIZE, case.max_blocks)
        for version in VERSIONS:
            def call(version=version):
                cuattn.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                       case.seq_lens, version=version, out=out)
            row = {"kv heads": case.kv_heads, "batch": case.batch, "ctx": case.ctx,
                   "K+V MB": case.kv_bytes / 1e6,
                   "version": version if version != "auto" else f"auto ({pick})"}
            try:
                call()
            except ValueError as e:          # v1 past its shared-memory limit
                row.update({"us": None, "GB/s": None, "% read BW": None,
                            "note": str(e).split(";")[0][:60]})
                rows.append(row)
                continue
            ms = median_ms(call, n_warmup=5, n_repeat=30, flush_l2="clean", graph=1)
            gbps = case.kv_bytes / ms / 1e6
            row.update({"us": ms * 1e3, "GB/s": gbps,
                        "% read BW": 100.0 * gbps / ceilings.read_gbps,
                        "read us": same_bytes_read_us})
            if version == "auto":
                row["us (dirty L2)"] = 1e3 * median_ms(call, n_warmup=5, n_repeat=30,
                                                       flush_l2="dirty", graph=1)
            if case.batch == 1 and case.ctx == 4096:   # small work: the launch path shows
                row["host us/call"] = host_us_per_call(call, n=500)
            rows.append(row)
    return rows


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    ceil = measure_ceilings(quick=quick)
    print(format_table([ceil.row()], "ceilings"))
    print(format_table(run(ceil, quick), "paged decode, bf16, 32 q heads, head 128, block 16"))
