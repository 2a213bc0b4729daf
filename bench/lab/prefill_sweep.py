"""Lab: sweep paged_prefill's tiles on the current GPU (~2 minutes).

python bench/lab/prefill_sweep.py [--quick]
Forces each candidate FlashTiles with ``cuattn.tuning.override(prefill_tiles=...)`` on the
prefill suite's shapes (bench/suite_prefill.py: bf16 hd128, 32 q / 8 KV heads): the
speculative-verification rows (few rows per KV head: 2, 4, 8 new tokens x 4 heads) by % of
the read bandwidth after a clean L2 flush, and a long chunk (8 x 2048 new / ctx 16384) by
TFLOP/s. Each candidate's output is compared with the tuning table's (WRONG: never best).
Results go into cuattn/tuning.py (PREFILL_FEW_ROWS) by hand, with the numbers.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

from bench.harness import format_table, measure_ceilings  # noqa: E402
from bench.suite_prefill import PagedCase, _graph_ms  # noqa: E402
from cuattn import tuning  # noqa: E402
from cuattn.tuning import FlashTiles  # noqa: E402

FEW = [FlashTiles(16, 32, 1, 3), FlashTiles(16, 64, 1, 3), FlashTiles(16, 32, 1, 4),
       FlashTiles(32, 32, 2, 3), FlashTiles(32, 64, 2, 3), FlashTiles(64, 64, 4, 2),
       FlashTiles(64, 32, 4, 3)]
LONG = [FlashTiles(64, 64, 4, 2), FlashTiles(64, 64, 4, 3), FlashTiles(64, 64, 4, 2, kv_split=True),
        FlashTiles(128, 64, 4, 2), FlashTiles(128, 32, 4, 2), FlashTiles(128, 32, 4, 3),
        FlashTiles(128, 32, 4, 3, q_smem=1), FlashTiles(64, 32, 4, 3)]


def label(t):
    return f"{t.block_m}x{t.block_n}x{t.num_warps}w{t.stages}s" + ("+kvs" if t.kv_split else "") + \
        ("+qs" if t.q_smem else "")


def sweep(case, tiles, score) -> dict:
    """label(t) -> score(case, ms) for each candidate tile (WRONG where its output differs
    from the tuning table's, "error ..." where it does not compile or launch)."""
    ref = case.prefill()().copy()
    cells = {}
    for t in tiles:
        with tuning.override(prefill_tiles=t):
            try:
                got = case.prefill()()
                ok = bool(cupy.allclose(got.astype(cupy.float32), ref.astype(cupy.float32),
                                        atol=2e-2))
                cells[label(t)] = score(case) + ("" if ok else " WRONG")
            except Exception as e:   # noqa: BLE001 (a lab sweep goes on)
                cells[label(t)] = f"error {type(e).__name__}"
    return cells


def main():
    quick = "--quick" in sys.argv
    ceil = measure_ceilings(quick=True)
    print(f"read ceiling {ceil.read_gbps:.0f} GB/s", flush=True)

    def read_bw(case):   # after a clean L2 flush
        ms = _graph_ms(case.prefill(), flush=True)
        return f"{100 * case.kv_bytes / ms / 1e6 / ceil.read_gbps:.0f}%"

    def tflops(case):
        return f"{case.flops / _graph_ms(case.prefill()) / 1e9:.0f}"

    rows = []
    verify = [(32, 4096, 2), (64, 4096, 4), (32, 16384, 8)] if not quick else [(64, 4096, 4)]
    for batch, ctx, q_len in verify:
        case = PagedCase(batch, ctx, q_len, "vllm", 16)
        rows.append({"config": f"verify {batch} x ctx {ctx}, {q_len} new",
                     **sweep(case, FEW, read_bw)})
        del case
        cupy.get_default_memory_pool().free_all_blocks()
    rows.append({"config": "prefill 8 x 2048 / ctx 16384 (TFLOP/s)",
                 **sweep(PagedCase(8, 16384, 2048, "nhd", 16), LONG, tflops)})
    print(format_table(rows, f"paged_prefill tiles (shipped: {tuning.PREFILL_FEW_ROWS})"))


if __name__ == "__main__":
    main()
