"""Lab: paged_prefill's long chunks by cache layout and block size, one tree (~40 s).

python bench/lab/prefill_layouts.py
The prefill suite's chunk (bench/suite_prefill.py: 8 x 2048 new tokens at the end of
contexts of 16384, bf16 hd128, 32 q / 8 KV heads, random block tables) over vLLM's layout
(blocks 8, 16, 32) and NHD (16), kernel-only (CUDA-graph replays), each measurement
settled, three rounds in rotating order; TFLOP/s, and the time against nhd/16 of the same
round. Then one small call of each vLLM block size against the mma.sync kernel's output
(max difference: the two kernels' layouts code read the same cache).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

from bench.harness import median_ms  # noqa: E402
from bench.suite_prefill import CHUNK, SETTLE_S, PagedCase  # noqa: E402
from cuattn import tuning  # noqa: E402

ROUNDS = 3
LAYOUTS = (("vllm", 8), ("vllm", 16), ("vllm", 32), ("nhd", 16))


def main() -> None:
    ctx = 16384
    cases = {lb: PagedCase(16384 // CHUNK, ctx, CHUNK, *lb) for lb in LAYOUTS}
    times = {lb: [] for lb in LAYOUTS}
    for r in range(ROUNDS):
        order = LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[:r % len(LAYOUTS)]
        for lb in order:
            times[lb].append(median_ms(cases[lb].prefill(), graph=3, n_warmup=2, n_repeat=10,
                                       settle_s=SETTLE_S))
    base = statistics.median(times[("nhd", 16)])
    for lb in LAYOUTS:
        ms = statistics.median(times[lb])
        print(f"ctx {ctx} {lb[0]}/{lb[1]}: {ms * 1e3:.0f} us, "
              f"{cases[lb].flops / ms / 1e9:.0f} TFLOP/s, time / nhd16 {ms / base:.3f} "
              f"(rounds {', '.join(f'{t * 1e3:.0f}' for t in times[lb])})", flush=True)
    del cases
    cupy.get_default_memory_pool().free_all_blocks()
    for bs in (8, 16, 32):
        case = PagedCase(2, 4096 + 77, 300, "vllm", bs)
        outs = []
        for path in (None, "mma"):
            with tuning.override(**({"flash_path": path} if path else {})):
                case.prefill()()
            outs.append(case.out.astype(cupy.float32).copy())
        print(f"vllm/{bs}: max |hopper - mma.sync| = {float(cupy.abs(outs[0] - outs[1]).max())}")


if __name__ == "__main__":
    main()
