"""The one tuning table: every launch-shape choice of every kernel, with the measurement
behind it. C++ receives these as template parameters and derives everything else.
"""
from __future__ import annotations

# merge_attn_states / merge_states --------------------------------------------------------
# One thread per 16-byte vector; 256 threads per block. H200, bf16, 16384 tokens x 32 heads
# x 128: see bench/NOTES.md (merge v1) for the measured bandwidth.
MERGE_NUM_THREADS = 256

# Head sizes each kernel ships precompiled (precompile's default set); anything else
# that the kernel supports compiles on first use.
MERGE_SHIPPED_HEAD_SIZES = (64, 128, 256)
