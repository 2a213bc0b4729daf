"""Lab tool: where the Python launch path of a call spends its time (cProfile, GPU needed).

python bench/host_profile.py   -> the top functions over 3000 merge_attn_states calls
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

t, h, d = 64, 32, 128
a = cupy.random.standard_normal((t, h, d), dtype=np.float32).astype(ml_dtypes.bfloat16)
la = cupy.zeros((h, t), dtype=np.float32)
out, out_lse = cupy.empty_like(a), cupy.empty_like(la)
call = lambda: cuattn.merge_attn_states(a, la, a, la, out=out, out_lse=out_lse)  # noqa: E731
for _ in range(100):
    call()
prof = cProfile.Profile()
prof.enable()
for _ in range(3000):
    call()
prof.disable()
cupy.cuda.Device().synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
