"""The paged KV cache layouts, their shapes and the checks every paged op shares.

kv_layout="vllm" (vLLM's paged-attention kernels): K cache (num_blocks, nheads_kv,
head_size // x, block_size, x) with x = 16 // itemsize: the x elements (16 bytes) of one
token are contiguous, then the same 16 bytes of the next token of the block. V cache
(num_blocks, nheads_kv, head_size, block_size). Block sizes 8, 16, 32.

kv_layout="nhd" (vLLM's FlashAttention backend, FlashInfer, SGLang): K and V caches each
(num_blocks, block_size, nheads_kv, head_size), the head dim contiguous. Block sizes every
power of two from 1 to 512.

Head sizes: paged_prefill and reshape_and_cache take every head size flash_forward takes
(PREFILL_HEAD_SIZES; a token's row whole 16-byte vectors, so fp8 caches take the multiples
of 16); paged_attention (decode) the ones its kernels are compiled for (HEAD_SIZES).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _arrays as A
from .._dtypes import BY_SHORT, FP8_E4M3, UINT8_E4M3
from .._checks import MAX_HEAD_DIM
from ..tuning import PAGED_DECODE_HEAD_SIZES

HEAD_SIZES = PAGED_DECODE_HEAD_SIZES                           # paged_attention
PREFILL_HEAD_SIZES = tuple(range(8, MAX_HEAD_DIM + 1, 8))     # paged_prefill, reshape_and_cache
KV_LAYOUTS = ("vllm", "nhd")
BLOCK_SIZES = (8, 16, 32)                              # vllm
NHD_BLOCK_SIZES = tuple(2 ** i for i in range(10))     # nhd: 1 .. 512
K_DOC = "(num_blocks, nheads_kv, head_size // x, block_size, x)"
V_DOC = "(num_blocks, nheads_kv, head_size, block_size)"
NHD_DOC = "(num_blocks, block_size, nheads_kv, head_size)"


@dataclass(frozen=True)
class CacheInfo:
    cache: str            # short dtype name of the cache: the activation's, or e4m3
    num_kv_heads: int
    head_size: int
    block_size: int
    v_align: int          # bytes the V cache's base address needs (K: 16)
    layout: str = "vllm"

    def strides(self, k_cache, v_cache) -> dict:
        """Element strides of the two caches, as the decode and reshape params name them
        (for "nhd" also v_stride_token; "vllm"'s V slots are contiguous)."""
        ks, vs = A.element_strides(k_cache), A.element_strides(v_cache)
        if self.layout == "nhd":
            return dict(k_stride_block=ks[0], k_stride_token=ks[1], k_stride_head=ks[2],
                        k_stride_x=16 // k_cache.itemsize, v_stride_block=vs[0],
                        v_stride_token=vs[1], v_stride_head=vs[2], v_stride_dim=vs[3])
        return dict(k_stride_block=ks[0], k_stride_head=ks[1], k_stride_x=ks[2],
                    k_stride_token=ks[3], v_stride_block=vs[0], v_stride_head=vs[1],
                    v_stride_dim=vs[2], v_stride_token=1)


def cache_dtype(x, name: str, q_dtype) -> str:
    """Short name of a cache dtype: the activation dtype itself, or e4m3 (float8_e4m3fn/uint8)."""
    if x.dtype == FP8_E4M3.numpy or x.dtype == UINT8_E4M3.numpy:
        return "e4m3"
    if x.dtype == q_dtype.numpy:
        return q_dtype.short
    raise TypeError(f"{name}: dtype {x.dtype} is not supported; expected the query's dtype "
                    f"({q_dtype.numpy}), ml_dtypes.float8_e4m3fn or uint8 (fp8 e4m3)")


def check_layout(kv_layout) -> str:
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def check_head_size(hs: int, name: str, head_sizes: tuple = HEAD_SIZES) -> None:
    """A ValueError naming ``name`` unless ``hs`` is one of ``head_sizes`` (the op's set)."""
    if hs not in head_sizes:
        expected = (f"a multiple of 8 from 8 to {MAX_HEAD_DIM}"
                    if head_sizes == PREFILL_HEAD_SIZES else f"one of {head_sizes}")
        raise ValueError(f"{name}: head_size {hs} is not supported; expected {expected}")


def check_caches(k_cache, v_cache, q_dtype, head_size=None, kv_layout="vllm",
                 head_sizes=HEAD_SIZES) -> CacheInfo:
    """The caches of a call in ``kv_layout``, their head size one of ``head_sizes`` (the
    op's: HEAD_SIZES for decode, PREFILL_HEAD_SIZES for paged_prefill and
    reshape_and_cache)."""
    if kv_layout == "nhd":
        return _check_nhd_caches(k_cache, v_cache, q_dtype, head_size, head_sizes)
    A.check_ndim(k_cache, 5, "k_cache", K_DOC)
    A.check_ndim(v_cache, 4, "v_cache", V_DOC)
    cache = cache_dtype(k_cache, "k_cache", q_dtype)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    x = 16 // k_cache.itemsize
    num_blocks, nkv, ngroups, block_size, kx = k_cache.shape
    if kx != x:
        raise ValueError(f"k_cache: the last dimension must be x = 16 // itemsize = {x} "
                         f"for {k_cache.dtype}, got shape {tuple(k_cache.shape)} {K_DOC}")
    hs = ngroups * x
    if head_size is not None and hs != head_size:
        raise ValueError(f"k_cache: head_size {hs} (= shape[2] * x) differs from the "
                         f"query's {head_size}")
    check_head_size(hs, "k_cache", head_sizes)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"k_cache: block_size {block_size} is not supported; "
                         f"expected one of {BLOCK_SIZES}")
    A.check_shape(v_cache, (num_blocks, nkv, hs, block_size), "v_cache", V_DOC)
    A.check_last_dim_contiguous(k_cache, "k_cache")
    A.check_last_dim_contiguous(v_cache, "v_cache")
    v_align = min(16, block_size * v_cache.itemsize)
    A.check_aligned(k_cache, 16, "k_cache")
    A.check_aligned(v_cache, v_align, "v_cache")
    return CacheInfo(cache, nkv, hs, block_size, v_align)


def _check_nhd_caches(k_cache, v_cache, q_dtype, head_size, head_sizes) -> CacheInfo:
    A.check_ndim(k_cache, 4, "k_cache", NHD_DOC)
    A.check_ndim(v_cache, 4, "v_cache", NHD_DOC)
    cache = cache_dtype(k_cache, "k_cache", q_dtype)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    num_blocks, block_size, nkv, hs = k_cache.shape
    if head_size is not None and hs != head_size:
        raise ValueError(f"k_cache: head_size {hs} differs from the query's {head_size}")
    check_head_size(hs, "k_cache", head_sizes)
    _check_nhd_sizes(block_size, hs, k_cache.dtype, "k_cache", "k_cache")
    A.check_shape(v_cache, k_cache.shape, "v_cache", NHD_DOC)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)      # each token's row is read in 16-byte vectors
    return CacheInfo(cache, nkv, hs, block_size, 16, "nhd")


def _check_nhd_sizes(block_size: int, head_size: int, dtype, block_name: str,
                     head_name: str) -> None:
    """NHD: a power-of-two block of 1 to 512 slots, each head's row whole 16-byte vectors
    (every token's row is written and read in them)."""
    if block_size not in NHD_BLOCK_SIZES:
        raise ValueError(f"{block_name}: block size {block_size} is not supported for "
                         f"kv_layout 'nhd'; expected a power of two from 1 to "
                         f"{max(NHD_BLOCK_SIZES)}")
    if head_size * np.dtype(dtype).itemsize % 16:
        raise ValueError(f"{head_name}: head size {head_size} of {np.dtype(dtype)} is not a "
                         "whole number of 16-byte vectors")


# The flash kernel's key positions (int) over a paged cache: a table's capacity below this.
MAX_FLASH_CONTEXT = 2**29


def check_flash_context(block_tables, block_size: int) -> None:
    """The flash kernel's bound on a table's capacity (max_blocks_per_seq * block_size)."""
    capacity = block_tables.shape[1] * block_size
    if capacity >= MAX_FLASH_CONTEXT:
        raise ValueError(f"block_tables: max_blocks_per_seq * block_size = {capacity} must "
                         "be < 2**29")


def check_tables(block_tables, seq_lens, num_seqs: int) -> None:
    """block_tables int32 (num_seqs, max_blocks_per_seq) and seq_lens int32 (num_seqs,)."""
    A.check_ndim(block_tables, 2, "block_tables", "(num_seqs, max_blocks_per_seq)")
    A.check_dtype(block_tables, np.int32, "block_tables")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows (num_seqs), got shape "
                         f"{tuple(block_tables.shape)}")
    A.check_last_dim_contiguous(block_tables, "block_tables")
    A.check_aligned(block_tables, 4, "block_tables")
    A.check_ndim(seq_lens, 1, "seq_lens", "(num_seqs,)")
    A.check_dtype(seq_lens, np.int32, "seq_lens")
    A.check_shape(seq_lens, (num_seqs,), "seq_lens", "(num_seqs,)")
    A.check_last_dim_contiguous(seq_lens, "seq_lens")
    A.check_aligned(seq_lens, 4, "seq_lens")


def paged_kv_cache_shapes(num_blocks: int, nheads_kv: int, head_size: int, block_size: int,
                          dtype, kv_layout: str = "vllm") -> tuple[tuple, tuple]:
    """(k_cache_shape, v_cache_shape) of a paged cache of ``dtype`` elements.

    kv_layout="vllm": K (num_blocks, nheads_kv, head_size // x, block_size, x) with
    x = 16 // itemsize, V (num_blocks, nheads_kv, head_size, block_size).
    kv_layout="nhd": K and V (num_blocks, block_size, nheads_kv, head_size).
    head_size: any paged_prefill takes (PREFILL_HEAD_SIZES; paged_attention takes HEAD_SIZES).
    """
    kv_layout = check_layout(kv_layout)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: {dtype!r} is not a dtype; expected float16, "
                        "ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn or uint8") from None
    if dt not in (np.dtype(np.float16), BY_SHORT["bf16"].numpy, FP8_E4M3.numpy, UINT8_E4M3.numpy):
        raise TypeError(f"dtype: {dt} is not supported; expected float16, ml_dtypes.bfloat16, "
                        "ml_dtypes.float8_e4m3fn or uint8")
    for name, v in (("num_blocks", num_blocks), ("nheads_kv", nheads_kv),
                    ("head_size", head_size), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {v!r}")
    check_head_size(head_size, "head_size", PREFILL_HEAD_SIZES)
    if kv_layout == "nhd":
        _check_nhd_sizes(block_size, head_size, dt, "block_size", "head_size")
        shape = (int(num_blocks), block_size, int(nheads_kv), head_size)
        return shape, shape
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size: {block_size} is not supported; expected one of {BLOCK_SIZES}")
    x = 16 // dt.itemsize
    if head_size % x:
        raise ValueError(f"head_size: {head_size} is not a multiple of x = {x} "
                         f"(16-byte vectors of {dt})")
    return ((int(num_blocks), int(nheads_kv), head_size // x, block_size, x),
            (int(num_blocks), int(nheads_kv), head_size, block_size))
