"""host suite: the host cost of one call of every public function, beside the floor.

Each row is the wall time per call on the host (``harness.host_cost``: the median of 7
batches of 200 back-to-back eager calls, each batch started on an idle device, GPU work
queued and not waited on) on tiny shapes, whose kernels take a few microseconds, so the GPU
never falls behind: "GPU kept up" checks it (the device was done within a few us of each
batch's last launch). The floor, measured in the same run at the start and again at the end,
is a bare ``cupy.RawKernel`` launch of an empty kernel with one int argument.
"launches" is counted from a CUDA graph of one call (its kernel nodes), or the expected
count with "?" where that cannot be read. Targets (issue 10): one-launch calls <= 2x the
floor, two-launch calls <= 3x. torch SDPA (default backend, eager, (1, 1, 128, 64) bf16) is
there for scale, with no target.

    python -m bench.suite_host [--profile]   # --profile: cProfile top 10 of the slowest op
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
from dataclasses import dataclass

import cupy
import ml_dtypes
import numpy as np

from bench.harness import format_table, host_cost, kernel_launches, randn
from bench.suite_decode import auto_pick

BF16 = np.dtype(ml_dtypes.bfloat16)
TARGET_X_FLOOR = {1: 2.0, 2: 3.0}      # launches per call -> target, x the floor
PROFILE_CALLS = 2000


@dataclass
class Op:
    name: str
    fn: object                  # the call, no arguments
    launches: int | None        # expected kernels per call (None: not known beforehand)
    countable: bool = True      # launches can be counted from a CuPy graph capture
    has_target: bool = True     # issue 10's target applies (not to the floor or torch)


def _floor_op() -> Op:
    empty = cupy.RawKernel('extern "C" __global__ void k(int x) {}', "k")
    arg = (np.int32(0),)
    return Op("floor: empty cupy.RawKernel, one int", lambda: empty((1,), (32,), arg), 1,
              has_target=False)


def _torch_op() -> Op | None:
    from bench import torch_peers
    tt = torch_peers.load()
    if tt is None:
        return None
    torch = tt.torch
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return Op("torch SDPA (1, 1, 128, 64), default backend", lambda: sdpa(q, k, v), None,
              countable=False, has_target=False)


def _auto_launches(cuattn, q, nheads_kv, block_size, max_blocks) -> int | None:
    """Kernels of version="auto" by its own rule: 1 for v1, 2 for v2 (None: rule unknown)."""
    pick = auto_pick(cuattn, q.shape, nheads_kv, block_size, max_blocks)
    return None if pick == "?" else 1 if pick == "v1" else 2


def _cuattn_ops() -> list[Op]:
    import cuattn
    ops = []
    # flash: 128 queries and keys, one head of 64: one key tile, so never split.
    q, k, v = (randn(1, 128, 1, 64) for _ in range(3))
    out = cupy.empty_like(q)
    ops += [Op("flash_forward (1, 128, 1, 64), out=None",
               lambda: cuattn.flash_forward(q, k, v), 1),
            Op("flash_forward, out=", lambda: cuattn.flash_forward(q, k, v, out=out), 1)]
    qs = randn(1, 16, 1, 64)
    ks, vs = randn(1, 512, 1, 64), randn(1, 512, 1, 64)
    outs = cupy.empty_like(qs)
    ops.append(Op("flash_forward num_splits=2 (16 q, 512 k), out=",
                  lambda: cuattn.flash_forward(qs, ks, vs, num_splits=2, out=outs), 2))
    qv, kv, vv = (randn(128, 1, 64) for _ in range(3))
    cu = cupy.asarray([0, 64, 128], dtype=np.int32)
    ops.append(Op("flash_varlen_forward (2 x 64 tokens), out=None",
                  lambda: cuattn.flash_varlen_forward(qv, kv, vv, cu, cu, 64, 64), 1))
    # merge: 16 tokens x 4 heads x 128
    a, b = randn(16, 4, 128), randn(16, 4, 128)
    la, lb = randn(4, 16, dtype=np.float32), randn(4, 16, dtype=np.float32)
    mo, ml = cupy.empty_like(a), cupy.empty_like(la)
    stacked, stacked_lse = randn(3, 16, 4, 128), randn(3, 4, 16, dtype=np.float32)
    ops += [Op("merge_attn_states (16, 4, 128), out=None",
               lambda: cuattn.merge_attn_states(a, la, b, lb), 1),
            Op("merge_attn_states, out=, out_lse=",
               lambda: cuattn.merge_attn_states(a, la, b, lb, out=mo, out_lse=ml), 1),
            Op("merge_states (3 states), out=None",
               lambda: cuattn.merge_states(stacked, stacked_lse), 1)]
    # paged: 1 sequence of 512 tokens, 8 q heads / 2 kv heads, head 128, block 16
    kvh, hs, bs, nblk = 2, 128, 16, 32
    kshape, vshape = cuattn.paged_kv_cache_shapes(nblk, kvh, hs, bs, BF16)
    k_cache, v_cache = randn(*kshape), randn(*vshape)
    pq = randn(1, 8, hs)
    pout = cupy.empty_like(pq)
    tables = cupy.arange(nblk, dtype=np.int32).reshape(1, nblk)
    lens = cupy.asarray([nblk * bs], dtype=np.int32)

    def paged(version, **kw):
        return lambda: cuattn.paged_attention(pq, k_cache, v_cache, tables, lens,
                                              version=version, out=pout, **kw)

    ops += [Op("paged_attention v1 (1 x 512, 8/2 heads), out=", paged("v1"), 1),
            Op("paged_attention v2 p128, out=", paged("v2", partition_size=128), 2),
            Op("paged_attention auto, out=", paged("auto"),
               _auto_launches(cuattn, pq, kvh, bs, nblk))]
    key, value = randn(4, kvh, hs), randn(4, kvh, hs)
    slots = cupy.arange(4, dtype=np.int32)
    ops.append(Op("reshape_and_cache (4 tokens)",
                  lambda: cuattn.reshape_and_cache(key, value, k_cache, v_cache, slots), 1))
    return ops


def _row(op: Op, floor_us: float | None = None) -> dict:
    """One table row; ``floor_us=None``: this op is the floor."""
    try:
        op.fn()                                 # compile / load outside the timing
        cupy.cuda.Device().synchronize()
        cost = host_cost(op.fn)
    except Exception as exc:                    # an op this tree refuses: say so, go on
        return {"op": op.name, "note": f"{type(exc).__name__}: {exc}"[:80]}
    counted = kernel_launches(op.fn) if op.countable else None
    launches = counted if counted is not None else op.launches
    shown = "?" if launches is None else str(launches) + ("" if counted is not None else "?")
    if counted is not None and op.launches is not None and counted != op.launches:
        shown += f" (expected {op.launches})"
    factor = TARGET_X_FLOOR.get(launches) if op.has_target else None
    x_floor = cost.us / (floor_us or cost.us)
    return {"op": op.name, "us/call": cost.us, "x floor": x_floor, "launches": shown,
            "target": None if factor is None else f"<= {factor:g}x",
            "met": None if factor is None else ("yes" if x_floor <= factor else "NO"),
            "GPU backlog us": cost.backlog_us, "GPU kept up": "yes" if cost.gpu_kept_up else "NO"}


def measure() -> tuple[list[dict], Op | None]:
    """The host-cost table, and the slowest cuattn op (for a profile)."""
    floor = _floor_op()
    rows = [_row(floor)]
    floor_us = rows[0]["us/call"]
    peer = _torch_op()
    if peer is not None:
        rows.append(_row(peer, floor_us))
    ops = _cuattn_ops()
    cuattn_rows = [_row(op, floor_us) for op in ops]
    rows += cuattn_rows
    again = _row(floor, floor_us)
    again["op"] = "floor, measured again at the end"
    rows.append(again)
    timed = [(r["us/call"], op) for r, op in zip(cuattn_rows, ops) if "us/call" in r]
    slowest = max(timed, key=lambda t: t[0])[1] if timed else None
    return rows, slowest


def profile_text(op: Op, calls: int = PROFILE_CALLS, top: int = 10) -> str:
    """cProfile of ``calls`` eager calls of ``op``: the top functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        op.fn()
    prof.disable()
    cupy.cuda.Device().synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return f"### cProfile of {calls} calls of {op.name} (slowest op), top {top} by tottime\n" \
           + buf.getvalue()


def run(ceilings, quick: bool) -> list[dict]:
    return measure()[0]          # tiny shapes already: the same in --quick


if __name__ == "__main__":
    rows, slowest = measure()
    print(format_table(rows, "host cost per call (wall time, tiny shapes)"))
    if "--profile" in sys.argv and slowest is not None:
        print(profile_text(slowest))
