"""Lab: the Hopper backward's tiles (tuning_bwd.FlashBwdSm90Tiles, forced with
tuning.override(flash_bwd_sm90_tiles=...)) beside the mma.sync kernel, at S 4096 (batch =
16384 // S, nheads = 2048 // hd, bf16, causal and full): whole flash_backward calls back to
back between CUDA events (bench/lab/bwd_parts.timed). Head dims 192 and 256 run the Hopper
kernel only when forced (tuning_bwd.FLASH_BWD_SM90_DEFAULT): this says whether they should.

    python bench/lab/bwd_sm90_sweep.py
"""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from cuattn import tuning, tuning_bwd  # noqa: E402
from cuattn.jit import arch_of_device, build  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bwd_parts import timed  # noqa: E402

BF16 = ml_dtypes.bfloat16
CANDIDATES = {   # head dim -> FlashBwdSm90Tiles (block_m, num_wg); None: the mma.sync kernel
    64: [(128, 2), (64, 1), None],
    192: [(64, 1), None],
    256: [(64, 1), None],
}


def _mode(t):
    if t is None:
        return tuning.override(flash_path="mma")
    return tuning.override(flash_path="wgmma", flash_bwd_sm90_tiles=tuning_bwd.FlashBwdSm90Tiles(*t))


def main():
    arch = arch_of_device(0)
    keys = []
    for d, tiles in CANDIDATES.items():
        for t in tiles:
            with _mode(t):
                keys += [tuning_bwd.flash_bwd_variant("bf16", d, mask=m, arch=arch) for m in (0, 1)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda v: build(v, arch), keys))
    s = 4096
    for d, tiles in CANDIDATES.items():
        b, h = 16384 // s, 2048 // d
        rng = np.random.default_rng(0)
        q, k, v, dout = (cupy.asarray(rng.standard_normal((b, s, h, d), np.float32).astype(BF16))
                         for _ in range(4))
        for causal in (False, True):
            out, lse = cuattn.flash_forward(q, k, v, causal=causal, return_lse=True)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            for t in tiles:
                with _mode(t):
                    ms = timed(lambda: cuattn.flash_backward(dout, q, k, v, out, lse,
                                                             causal=causal))
                print(f"hd{d} S{s} {'causal' if causal else 'full  '} "
                      f"{'mma' if t is None else t}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s",
                      flush=True)


if __name__ == "__main__":
    main()
