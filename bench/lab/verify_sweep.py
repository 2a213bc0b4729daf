"""Lab: sweep the few-token form's knobs on the verify rows that miss <= 1.15x decode (~1 min).

python bench/lab/verify_sweep.py
paged_prefill's few-token form (multi-token decode on the tensor-core paged kernel) on the
prefill suite's verify shapes (bf16 hd128, 32 q / 8 KV heads, vLLM layout, block 16, 8 new
tokens per sequence; 4 for reference), L2 flushed before every replay: the query heads per
block (tuning.override(multi_token_group=g): g < 4 reads each K/V byte 4 / g times, the
neighbouring blocks' reads from L2) x its ring (tuning.override(paged_mma=
PagedMmaTiles(num_warps, stages))) x num_splits (0: the decode rule, 1: v1, n: v2
partitions of at most n per sequence), each as time over single-token
paged_attention on the same cache (shipped ring) in the same run. Each candidate's output is
compared with the shipped choice's (WRONG: never best). Results go into cuattn/tuning.py
(paged_mma_tiles / paged_multi_token / paged_mma_plan) by hand, with the numbers.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cuattn  # noqa: E402
from bench.harness import format_table, randn  # noqa: E402
from bench.suite_prefill import HEAD, NUM_HEADS, PagedCase, _graph_ms  # noqa: E402
from cuattn import tuning  # noqa: E402
from cuattn.tuning import PagedMmaTiles  # noqa: E402

# (query heads per block, ring); (4, 4w2s) is the shipped choice at 4-8 tokens
CONFIGS = [(4, PagedMmaTiles(4, 2)), (4, PagedMmaTiles(4, 3)), (2, PagedMmaTiles(4, 2)),
           (2, PagedMmaTiles(4, 3)), (1, PagedMmaTiles(4, 3))]
SPLITS = [0, 1, 4]
SHAPES = [(32, 4096, 8), (64, 4096, 8), (32, 4096, 4), (64, 4096, 4), (64, 16384, 8)]


def main():
    rows = []
    for batch, ctx, q_len in SHAPES:
        case = PagedCase(batch, ctx, q_len, "vllm", 16)
        q1 = randn(batch, NUM_HEADS, HEAD)
        out1 = cupy.empty_like(q1)
        decode_ms = _graph_ms(lambda: cuattn.paged_attention(
            q1, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, out=out1),
            flush=True)
        ref = case.prefill()().astype(cupy.float32)
        for group, ring in CONFIGS:
            row = {"config": f"{batch} x ctx {ctx}, {q_len} new", "group": group,
                   "ring": f"{ring.num_warps}w{ring.stages}s"}
            with tuning.override(paged_mma=ring, multi_token_group=group):
                for s in SPLITS:
                    try:
                        got = case.prefill(num_splits=s)().astype(cupy.float32)
                        ok = bool(cupy.abs(got - ref).max() < 2e-2)
                        ms = _graph_ms(case.prefill(num_splits=s), flush=True)
                        row[f"splits {s}"] = f"{ms / decode_ms:.3f}" + ("" if ok else " WRONG")
                    except Exception as e:   # noqa: BLE001 (a lab sweep goes on)
                        row[f"splits {s}"] = f"error {type(e).__name__}"
            rows.append(row)
        print(f"{batch} x ctx {ctx}: decode {decode_ms * 1e3:.0f} us", flush=True)
        del case
        cupy.get_default_memory_pool().free_all_blocks()
    print(format_table(rows, "few-token form: time / single-token decode (graph, L2 flushed)"))


if __name__ == "__main__":
    main()
