"""Lab: paged_prefill over an fp8 e4m3 cache against the same call over a bf16 cache (~20 s).

python bench/lab/prefill_fp8.py
The prefill suite's shapes (bench/suite_prefill.py: bf16 hd128, 32 q / 8 KV heads, random
block tables): a long chunk (8 x 2048 new / ctx 16384) by TFLOP/s, and verification (4 new
tokens, 64 x ctx 16384, L2 flushed) by time; fp8 caches hold random finite e4m3 bytes.
Kernel-only (CUDA-graph replays), both caches in the same run.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from bench.harness import format_table  # noqa: E402
from bench.suite_prefill import CHUNK, PagedCase, _graph_ms  # noqa: E402


def fp8_like(cache):
    """Random finite e4m3 bytes (no 0x7f / 0xff NaN patterns) in the cache's shape."""
    return cupy.random.randint(0, 0x77, cache.shape, dtype=np.uint8)


def main() -> int:
    rows = []
    for name, (batch, ctx, q_len, layout, flush) in {
            "prefill 8 x 2048 / ctx 16384 vllm/16": (8, 16384, CHUNK, "vllm", False),
            "prefill 8 x 2048 / ctx 16384 nhd/16": (8, 16384, CHUNK, "nhd", False),
            "verify 4 new, 64 x ctx 16384 vllm/16": (64, 16384, 4, "vllm", True)}.items():
        case = PagedCase(batch, ctx, q_len, layout, 16)
        bf16_ms = _graph_ms(case.prefill(), flush=flush)
        case.k_cache, case.v_cache = fp8_like(case.k_cache), fp8_like(case.v_cache)
        if layout == "vllm":    # x = 16 one-byte values: (blocks, h, d / 16, bs, 16)
            b, h, g, bs, _ = case.k_cache.shape
            case.k_cache = fp8_like(cupy.empty((b, h, g // 2, bs, 16), np.uint8))
        fp8_ms = _graph_ms(case.prefill(k_scale=0.05, v_scale=0.05), flush=flush)
        rows.append({"call": name, "bf16 cache us": bf16_ms * 1e3, "fp8 cache us": fp8_ms * 1e3,
                     "fp8 / bf16": fp8_ms / bf16_ms,
                     "fp8 TFLOP/s": case.flops / fp8_ms / 1e9})
        del case
        cupy.get_default_memory_pool().free_all_blocks()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
