"""block_tables_from_flashinfer: FlashInfer's page table (kv_indptr, kv_indices,
kv_last_page_len) -> cuattn's block_tables / seq_lens, built on the device.

CPU: the kernel compiles for sm_80 and sm_90 without spills. GPU (marker ``gpu``): random
tables (empty sequences, full and partial last pages, repeated pages, kv_indices longer than
kv_indptr[-1]) against a NumPy construction, outputs poisoned first; out= buffers that are
row-strided views; a CUDA graph replayed with new tables; paged_prefill and paged_attention
over the converted table of an NHD cache against the float64 reference. Bad inputs:
tests/test_bad_inputs.py.
Run the GPU part with: python -m pytest -q -m gpu tests/test_flashinfer_tables.py
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuattn
from cuattn import tuning
from tests.compiled import compile_reports, unclean

POISON = -7


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_without_spills(arch):
    v = tuning.flashinfer_tables_variant()
    assert v.name == f"cuattn_flashinfer_tables__t{v.threads}"
    assert unclean(compile_reports([v], arch)) == []


def flashinfer_reference(indptr, indices, last, page_size, max_blocks):
    """cuattn's (block_tables, seq_lens) of a FlashInfer page table, by plain indexing."""
    batch = len(indptr) - 1
    tables = np.zeros((batch, max_blocks), np.int32)
    lens = np.zeros(batch, np.int32)
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]]
        tables[b, :len(pages)] = pages
        lens[b] = (len(pages) - 1) * page_size + last[b] if len(pages) else 0
    return tables, lens


def random_flashinfer(rng, batch, page_size, max_blocks, num_pages=1000):
    """A FlashInfer page table: 0 to max_blocks pages per sequence (drawn with repeats, as
    shared prefixes have them), a last page of 1 to page_size tokens, and a few unused
    entries at the end of kv_indices."""
    counts = rng.integers(0, max_blocks + 1, batch)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = rng.integers(0, num_pages, int(indptr[-1]) + int(rng.integers(0, 4)))
    last = np.where(counts > 0, rng.integers(1, page_size + 1, batch), 0)
    return indptr, indices.astype(np.int32), last.astype(np.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,max_blocks", [(1, 40), (16, 9), (16, 1), (256, 300)])
@pytest.mark.parametrize("batch", [1, 7, 300])
def test_matches_numpy(rng, batch, page_size, max_blocks):
    import cupy as cp
    indptr, indices, last = random_flashinfer(rng, batch, page_size, max_blocks)
    tables, lens = cuattn.block_tables_from_flashinfer(
        cp.asarray(indptr), cp.asarray(indices), cp.asarray(last), page_size, max_blocks)
    ref_tables, ref_lens = flashinfer_reference(indptr, indices, last, page_size, max_blocks)
    assert tables.dtype == lens.dtype == np.int32
    assert np.array_equal(tables.get(), ref_tables) and np.array_equal(lens.get(), ref_lens)


@pytest.mark.gpu
def test_writes_into_row_strided_out_buffers_and_nothing_else(rng):
    import cupy as cp
    indptr, indices, last = random_flashinfer(rng, 5, 16, 6)
    wide = cp.full((5, 10), POISON, cp.int32)     # the table is its first 6 columns
    lens_buf = cp.full(7, POISON, cp.int32)
    out, out_lens = wide[:, :6], lens_buf[1:6]
    got = cuattn.block_tables_from_flashinfer(cp.asarray(indptr), cp.asarray(indices),
                                              cp.asarray(last), 16, 6, out=out,
                                              out_seq_lens=out_lens)
    assert got[0] is out and got[1] is out_lens
    ref_tables, ref_lens = flashinfer_reference(indptr, indices, last, 16, 6)
    assert np.array_equal(wide[:, :6].get(), ref_tables)
    assert (wide[:, 6:].get() == POISON).all()
    assert np.array_equal(lens_buf[1:6].get(), ref_lens)
    assert int(lens_buf[0]) == int(lens_buf[6]) == POISON


@pytest.mark.gpu
def test_empty_batch_and_empty_table(rng):
    import cupy as cp
    tables, lens = cuattn.block_tables_from_flashinfer(
        cp.zeros(1, cp.int32), cp.zeros(0, cp.int32), cp.zeros(0, cp.int32), 16, 8)
    assert tables.shape == (0, 8) and lens.shape == (0,)
    indptr = cp.asarray([0, 0, 0], cp.int32)        # two sequences without pages
    tables, lens = cuattn.block_tables_from_flashinfer(
        indptr, cp.zeros(0, cp.int32), cp.zeros(2, cp.int32), 16, 0)
    assert tables.shape == (2, 0) and lens.get().tolist() == [0, 0]


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_replays_with_new_tables(rng):
    """Nothing is read on the host: a graph captured once converts new tables, written into
    the same input buffers, into the same output buffers."""
    import cupy as cp
    batch, page_size, max_blocks = 33, 16, 12
    nnz = batch * max_blocks + 3          # random_flashinfer's most pages, and its spare ones
    indptr = cp.zeros(batch + 1, cp.int32)
    indices = cp.zeros(nnz, cp.int32)
    last = cp.zeros(batch, cp.int32)
    out = cp.empty((batch, max_blocks), cp.int32)
    out_lens = cp.empty(batch, cp.int32)
    args = (indptr, indices, last, page_size, max_blocks)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.block_tables_from_flashinfer(*args, out=out, out_seq_lens=out_lens)  # compile
        stream.begin_capture()
        cuattn.block_tables_from_flashinfer(*args, out=out, out_seq_lens=out_lens)
        graph = stream.end_capture()
    for _ in range(3):
        new_indptr, new_indices, new_last = random_flashinfer(rng, batch, page_size, max_blocks)
        with stream:                  # the new inputs, ordered before the replay
            indptr.set(new_indptr)
            indices.fill(POISON)
            indices[:len(new_indices)].set(new_indices)
            last.set(new_last)
            out.fill(POISON)
            out_lens.fill(POISON)
            graph.launch(stream)
        stream.synchronize()
        ref_tables, ref_lens = flashinfer_reference(new_indptr, new_indices, new_last,
                                                    page_size, max_blocks)
        assert np.array_equal(out.get(), ref_tables) and np.array_equal(out_lens.get(), ref_lens)


def _to_flashinfer(block_tables, seq_lens, block_size):
    """FlashInfer's page table of cuattn's (block_tables, seq_lens), on the host."""
    pages = [-(-int(n) // block_size) for n in seq_lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.concatenate([block_tables[s, :p] for s, p in enumerate(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * block_size if p else 0 for n, p in zip(seq_lens, pages)],
                    np.int32)
    return indptr, indices, last


@pytest.mark.gpu
def test_attention_over_a_flashinfer_table_matches_the_reference(rng):
    """A FlashInfer user's switch: an NHD cache (FlashInfer's own layout, page = block) and
    its page table, converted, then paged_prefill (chunks and verification) and
    paged_attention (decode) against the float64 reference."""
    import cupy as cp

    from tests.test_prefill import batch_reference, check, make_batch
    b = make_batch(rng, contexts=[300, 17, 64, 0, 129], q_lens=[40, 5, 16, 0, 3], nkv=2,
                   group=4, head_size=128, block_size=16, dtype="bf16", layout="nhd")
    indptr, indices, last = _to_flashinfer(b["block_tables"], b["seq_lens"], 16)
    tables, lens = cuattn.block_tables_from_flashinfer(
        cp.asarray(indptr), cp.asarray(indices), cp.asarray(last), 16,
        b["block_tables"].shape[1])
    assert np.array_equal(lens.get(), b["seq_lens"])
    k_cache, v_cache = cp.asarray(b["k_cache"]), cp.asarray(b["v_cache"])
    scale = 1 / math.sqrt(128)
    out, lse = cuattn.paged_prefill(cp.asarray(b["q"]), k_cache, v_cache, tables, lens,
                                    cp.asarray(b["cu_seqlens_q"]), b["max_seqlen_q"],
                                    kv_layout="nhd", return_lse=True)
    check(out, lse, *batch_reference(b, scale, causal=True), "bf16")
    # decode: one query per sequence against all its keys (the empty one: zeros, -inf)
    q = rng.standard_normal((len(b["seq_lens"]),) + b["q"].shape[1:]).astype(b["q"].dtype)
    decode = dict(b, q=q, cu_seqlens_q=np.arange(len(q) + 1, dtype=np.int32))
    out, lse = cuattn.paged_attention(cp.asarray(q), k_cache, v_cache, tables, lens,
                                      kv_layout="nhd", return_lse=True)
    check(out, lse, *batch_reference(decode, scale), "bf16")
