"""Lab: paged_prefill's long chunks, this tree against another cuattn tree (~50 s).

python bench/lab/prefill_ab.py DIR [PKG]
DIR holds the other tree as PKG (default cuattn_old) beside its cuda_src/, as
scripts/ab_prepare.sh lays out an old commit, or a patched copy (bench/lab/*.patch). The
prefill suite's chunk rows (bench/suite_prefill.py: 8 x 2048 new tokens, contexts 4k, 16k,
32k, bf16 hd128, 32 q / 8 KV heads, random block tables) over NHD caches of blocks 8, 16 and
64, kernel-only (CUDA-graph replays), each measurement settled, three rounds in alternating
order; then the two trees' outputs on one call of each small block size (max difference).
"""
from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cuattn  # noqa: E402
from bench.harness import median_ms  # noqa: E402
from bench.suite_prefill import CHUNK, SETTLE_S, PagedCase  # noqa: E402

ROUNDS = 3


def main(other_dir: str, other_pkg: str = "cuattn_old") -> None:
    sys.path.append(str(Path(other_dir).resolve()))
    trees = {"this": cuattn, "other": importlib.import_module(other_pkg)}

    def call(ca, case):
        return lambda: ca.paged_prefill(case.q, case.k_cache, case.v_cache, case.block_tables,
                                        case.seq_lens, case.cu_q, case.q_len,
                                        kv_layout=case.layout, out=case.out)
    for ctx in (4096, 16384, 32768):
        for bs in (8, 16, 64):
            case = PagedCase(16384 // CHUNK, ctx, CHUNK, "nhd", bs)
            times = {name: [] for name in trees}
            for r in range(ROUNDS):
                for name in list(trees)[::1 if r % 2 == 0 else -1]:
                    times[name].append(median_ms(call(trees[name], case), graph=3, n_warmup=2,
                                                 n_repeat=10, settle_s=SETTLE_S))
            ms = {name: statistics.median(t) for name, t in times.items()}
            print(f"ctx {ctx} nhd/{bs}: this {ms['this'] * 1e3:.0f} us "
                  f"({case.flops / ms['this'] / 1e9:.0f} TFLOP/s), other "
                  f"{ms['other'] * 1e3:.0f} us ({case.flops / ms['other'] / 1e9:.0f}), "
                  f"other / this {ms['other'] / ms['this']:.3f}", flush=True)
            del case
            cupy.get_default_memory_pool().free_all_blocks()
    for bs in (8, 16):
        case = PagedCase(2, 4096 + 77, 300, "nhd", bs)
        outs = [call(ca, case)().astype(cupy.float32) for ca in trees.values()]
        print(f"nhd/{bs}: max |this - other| = {float(cupy.abs(outs[0] - outs[1]).max())}")


if __name__ == "__main__":
    main(*sys.argv[1:])
