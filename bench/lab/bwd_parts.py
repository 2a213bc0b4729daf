"""Where the backward's time goes: each launch of one flash_backward plan timed alone
(CUDA events over back-to-back launches), beside the whole call, for a few shapes and forced
tile choices (cuattn.tuning.override(flash_bwd_tiles=...)).

    python bench/lab/bwd_parts.py [--tiles BMxWxQC ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from cuattn import flash_bwd, tuning, tuning_bwd  # noqa: E402

BF16 = ml_dtypes.bfloat16


def timed(fn, reps=20):
    fn()
    cupy.cuda.Device().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def case(s, d, causal, tiles=None):
    b, h = 16384 // s, 2048 // d
    rng = np.random.default_rng(0)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((b, s, h, d), np.float32).astype(BF16))
                     for _ in range(4))
    out, lse = cuattn.flash_forward(q, k, v, causal=causal, return_lse=True)
    call = lambda: cuattn.flash_backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    ctx = tuning.override(flash_bwd_tiles=tiles) if tiles else tuning.override()
    with ctx:
        call()
        plan = next(p for p in flash_bwd._plans.values())
        whole = timed(call)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        parts = []
        ptrs = [0] + [a.data.ptr for a in (dout, q, k, v, out, lse)] + [0] * 5
        outs = plan.allocate_outputs()
        ptrs += [o.data.ptr for o in outs]
        scratch = cupy.cuda.alloc(plan.scratch_bytes)
        ptrs += [scratch.ptr + off for off in plan.scratch]
        for launch in plan.launches:
            def one(launch=launch):
                launch.kernel(launch.grid, launch.block, (launch.params(ptrs),),
                              shared_mem=launch.smem)
            parts.append((launch.kernel.name if hasattr(launch.kernel, "name") else "?",
                          timed(one)))
        flash_bwd._plans.clear()
    label = f"hd{d} S{s} {'causal' if causal else 'full'} {tiles or 'table'}"
    print(f"{label}: whole {whole:.3f} ms = {flops / whole / 1e9:.0f} TFLOP/s; " +
          ", ".join(f"{n[-40:]} {t:.3f}" for n, t in parts), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="*", default=[])
    a = ap.parse_args()
    tiles = [None] + [tuning_bwd.FlashBwdTiles(*map(int, t.split("x"))) for t in a.tiles]
    for d in (64, 128):
        for s in (4096,):
            for causal in (False, True):
                for t in tiles:
                    try:
                        case(s, d, causal, t)
                    except Exception as exc:   # a forced tile may not fit this head dim
                        print(f"hd{d} {t}: {exc!r:.200}", flush=True)


if __name__ == "__main__":
    main()
