"""Lab (issue 36): the FP8 forward's kernel-only TFLOP/s at the issue's shapes, for A/B runs of
source trees (PYTHONPATH=<tree> python bench/lab/fp8_ab.py [--tiles]; a CUATTN_CACHE_DIR of
its own per tree) and tile candidates (--tiles, through tuning.override). bf16 rows once
with --bf16. Graph method of bench/suite_fp8.py."""
from __future__ import annotations

import argparse
import sys

import cupy
import ml_dtypes

import cuattn
from bench.harness import median_ms, randn
from bench.suite_fp8 import fp8_randn
from cuattn import tuning
from cuattn.tuning import FlashSm90Tiles

CONFIGS = [(128, 4096), (128, 16384), (256, 16384)]
TILES = {128: [FlashSm90Tiles(128, 192, 2), FlashSm90Tiles(128, 128, 3)],
         256: [FlashSm90Tiles(128, 32, 2)]}


def rate(d, s, causal, dtype, tiles=None):
    b, h = 16384 // s, 2048 // d
    mk = fp8_randn if dtype == "fp8" else randn
    q, k, v = (mk(b, s, h, d) for _ in range(3))
    out = cupy.empty((b, s, h, d), ml_dtypes.bfloat16)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    cupy.cuda.Device().synchronize()

    def call():
        cuattn.flash_forward(q, k, v, causal=causal, out=out)
    if tiles is None:
        ms = median_ms(call, graph=5, n_warmup=2, n_repeat=20, settle_s=0.5)
    else:
        with tuning.override(flash_sm90_tiles=tiles):
            ms = median_ms(call, graph=5, n_warmup=2, n_repeat=20, settle_s=0.5)
    return flops / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="")
    ap.add_argument("--tiles", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    for d, s in CONFIGS:
        for causal in (False, True):
            name = f"hd{d} S{s} {'causal' if causal else 'full'}"
            cells = [f"fp8 {rate(d, s, causal, 'fp8'):.0f}"]
            if a.bf16:
                cells.append(f"bf16 {rate(d, s, causal, 'bf16'):.0f}")
            if a.tiles:
                for t in TILES.get(d, []):
                    try:
                        cells.append(f"{t.block_m}x{t.block_n}x{t.stages} "
                                     f"{rate(d, s, causal, 'fp8', t):.0f}")
                    except Exception as e:
                        cells.append(f"{t.block_m}x{t.block_n}x{t.stages} failed {e!s:.80}")
            print(a.tag, name, " | ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
