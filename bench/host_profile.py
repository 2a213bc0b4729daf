"""Lab tool: where the Python launch path of a call spends its time (GPU needed).

python bench/host_profile.py  -> microseconds per call of each layer of a small
merge_attn_states call, then the cProfile top functions over 3000 full calls.
"""
from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy
import ml_dtypes
import numpy as np

import cuattn
from bench.harness import host_us_per_call
from cuattn.jit import get_kernel
from cuattn.merge import PARAMS, MergeVariant


def us_per_call(fn):
    # tiny kernels, so 3000 queued calls stay host-bound
    return host_us_per_call(fn, n=3000)


t, h, d = 64, 32, 128
a = cupy.random.standard_normal((t, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
la = cupy.zeros((h, t), dtype=np.float32)
out, out_lse = cupy.empty_like(a), cupy.empty_like(la)
call = lambda: cuattn.merge_attn_states(a, la, a, la, out=out, out_lse=out_lse)  # noqa: E731
call()
kernel = get_kernel(MergeVariant("bf16", d, False), 0)
fields = dict.fromkeys(PARAMS.offsets(), 0)
params = PARAMS.pack(**fields)
empty = cupy.RawKernel('extern "C" __global__ void k(int x) {}', "k")
print(f"cupy RawKernel, one int argument:   {us_per_call(lambda: empty((1,), (32,), (np.int32(1),))):6.1f} us")
print(f"cupy launch of a struct argument:   {us_per_call(lambda: kernel((1,), (32,), (params,))):6.1f} us")
print(f"ParamsStruct.pack:                  {us_per_call(lambda: PARAMS.pack(**fields)):6.1f} us")
print(f"merge_attn_states, whole call:      {us_per_call(call):6.1f} us")

prof = cProfile.Profile()
prof.enable()
for _ in range(3000):
    call()
prof.disable()
cupy.cuda.Device().synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
