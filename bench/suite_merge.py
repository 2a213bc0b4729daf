"""merge suite: merge_attn_states bandwidth against the device's copy bandwidth.

Bytes = the two partial outputs and lses read + the output and lse written; the target
(issue 2) is >= 90% of the device-to-device copy bandwidth at 16384 x 32 x 128 bf16.
"""
from __future__ import annotations

import cupy
import numpy as np

import cuattn
from bench.harness import host_us_per_call, median_ms, randn

CONFIGS = [  # (num_tokens, nheads, head_size)
    (512, 32, 128), (4096, 32, 128), (16384, 32, 128), (16384, 8, 64), (16384, 16, 256),
    (65536, 32, 128),
]


def _naive_merge(a, la, b, lb):
    """The same formula in plain CuPy (several kernels, fp32 temporaries): the baseline."""
    m = cupy.maximum(la, lb)
    wa = cupy.exp(la - m).T[..., None]
    wb = cupy.exp(lb - m).T[..., None]
    out = ((a.astype(np.float32) * wa + b.astype(np.float32) * wb) / (wa + wb)).astype(a.dtype)
    return out, m + cupy.log(cupy.exp(la - m) + cupy.exp(lb - m))


def configs(quick: bool) -> list[tuple[int, int, int]]:
    return CONFIGS[1:3] if quick else CONFIGS


def merge_inputs(t: int, h: int, d: int, states: int = 2):
    """``states`` partial outputs (t, h, d) bf16 and their lses (h, t) float32, standard
    normal: (a, la, b, lb) for two states, else (outs, lses) stacked on a leading axis."""
    outs = randn(states, t, h, d)
    lses = randn(states, h, t, dtype=np.float32)
    if states == 2:
        return outs[0], lses[0], outs[1], lses[1]
    return outs, lses


def run(ceilings, quick: bool) -> list[dict]:
    rows = []
    for t, h, d in configs(quick):
        a, la, b, lb = merge_inputs(t, h, d)
        out = cupy.empty_like(a)
        out_lse = cupy.empty_like(la)
        nbytes = 3 * a.nbytes + 3 * la.nbytes
        call = lambda: cuattn.merge_attn_states(a, la, b, lb, out=out, out_lse=out_lse)  # noqa: E731
        ms = median_ms(call, graph=10)       # kernel time: graph replays, no Python between
        ms_eager = median_ms(call)           # one eager call: Python launch path included
        naive = median_ms(lambda: _naive_merge(a, la, b, lb), n_repeat=20)
        gbps = nbytes / ms / 1e6
        rows.append({
            "tokens x heads x dim": f"{t}x{h}x{d}", "MB moved": round(nbytes / 1e6),
            "cuattn us": ms * 1e3, "cuattn GB/s": gbps,
            "% copy BW": 100 * gbps / ceilings.copy_gbps,
            "eager call us": ms_eager * 1e3, "host us/call": host_us_per_call(call),
            "naive cupy us": naive * 1e3, "speedup vs naive": naive / ms_eager,
        })
    return rows
