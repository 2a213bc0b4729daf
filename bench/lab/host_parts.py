"""Lab: what the pieces of a cuattn call cost on the host, beside the bare launch (GPU needed).

python bench/lab/host_parts.py -> microseconds per call of each piece of the launch path
(bench/suite_host.py's host_cost method: median of batches of calls, the GPU never behind),
so that the host-cost table's "x floor" can be read as a sum of parts:
- the floor: an empty cupy.RawKernel, one int argument;
- the same kernel given a params-sized structured scalar (what every cuattn launch passes);
- a small cupy.empty, a cupy.cuda.alloc, a cupy.ndarray view on an allocation;
- packing one params struct (cuattn._launch.Launch.params);
- the signature of four arrays and five scalars (cuattn._launch._sign);
- a whole flash_forward call with out= given, and with out=None.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from bench.harness import format_table, host_cost, randn  # noqa: E402
from cuattn._launch import Launch, _sign  # noqa: E402
from cuattn.param_structs import FLASH_PARAMS  # noqa: E402


def main() -> None:
    empty = cupy.RawKernel('extern "C" __global__ void k(int x) {}', "k")
    struct_k = cupy.RawKernel('struct P { char b[%d]; };\n'
                              'extern "C" __global__ void k(const P p) {}'
                              % FLASH_PARAMS.dtype.itemsize, "k")
    params = FLASH_PARAMS.pack(**dict.fromkeys(FLASH_PARAMS.offsets(), 0))
    scalars = [n for n in FLASH_PARAMS.offsets() if n not in FLASH_PARAMS.pointer_names()]
    launch = Launch(None, (1,), (32,), 0, FLASH_PARAMS.dtype,
                    tuple(range(1, FLASH_PARAMS.num_pointers + 1)),
                    FLASH_PARAMS.tail(**dict.fromkeys(scalars, 0)))
    ptrs = list(range(FLASH_PARAMS.num_pointers + 1))
    q = randn(1, 128, 1, 64)
    out = cupy.empty_like(q)
    mem = cupy.cuda.alloc(1 << 20)
    pieces = [
        ("floor: empty RawKernel, one int", lambda: empty((1,), (32,), (np.int32(1),))),
        (f"empty kernel, {FLASH_PARAMS.dtype.itemsize}-byte struct scalar",
         lambda: struct_k((1,), (32,), (params,))),
        ("cupy.empty((1, 128, 1, 64), bf16)", lambda: cupy.empty(q.shape, dtype=q.dtype)),
        ("cupy.cuda.alloc(16 KiB)", lambda: cupy.cuda.alloc(16384)),
        ("cupy.ndarray view on an allocation", lambda: cupy.ndarray(q.shape, q.dtype, memptr=mem)),
        ("Launch.params (pack one struct)", lambda: launch.params(ptrs)),
        ("_sign of 4 arrays + 5 scalars", lambda: _sign((q, q, q, out),
                                                        (False, None, (-1, -1), False, 0))),
        ("flash_forward, out=", lambda: cuattn.flash_forward(q, q, q, out=out)),
        ("flash_forward, out=None", lambda: cuattn.flash_forward(q, q, q)),
    ]
    rows = []
    floor = None
    for name, fn in pieces:
        us = host_cost(fn).us
        floor = floor or us
        rows.append({"piece": name, "us/call": us, "x floor": us / floor})
    print(format_table(rows, "host cost of the launch path's pieces"))


if __name__ == "__main__":
    main()
