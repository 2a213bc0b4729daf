"""block_tables_from_flashinfer: cuattn's block_tables and seq_lens from FlashInfer's page
table, built on the device.

FlashInfer's paged-KV wrappers describe the pages of sequence b as kv_indices[kv_indptr[b]
: kv_indptr[b + 1]], the last of them holding kv_last_page_len[b] tokens; its NHD cache
(num_pages, page_size, nheads_kv, head_size) is cuattn's kv_layout="nhd" cache with
block_size = page_size. Kernel: cuda_src/flashinfer_tables.cuh. Calls go through
cuattn._launch: the checks below run once per call signature, and no value inside the
arrays is read on the host (a call can be captured in a CUDA graph).
"""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .. import tuning
from .._launch import Launch, Plan, execute, on_device, plan_cache, plan_for, returns
from .._checks import check_cu_seqlens
from ..jit import get_kernel
from ..param_structs import FLASHINFER_TABLES_PARAMS
from .layout import BLOCK_SIZES, MAX_FLASH_CONTEXT, NHD_BLOCK_SIZES

_plans = plan_cache()
_NAMES = ("kv_indptr", "kv_indices", "kv_last_page_len", "out", "out_seq_lens")
_PAGE_SIZES = tuple(sorted(set(BLOCK_SIZES) | set(NHD_BLOCK_SIZES)))
_TABLE_DOC = "(batch, max_blocks_per_seq)"


def block_tables_from_flashinfer(kv_indptr, kv_indices, kv_last_page_len, page_size,
                                 max_blocks_per_seq, *, out=None, out_seq_lens=None,
                                 stream=None):
    """(block_tables, seq_lens) for paged_attention / paged_prefill from FlashInfer's page
    table, on the device.

    kv_indptr: int32 (batch + 1,); kv_indices: int32 (nnz_pages,); kv_last_page_len: int32
    (batch,); page_size: the cache's tokens per page (cuattn's block_size);
    max_blocks_per_seq: the table's width, which must bound every sequence's page count
    (the host never reads kv_indptr). Row b of block_tables: the pages of sequence b, then
    0 (a valid block that nothing reads); seq_lens[b] = (pages - 1) * page_size +
    kv_last_page_len[b], or 0 for a sequence without pages. out / out_seq_lens: write them
    there (e.g. the fixed buffers of a captured CUDA graph) instead of new arrays.
    """
    plan, arrays, stream, ptrs = plan_for(
        _plans, (kv_indptr, kv_indices, kv_last_page_len, out, out_seq_lens), _NAMES,
        (page_size, max_blocks_per_seq),
        lambda arrays: _plan(arrays, page_size, max_blocks_per_seq), stream, 3)
    return execute(plan, arrays, stream, ptrs)


def _check_int32_vector(x, name: str, length: int | None, doc: str) -> None:
    A.check_ndim(x, 1, name, doc)
    A.check_dtype(x, np.int32, name)
    if length is not None:
        A.check_shape(x, (length,), name, doc)
    A.check_last_dim_contiguous(x, name)
    A.check_aligned(x, 4, name)


def _check_count(value, name: str, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int ({allowed}), got {type(value).__name__}")
    return int(value)


def _plan(arrays, page_size, max_blocks_per_seq) -> Plan:
    """Every check of block_tables_from_flashinfer (raising before any launch) -> its Plan."""
    indptr, indices, last_page_len, out, out_seq_lens = arrays
    check_cu_seqlens(indptr, "kv_indptr")
    batch = indptr.shape[0] - 1
    _check_int32_vector(indices, "kv_indices", None, "(nnz_pages,)")
    if indices.shape[0] > np.iinfo(np.int32).max:
        raise ValueError(f"kv_indices: {indices.shape[0]} pages do not fit in int32")
    _check_int32_vector(last_page_len, "kv_last_page_len", batch, "(batch,)")
    page_size = _check_count(page_size, "page_size", f"one of {_PAGE_SIZES}")
    if page_size not in _PAGE_SIZES:
        raise ValueError(f"page_size: {page_size} is not a block size of cuattn's caches; "
                         f"expected one of {_PAGE_SIZES}")
    max_blocks = _check_count(max_blocks_per_seq, "max_blocks_per_seq", ">= 0")
    if max_blocks < 0 or max_blocks * page_size >= MAX_FLASH_CONTEXT:
        raise ValueError(f"max_blocks_per_seq: expected 0 <= max_blocks_per_seq and "
                         f"max_blocks_per_seq * page_size < 2**29, got {max_blocks} pages "
                         f"of {page_size}")
    device_id = indptr.device.id
    A.check_same_device({"kv_indices": indices, "kv_last_page_len": last_page_len}, device_id)
    table_shape = (batch, max_blocks)
    if out is not None:
        A.check_output(out, table_shape, np.int32, "out", _TABLE_DOC, device_id, align=4)
    if out_seq_lens is not None:
        A.check_output(out_seq_lens, (batch,), np.int32, "out_seq_lens", "(batch,)",
                       device_id, align=4)
    slots, outputs, (table_slot, lens_slot), result = returns(len(arrays), [
        (3 if out is not None else None, table_shape, np.int32),
        (4 if out_seq_lens is not None else None, (batch,), np.int32)])
    align = ((0, 4), (1, 4), (2, 4)) + ((3, 4),) * (out is not None) + \
        ((4, 4),) * (out_seq_lens is not None)
    common = dict(device_id=device_id, align=align, outputs=outputs, result=result)
    if batch == 0:
        return Plan(**common)
    variant = tuning.flashinfer_tables_variant()
    with on_device(device_id):
        kernel = get_kernel(variant, device_id)
    row_stride = A.element_strides_or_contiguous(out, table_shape)[0]
    tail = FLASHINFER_TABLES_PARAMS.tail(bt_stride_seq=row_stride,
                                         num_indices=indices.shape[0],
                                         max_blocks_per_seq=max_blocks, page_size=page_size)
    launch = Launch(kernel, (batch,), (variant.num_threads,), 0, FLASHINFER_TABLES_PARAMS.dtype,
                    (slots.arg(0), slots.arg(1), slots.arg(2), table_slot, lens_slot), tail)
    return Plan(**common, launches=(launch,))
