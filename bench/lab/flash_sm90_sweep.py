"""Lab: sweep the Hopper forward kernel's tiles (BLOCK_M, BLOCK_N, STAGES) on an sm_90 GPU.

python bench/lab/flash_sm90_sweep.py [--seqlens 2048 8192] [--hd 64 128 256] [--prebuild]
Each candidate FlashSm90Tiles is forced with ``tuning.override(flash_sm90_tiles=...)`` and
timed by CUDA-graph replays in the flash suite's configuration (bf16, batch = 16384 // S,
nheads = 2048 // hd), TFLOP/s printed with the table's choice marked "*"; each output is
compared with the table choice's (WRONG: a mismatch, never best); a candidate that fails to
compile or launch prints its error and the sweep goes on. Choices go into
cuattn/tuning.py (FLASH_SM90_TILES) by hand, with the numbers.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402

import cuattn  # noqa: E402
from bench.harness import median_ms, randn  # noqa: E402
from cuattn import tuning  # noqa: E402
from cuattn.tuning import FlashSm90Tiles as T  # noqa: E402

# Candidates (each compiles for sm_90a with no spills, and fits 227 KB of shared memory).
CANDIDATES = {
    64: [T(128, 128, 2), T(128, 128, 3), T(128, 176, 2), T(128, 192, 2), T(128, 96, 3),
         T(128, 64, 4), T(192, 128, 2), T(192, 96, 2), T(192, 128, 3), T(192, 64, 3)],
    128: [T(128, 128, 2), T(128, 128, 3), T(128, 176, 2), T(128, 160, 2), T(128, 96, 3),
          T(128, 80, 3), T(192, 64, 2), T(192, 64, 3), T(192, 80, 2)],
    256: [T(128, 64, 2), T(128, 80, 2), T(128, 48, 3), T(128, 32, 4)],
}


def prebuild(arch: str = "sm_90") -> None:
    """Compile every candidate (both masks, the TMA form) into the disk cache."""
    from cuattn import jit
    from cuattn.constants import MASK_CAUSAL, MASK_NONE
    for hd, ts in CANDIDATES.items():
        for t in ts:
            for mask in (MASK_NONE, MASK_CAUSAL):
                with tuning.override(flash_sm90_tiles=t):
                    v = tuning.flash_sm90_variant("bf16", hd, mask=mask, split=False, tma=True)
                jit.build(v, arch)
                r = jit.compile_variant(v, arch).resources()[v.name]
                print(v.name, r, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--prebuild", action="store_true", help="compile the candidates, no GPU")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return 0
    print("| hd | S | causal | tiles (BMxBNxstages) and TFLOP/s, one cell each |")
    for hd in args.hd:
        table = tuning.FLASH_SM90_TILES[tuning.sm90_head_dim(hd)]
        for s in args.seqlens:
            q, k, v = (randn(16384 // s, s, 2048 // hd, hd) for _ in range(3))
            b, h = q.shape[0], q.shape[2]
            for causal in (False, True):
                flops = 4 * b * h * s * s * hd / (2 if causal else 1)
                ref = cuattn.flash_forward(q, k, v, causal=causal)
                cells = []
                for t in CANDIDATES[hd]:
                    try:
                        with tuning.override(flash_sm90_tiles=t):
                            out = cupy.empty_like(q)
                            ms = median_ms(lambda: cuattn.flash_forward(q, k, v, causal=causal,
                                                                        out=out),
                                           graph=5, n_warmup=2, n_repeat=10)
                            same = bool(cupy.allclose(out.astype(cupy.float32),
                                                      ref.astype(cupy.float32), atol=2e-2))
                        mark = "*" if t == table else ""
                        cells.append(f"{t.block_m}x{t.block_n}x{t.stages}{mark} "
                                     f"{flops / ms / 1e9:.0f}{'' if same else ' WRONG'}")
                    except Exception as exc:   # noqa: BLE001  (report, go on)
                        cells.append(f"{t.block_m}x{t.block_n}x{t.stages} ERROR "
                                     f"{type(exc).__name__}: {str(exc)[:80]}")
                print(f"| {hd} | {s} | {causal} | " + " | ".join(cells) + " |", flush=True)
            del q, k, v
            cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
