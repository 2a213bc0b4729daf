"""Lab: the backward's main kernel under compile-time experiments (-D macros of
cuda_src/flash_bwd.cuh's EXP_* knobs) and forced tiles, timed alone (CUDA events over
back-to-back calls of the whole flash_backward; the main kernel is ~95% of it).

    python bench/lab/bwd_knobs.py
"""
from __future__ import annotations

import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from cuattn import flash_bwd, tuning, tuning_bwd  # noqa: E402
from cuattn.jit import arch_of_device, build  # noqa: E402
from cuattn.variants import FlashBwdVariant  # noqa: E402

BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class LabBwd(FlashBwdVariant):
    defines: tuple = ()

    def name_parts(self):
        tag = "_".join(d.replace("EXP_", "").replace("=", "").lower() for d in self.defines)
        return super().name_parts() + ((tag,) if tag else ())

    def source(self):
        return "".join(f"#define {d.replace('=', ' ')}\n" for d in self.defines) + super().source()


_real = tuning_bwd.flash_bwd_variant
_defines: tuple = ()


def _lab_variant(*a, **kw):
    v = _real(*a, **kw)
    return LabBwd(**{f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, defines=_defines)


flash_bwd.tuning_bwd.flash_bwd_variant = _lab_variant

CONFIGS = {   # head dim -> [(tiles, defines)]
    128: [((64, 8, 16), ("EXP_KS_UNROLL=1",)), ((64, 8, 16), ("EXP_KS_UNROLL=2",)),
          ((64, 8, 16), ("EXP_KS_UNROLL=8", "EXP_DQ_UNROLL=8")),
          ((64, 8, 16), ("EXP_KS_UNROLL=1", "EXP_DQ_UNROLL=8")),
          ((64, 8, 32), ("EXP_KS_UNROLL=1",)), ((64, 8, 32), ("EXP_KS_UNROLL=8", "EXP_DQ_UNROLL=8")),
          ((32, 8, 32), ("EXP_KS_UNROLL=8", "EXP_DQ_UNROLL=8"))],
    64: [((64, 8, 32), ("EXP_KS_UNROLL=1",)), ((64, 8, 32), ("EXP_KS_UNROLL=4", "EXP_DQ_UNROLL=8")),
         ((64, 8, 64), ("EXP_KS_UNROLL=4", "EXP_DQ_UNROLL=8")),
         ((128, 8, 32), ("EXP_KS_UNROLL=4", "EXP_DQ_UNROLL=8"))],
}


def inputs(s, d):
    b, h = 16384 // s, 2048 // d
    rng = np.random.default_rng(0)
    return [cupy.asarray(rng.standard_normal((b, s, h, d), np.float32).astype(BF16))
            for _ in range(4)]


def timed(fn, reps=15):
    fn()
    cupy.cuda.Device().synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def main():
    global _defines
    arch = arch_of_device(0)
    keys = []
    for d, configs in CONFIGS.items():
        for tiles, defines in configs:
            for mask in (0, 1):
                _defines = defines
                with tuning.override(flash_bwd_tiles=tuning_bwd.FlashBwdTiles(*tiles)):
                    keys.append(_lab_variant("bf16", d, mask=mask, arch=arch))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda v: build(v, arch), keys))
    s = 4096
    for d, configs in CONFIGS.items():
        q, k, v, dout = inputs(s, d)
        b, _, h, _ = q.shape
        for causal in (False, True):
            out, lse = cuattn.flash_forward(q, k, v, causal=causal, return_lse=True)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
            for tiles, defines in configs:
                _defines = defines
                with tuning.override(flash_bwd_tiles=tuning_bwd.FlashBwdTiles(*tiles)):
                    ms = timed(lambda: cuattn.flash_backward(dout, q, k, v, out, lse, causal=causal))
                print(f"hd{d} S{s} {'causal' if causal else 'full  '} {tiles} {' '.join(defines):40s} "
                      f"{ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
