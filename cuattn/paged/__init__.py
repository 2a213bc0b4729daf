"""Attention over a paged KV cache, vLLM-style: paged_attention, paged_prefill,
reshape_and_cache, paged_kv_cache_shapes, and block_tables_from_flashinfer.

layout.py: the cache layouts and their checks; forms.py: the two forms of the decode kernel
(tensor cores, CUDA cores) behind one interface; attention.py: paged_attention;
prefill.py: paged_prefill; reshape.py: reshape_and_cache; flashinfer.py: the tables from
FlashInfer's page table.
"""
from __future__ import annotations

from .attention import auto_version, paged_attention
from .flashinfer import block_tables_from_flashinfer
from .layout import (BLOCK_SIZES, HEAD_SIZES, KV_LAYOUTS, NHD_BLOCK_SIZES, PREFILL_HEAD_SIZES,
                     paged_kv_cache_shapes)
from .prefill import paged_prefill
from .reshape import reshape_and_cache

__all__ = ["BLOCK_SIZES", "HEAD_SIZES", "KV_LAYOUTS", "NHD_BLOCK_SIZES", "PREFILL_HEAD_SIZES",
           "auto_version",
           "block_tables_from_flashinfer", "paged_attention", "paged_kv_cache_shapes",
           "paged_prefill", "reshape_and_cache"]
