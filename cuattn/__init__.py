"""cuattn: attention kernels for CuPy, compiled at run time with NVRTC.

Public API (README.md, docs/ARCHITECTURE.md): flash_forward, flash_varlen_forward
(FlashAttention-2 forward), flash_backward, flash_varlen_backward (their gradients),
flash_with_kvcache (new tokens against a dense KV cache, appended first),
paged_attention, paged_prefill, reshape_and_cache, paged_kv_cache_shapes,
block_tables_from_flashinfer (attention over a paged KV cache: decode, and new tokens
against the cache), merge_attn_states, merge_states (combine partial
attentions by their log-sum-exp); cuattn.ring: a ring's steps over a sequence sharded
across ranks (context parallelism, its transport the caller's).
"""
from __future__ import annotations

__version__ = "0.1.0"

from .flash import flash_forward, flash_varlen_forward
from .flash_bwd import flash_backward, flash_varlen_backward
from .kvcache import flash_with_kvcache
from .merge import merge_attn_states, merge_states
from .paged import (block_tables_from_flashinfer, paged_attention, paged_kv_cache_shapes,
                    paged_prefill, reshape_and_cache)
from . import ring

__all__ = ["block_tables_from_flashinfer", "flash_forward", "flash_varlen_forward",
           "flash_backward", "flash_varlen_backward", "flash_with_kvcache",
           "merge_attn_states", "merge_states", "paged_attention", "paged_kv_cache_shapes",
           "paged_prefill", "reshape_and_cache", "__version__"]
