"""paged_attention / reshape_and_cache / paged_kv_cache_shapes.

CPU: compilation of the shipped and of odd variants (no spills, no stack), shapes, host-array
refusal. GPU (marker ``gpu``): a float64 NumPy reference that gathers K/V token by token
through the block table with plain indexing of the documented layouts; every slot a
sequence must not read holds NaN.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import shipped, tuning
from cuattn.paged import HEAD_SIZES
from cuattn.paged.forms import MmaForm, SimtForm, form_for
from cuattn.tuning import PagedMmaTiles
from cuattn.keys import PagedMmaVariant
from tests.compiled import compile_reports, unclean
from tests.reference import check_attention, tolerance

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
DTYPES = {"f16": np.dtype(np.float16), "bf16": BF16}
CACHE_KINDS = {"same": None, "e4m3": E4M3, "u8": np.dtype(np.uint8)}
E4M3_NAN = 0x7F


# -- CPU --------------------------------------------------------------------------------------

def _odd_variants(head_sizes=HEAD_SIZES):
    """Outside the shipped set: every head size, block sizes 8 / 32, fp8, ALiBi, GQA 8, both
    forms (the shipped set is compiled by tests/test_jit.py)."""
    out = []
    for hs in head_sizes:
        out.append(tuning.paged_simt_variant("bf16", "bf16", hs, 32, 8, 512, True))
        out.append(tuning.paged_simt_variant("f16", "f16", hs, 8, 2, 0, False))
        if hs % 16 == 0:
            out.append(tuning.paged_simt_variant("bf16", "e4m3", hs, 8, 8, 0, True))
            out.append(tuning.paged_simt_variant("f16", "e4m3", hs, 16, 4, 1024, False))
            out.append(tuning.paged_mma_variant("bf16", hs, 32, 8, 512, True))
            out.append(tuning.paged_mma_variant("f16", hs, 8, 3, 0, False))
        out.append(tuning.paged_reduce_variant("f16", hs))
    out += [tuning.reshape_variant(dt, "e4m3", s64) for dt in ("f16", "bf16") for s64 in (False, True)]
    return out


@pytest.mark.slow
def test_odd_variants_compile_for_sm90_without_spills_or_stack():
    assert unclean(compile_reports(_odd_variants(), "sm_90")) == []


def test_a_few_odd_variants_compile_for_sm90_without_spills_or_stack():
    """Head size 120 (CUDA-core form only) and the largest."""
    assert unclean(compile_reports(_odd_variants((120, max(HEAD_SIZES))), "sm_90")) == []


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89"])
def test_representative_variants_compile_for_older_archs(arch):
    vs = [tuning.paged_simt_variant("bf16", "bf16", 128, 16, 4, 0, False),
          tuning.paged_simt_variant("f16", "f16", 128, 16, 1, 512, False),
          tuning.paged_simt_variant("bf16", "e4m3", 256, 16, 8, 512, True),
          tuning.paged_reduce_variant("bf16", 128),
          tuning.reshape_variant("bf16", "e4m3", True),
          tuning.paged_mma_variant("bf16", 128, 16, 4, 512, False),
          tuning.paged_mma_variant("f16", 256, 16, 8, 0, True)]
    assert unclean(compile_reports(vs, arch)) == []


def test_paged_kv_cache_shapes():
    assert cuattn.paged_kv_cache_shapes(100, 8, 128, 16, BF16) == \
        ((100, 8, 16, 16, 8), (100, 8, 128, 16))
    assert cuattn.paged_kv_cache_shapes(7, 2, 64, 32, np.float16) == \
        ((7, 2, 8, 32, 8), (7, 2, 64, 32))
    assert cuattn.paged_kv_cache_shapes(3, 1, 80, 8, E4M3) == ((3, 1, 5, 8, 16), (3, 1, 80, 8))
    assert cuattn.paged_kv_cache_shapes(3, 1, 96, 8, np.uint8) == ((3, 1, 6, 8, 16), (3, 1, 96, 8))
    with pytest.raises(ValueError, match="head_size"):
        cuattn.paged_kv_cache_shapes(3, 1, 100, 16, BF16)
    with pytest.raises(ValueError, match="head_size"):
        cuattn.paged_kv_cache_shapes(3, 1, 120, 16, E4M3)     # 120 is not a multiple of 16
    with pytest.raises(ValueError, match="block_size"):
        cuattn.paged_kv_cache_shapes(3, 1, 128, 64, BF16)
    with pytest.raises(TypeError, match="dtype"):
        cuattn.paged_kv_cache_shapes(3, 1, 128, 16, np.float32)


def test_variant_names_and_launch_bounds():
    v = tuning.paged_simt_variant("bf16", "bf16", 128, 16, 4, 512, False)
    assert v.name == (f"cuattn_paged__bf16_kvbf16_hd128_bs16_g4_p512_a0_"
                      f"t{tuning.PAGED_SIMT_NUM_THREADS}")
    assert tuning.paged_simt_variant("bf16", "e4m3", 128, 16, 4, 0, True).name.endswith("_g4_v1_a1_t128")
    assert f"__launch_bounds__({v.num_threads}, 1)\n" in v.source()
    m = tuning.paged_mma_variant("bf16", 128, 16, 4, 512, False)
    t = tuning.paged_mma_tiles(128)
    assert m.name == f"cuattn_paged_mma__bf16_hd128_bs16_g4_p512_a0_w{t.num_warps}_st{t.stages}"
    assert f"__launch_bounds__({m.num_threads}, 1)" in m.source()
    assert m.dynamic_smem_bytes == t.num_warps * t.stages * 2 * 16 * 128 * 2
    assert f"Traits::SMEM_BYTES == {m.dynamic_smem_bytes}" in m.source()
    names = [x.name for x in shipped.SHIPPED["paged"]()]
    assert len(names) == len(set(names))


def test_where_each_form_runs_and_the_override():
    # the tensor-core form: 16-bit caches, head size % 16; the CUDA-core form elsewhere
    assert isinstance(form_for("bf16", 128, 1), MmaForm)
    assert isinstance(form_for("bf16", 128, 8), MmaForm)
    assert isinstance(form_for("e4m3", 128, 8), SimtForm)
    assert isinstance(form_for("f16", 120, 8), SimtForm)
    with tuning.override(paged_form="simt"):
        assert isinstance(form_for("bf16", 128, 4), SimtForm)
    with tuning.override(paged_form="mma"):
        assert isinstance(form_for("e4m3", 128, 4), SimtForm)   # where it can run only
    with tuning.override(paged_mma=PagedMmaTiles(num_warps=2, stages=4)):
        assert form_for("bf16", 128, 4).variant("bf16", "bf16", 128, 16, 4, 0, False) == \
            PagedMmaVariant("bf16", 128, 16, 4, 0, False, 2, 4)
    assert tuning.paged_mma_variant("bf16", 128, 16, 4, 0, False).stages == \
        tuning.paged_mma_tiles(128).stages
    with pytest.raises(ValueError, match="paged_form"):
        with tuning.override(paged_form="cuda"):
            pass


def test_auto_rule_of_the_tensor_core_form():
    sms = 132
    assert tuning.paged_mma_plan(256, 4096, sms) == ("v1", 0)          # v1 fills the SMs
    assert tuning.paged_mma_plan(64, 32768, sms) == ("v2", 1024)
    assert tuning.paged_mma_plan(8, 32768, sms) == ("v2", 1024)        # 256 blocks
    assert tuning.paged_mma_plan(8, 4096, sms) == ("v2", 128)          # 256 blocks
    assert tuning.paged_mma_plan(1, 100, sms) == ("v1", 0)             # one partition
    assert tuning.paged_mma_plan(8, 32768, sms, 256) == ("v2", 256)    # the call's partition
    assert tuning.paged_mma_plan(8, 200, sms, 256) == ("v1", 0)
    # version="v2" without a partition: the same partition rule, even where v1 would fill
    assert tuning.paged_mma_partition(256, 4096, sms) == 1024
    assert tuning.paged_mma_partition(8, 4096, sms) == 128
    # the CUDA-core form: v1 when one 512-token partition covers the context
    assert tuning.paged_simt_plan(512, None) == ("v1", 512)
    assert tuning.paged_simt_plan(513, None) == ("v2", 512)
    assert tuning.paged_simt_plan(513, 1024) == ("v1", 1024)


# Ring shapes of the tensor-core form (tuning.PagedMmaTiles) the tests run through the
# override; the first is the table's.
MMA_RINGS = [tuning.paged_mma_tiles(128), PagedMmaTiles(stages=4), PagedMmaTiles(stages=2),
             PagedMmaTiles(num_warps=8), PagedMmaTiles(num_warps=2, stages=4)]


def test_mma_rings_compile_for_sm90_without_spills_or_stack():
    vs = [PagedMmaVariant(dt, hs, bs, g, ps, False, r.num_warps, r.stages) for r in MMA_RINGS
          for dt, hs, bs, g, ps in [("bf16", 128, 16, 4, 512), ("bf16", 128, 16, 1, 0),
                                    ("f16", 64, 8, 8, 128), ("bf16", 256, 32, 2, 1024)]]
    assert unclean(compile_reports(vs, "sm_90")) == []


def test_params_packing_matches_pack():
    """A launch packs a call's pointers in front of its plan's static tail: the same bytes as
    ParamsStruct.pack of every field."""
    from cuattn._launch import Launch
    from cuattn.param_structs import PAGED_PARAMS, PAGED_REDUCE_PARAMS, RESHAPE_PARAMS
    rng = np.random.default_rng(1)
    for ps in (PAGED_PARAMS, PAGED_REDUCE_PARAMS, RESHAPE_PARAMS):
        n_ptr = ps.num_pointers
        assert all(k in ("ptr", "out") for _, k in ps.fields[:n_ptr])
        vals = {n: (int(rng.integers(1, 2**62)) if k in ("ptr", "out", "i64") else
                    int(rng.integers(-2**30, 2**30)) if k == "i32" else float(rng.random()))
                for n, k in ps.fields}
        names = [n for n, _ in ps.fields]
        tail = ps.tail(**{n: vals[n] for n in names[n_ptr:]})
        ptrs = [0] + [vals[n] for n in names[:n_ptr]]          # slot 0: null
        launch = Launch(None, (1,), (1,), 0, ps.dtype, tuple(range(1, n_ptr + 1)), tail)
        assert launch.params(ptrs).tobytes() == ps.pack(**vals).tobytes()


def test_host_arrays_are_refused():
    q = np.zeros((2, 4, 128), np.float16)
    kc, vc = cuattn.paged_kv_cache_shapes(4, 2, 128, 16, np.float16)
    with pytest.raises(TypeError, match="q"):
        cuattn.paged_attention(q, np.zeros(kc, np.float16), np.zeros(vc, np.float16),
                               np.zeros((2, 2), np.int32), np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="key"):
        cuattn.reshape_and_cache(np.zeros((2, 2, 128), np.float16), np.zeros((2, 2, 128), np.float16),
                                 np.zeros(kc, np.float16), np.zeros(vc, np.float16),
                                 np.zeros(2, np.int32))


# -- the reference ----------------------------------------------------------------------------

def _cache_values(cache: np.ndarray, scale: float) -> np.ndarray:
    """Float64 values a cache holds (fp8 bytes dequantised by their scale)."""
    if cache.dtype == np.uint8:
        cache = cache.view(E4M3)
    x = cache.astype(np.float64)
    return x * scale if cache.dtype == E4M3 else x


def paged_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=1.0,
                    v_scale=1.0, alibi=None):
    """Float64 decode attention; K/V gathered token by token through the block table by plain
    indexing of the documented layouts (K [blk, h, d // x, off, d % x], V [blk, h, d, off]).
    Returns out (num_seqs, nheads, head_size) and lse (nheads, num_seqs)."""
    num_seqs, nheads, head_size = q.shape
    block_size = v_cache.shape[3]
    nkv = v_cache.shape[1]
    gqa = nheads // nkv
    qf = q.astype(np.float64)
    out = np.zeros(q.shape)
    lse = np.full((nheads, num_seqs), -np.inf)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        if n == 0:
            continue
        tok = np.arange(n)
        blk = block_tables[s, tok // block_size]
        off = tok % block_size
        k = _cache_values(k_cache[blk, :, :, off, :], k_scale).reshape(n, nkv, head_size)
        v = _cache_values(v_cache[blk, :, :, off], v_scale)           # (n, nkv, head_size)
        for h in range(nheads):
            logits = scale * (k[:, h // gqa] @ qf[s, h])
            if alibi is not None:
                logits = logits + float(alibi[h]) * (tok - n + 1)
            m = logits.max()
            p = np.exp(logits - m)
            out[s, h] = p @ v[:, h // gqa] / p.sum()
            lse[h, s] = m + np.log(p.sum())
    return out, lse


LENGTHS = lambda bs: [1, bs - 1, bs, bs + 1, 511, 512, 513, 1025, 4097, 0]   # noqa: E731


def make_case(rng, *, lengths, nkv, gqa, head_size, block_size, dtype, cache_kind="same",
              k_scale=1.0, v_scale=1.0, extra_table=2, alibi=False):
    """Host arrays of one batch: shuffled physical blocks, NaN in every slot a sequence must
    not read (past its length, unreferenced blocks, table entries past its end)."""
    dt = DTYPES[dtype]
    cdt = dt if cache_kind == "same" else CACHE_KINDS[cache_kind]
    fp8 = cache_kind != "same"
    nheads = nkv * gqa
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    max_blocks = max(blocks_per_seq) + extra_table
    used = sum(blocks_per_seq)
    num_blocks = used + 5                        # 5 unreferenced blocks, all NaN
    perm = rng.permutation(num_blocks)
    nan_block = int(perm[-1])
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, nkv, head_size, block_size, cdt)
    x = kshape[4]
    if fp8:
        k_cache = np.full(kshape, E4M3_NAN, np.uint8)
        v_cache = np.full(vshape, E4M3_NAN, np.uint8)
    else:
        k_cache = np.full(kshape, np.nan, cdt)
        v_cache = np.full(vshape, np.nan, cdt)
    block_tables = np.full((len(lengths), max_blocks), nan_block, np.int32)
    nxt = 0
    for s, n in enumerate(lengths):
        nb = blocks_per_seq[s]
        block_tables[s, :nb] = perm[nxt:nxt + nb]
        nxt += nb
        if n == 0:
            continue
        kv = rng.standard_normal((2, n, nkv, head_size))
        if fp8:
            kb = (kv[0] / k_scale).astype(np.float32).astype(E4M3).view(np.uint8)
            vb = (kv[1] / v_scale).astype(np.float32).astype(E4M3).view(np.uint8)
        else:
            kb, vb = kv[0].astype(cdt), kv[1].astype(cdt)
        tok = np.arange(n)
        blk, off = block_tables[s, tok // block_size], tok % block_size
        # K [blk, h, d // x, off, d % x] and V [blk, h, d, off], by plain indexing.
        k_cache[blk, :, :, off, :] = kb.reshape(n, nkv, head_size // x, x)
        v_cache[blk, :, :, off] = vb
    if cache_kind == "e4m3":
        k_cache, v_cache = k_cache.view(E4M3), v_cache.view(E4M3)
    q = rng.standard_normal((len(lengths), nheads, head_size)).astype(dt)
    seq_lens = np.array(lengths, np.int32)
    slopes = (2.0 ** -(8.0 * np.arange(1, nheads + 1) / nheads)).astype(np.float32) if alibi else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=seq_lens, alibi_slopes=slopes)


def _device(x):
    """CuPy has no float8 dtype: fp8 caches travel as their uint8 bytes (the kernel's view)."""
    import cupy as cp
    if x is None:
        return None
    return cp.asarray(x.view(np.uint8) if x.dtype == E4M3 else x)


def _to_device(case):
    return {k: _device(v) for k, v in case.items()}


def _check(out, lse, ref, ref_lse, dtype):
    check_attention(out, lse, ref, ref_lse, DTYPES[dtype])


def _run(case, dcase, dtype, version, ref=None, **kw):
    import cupy as cp
    scale = kw.pop("softmax_scale", 1.0 / math.sqrt(case["q"].shape[2]))
    if ref is None:
        ref = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                              case["seq_lens"], scale, kw.get("k_scale", 1.0),
                              kw.get("v_scale", 1.0), case["alibi_slopes"])
    out = cp.full(case["q"].shape, np.nan, dtype=case["q"].dtype)
    res, lse = cuattn.paged_attention(
        dcase["q"], dcase["k_cache"], dcase["v_cache"], dcase["block_tables"], dcase["seq_lens"],
        softmax_scale=scale, alibi_slopes=dcase["alibi_slopes"], version=version,
        return_lse=True, out=out, **kw)
    assert res is out and lse.shape == (case["q"].shape[1], case["q"].shape[0])
    _check(out, lse, *ref, dtype)
    return ref, out


# -- GPU: paged_attention ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_gqa_ratios_v1_v2_auto_agree(rng, gqa):
    case = make_case(rng, lengths=LENGTHS(16), nkv=2, gqa=gqa, head_size=128, block_size=16,
                     dtype="bf16")
    dcase = _to_device(case)
    ref, o1 = _run(case, dcase, "bf16", "v1")
    _, o2 = _run(case, dcase, "bf16", "v2", ref=ref)
    _, oa = _run(case, dcase, "bf16", "auto", ref=ref)
    a, b = o1.get().astype(np.float64), o2.get().astype(np.float64)
    assert np.abs(a - b).max() <= 2 * np.abs(ref[0] - ref[0].astype(BF16).astype(np.float64)).max() + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_every_head_size(rng, head_size, dtype):
    case = make_case(rng, lengths=LENGTHS(16), nkv=1, gqa=4, head_size=head_size,
                     block_size=16, dtype=dtype)
    dcase = _to_device(case)
    ref, _ = _run(case, dcase, dtype, "v2")
    _run(case, dcase, dtype, "v1", ref=ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_block_sizes(rng, block_size, version):
    case = make_case(rng, lengths=LENGTHS(block_size), nkv=2, gqa=2, head_size=96,
                     block_size=block_size, dtype="f16")
    _run(case, _to_device(case), "f16", version)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,block_size,cache_kind", [(128, 16, "u8"), (64, 8, "e4m3"),
                                                             (80, 32, "u8")])
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_fp8_cache(rng, cache_kind, head_size, block_size, version):
    """uint8 storage of e4m3 (CuPy has no float8 dtype, so both kinds reach the device as
    uint8; the "e4m3" kind builds the host cache as ml_dtypes.float8_e4m3fn)."""
    kw = dict(k_scale=0.05, v_scale=0.02)
    case = make_case(rng, lengths=LENGTHS(block_size), nkv=2, gqa=4, head_size=head_size,
                     block_size=block_size, dtype="bf16", cache_kind=cache_kind, **kw)
    _run(case, _to_device(case), "bf16", version, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_alibi(rng, version):
    case = make_case(rng, lengths=LENGTHS(16), nkv=2, gqa=2, head_size=128, block_size=16,
                     dtype="bf16", alibi=True)
    _run(case, _to_device(case), "bf16", version)


@pytest.mark.gpu
@pytest.mark.parametrize("partition_size", [128, 1024])
def test_partition_sizes_and_gqa_16(rng, partition_size):
    """GQA 16 is served as two thread blocks of 8 heads per KV head."""
    case = make_case(rng, lengths=LENGTHS(16), nkv=1, gqa=16, head_size=64, block_size=16,
                     dtype="f16")
    _run(case, _to_device(case), "f16", "v2", partition_size=partition_size)


@pytest.mark.gpu
def test_strided_q_out_and_stream(rng):
    import cupy as cp
    case = make_case(rng, lengths=[5, 300, 0, 17], nkv=2, gqa=4, head_size=128, block_size=16,
                     dtype="bf16")
    dcase = _to_device(case)
    scale = 1 / math.sqrt(128)
    ref = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                          case["seq_lens"], scale)
    big = cp.zeros((4, 16, 128), dtype=BF16)
    big[:, ::2] = dcase["q"]
    q = big[:, ::2]
    out_store = cp.full((8, 4, 128), np.nan, dtype=BF16)
    out = out_store.transpose(1, 0, 2)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()   # (q's copy and the NaN fill: stream does not wait)
    for version in ("v1", "v2"):
        res, lse = cuattn.paged_attention(q, dcase["k_cache"], dcase["v_cache"],
                                          dcase["block_tables"], dcase["seq_lens"],
                                          version=version, return_lse=True, out=out, stream=stream)
        stream.synchronize()
        _check(res, lse, *ref, "bf16")
    assert not cp.isnan(out_store.astype(np.float32)).any()


@pytest.mark.gpu
def test_lse_merges_with_merge_attn_states(rng):
    """Two halves of each sequence's context, merged by their lse, equal the whole."""
    import cupy as cp
    lengths = [64, 512, 1000]
    case = make_case(rng, lengths=lengths, nkv=2, gqa=4, head_size=128, block_size=16, dtype="f16")
    dcase = _to_device(case)
    ref = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                          case["seq_lens"], 1 / math.sqrt(128))
    half = np.array([n // 2 // 16 * 16 for n in lengths], np.int32)
    a, la = cuattn.paged_attention(dcase["q"], dcase["k_cache"], dcase["v_cache"],
                                   dcase["block_tables"], cp.asarray(half), return_lse=True)
    bt2 = case["block_tables"].copy()
    for s, h in enumerate(half):
        bt2[s, : bt2.shape[1] - h // 16] = case["block_tables"][s, h // 16:]
    b, lb = cuattn.paged_attention(dcase["q"], dcase["k_cache"], dcase["v_cache"],
                                   cp.asarray(bt2), cp.asarray(np.array(lengths, np.int32) - half),
                                   return_lse=True)
    out, lse = cuattn.merge_attn_states(a, la, b, lb)
    _check(out, lse, *ref, "f16")


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_captured_in_a_cuda_graph_replays_with_new_lengths(rng, version):
    """No host reads of the data: a graph captured once serves new q and new seq_lens."""
    import cupy as cp
    case = make_case(rng, lengths=[700, 3, 1500, 16], nkv=2, gqa=4, head_size=128,
                     block_size=16, dtype="bf16")
    dcase = _to_device(case)
    out = cp.empty(case["q"].shape, dtype=BF16)
    args = (dcase["q"], dcase["k_cache"], dcase["v_cache"], dcase["block_tables"],
            dcase["seq_lens"])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.paged_attention(*args, version=version, out=out)      # compile outside
        stream.begin_capture()
        cuattn.paged_attention(*args, version=version, out=out)
        graph = stream.end_capture()
    case["q"] = rng.standard_normal(case["q"].shape).astype(BF16)
    case["seq_lens"] = np.array([1500 // 3, 0, 1499, 9], np.int32)   # within each table
    dcase["q"].set(case["q"])
    dcase["seq_lens"].set(case["seq_lens"])
    out.fill(np.nan)
    cp.cuda.Device().synchronize()   # (the replay's stream does not wait for the legacy one)
    graph.launch(stream)
    stream.synchronize()
    ref, _ = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                             case["seq_lens"], 1 / math.sqrt(128))
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all()
    lowp = ref.astype(BF16).astype(np.float64)
    assert np.abs(got - ref).max() <= tolerance(np.abs(lowp - ref).max(), 1e-3)


@pytest.fixture
def form(request):
    """Force the tensor-core ("mma") or the CUDA-core ("simt") form, and a ring optionally."""
    name, ring = request.param
    with tuning.override(paged_form=name, **({"paged_mma": ring} if ring else {})):
        yield name


@pytest.mark.gpu
@pytest.mark.parametrize("form", [("simt", None), ("mma", None)], ids=["simt", "mma"],
                         indirect=True)
@pytest.mark.parametrize("gqa,head_size,block_size,dtype,alibi", [
    (1, 128, 16, "bf16", False), (4, 64, 8, "f16", True), (8, 256, 32, "bf16", False),
    (3, 112, 16, "f16", False), (16, 80, 16, "bf16", True)])
def test_both_forms(rng, form, gqa, head_size, block_size, dtype, alibi):
    """The tensor-core and CUDA-core forms on the same cases (either may be picked by the
    tuning rule): odd groups (3: padded head columns), every block size, ALiBi, v1 and v2 with
    one and many partitions, NaN in every slot that must not be read."""
    case = make_case(rng, lengths=LENGTHS(block_size), nkv=2, gqa=gqa, head_size=head_size,
                     block_size=block_size, dtype=dtype, alibi=alibi)
    dcase = _to_device(case)
    ref, _ = _run(case, dcase, dtype, "v1")
    _run(case, dcase, dtype, "v2", ref=ref, partition_size=128)
    _run(case, dcase, dtype, "v2", ref=ref, partition_size=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("form", [("mma", r) for r in MMA_RINGS], indirect=True,
                         ids=lambda p: f"w{p[1].num_warps}st{p[1].stages}")
def test_mma_rings(rng, form):
    """Every ring shape of MMA_RINGS, against the reference; a long context too (many tiles
    per warp, so the ring wraps many times)."""
    case = make_case(rng, lengths=LENGTHS(16) + [20000], nkv=2, gqa=4, head_size=128,
                     block_size=16, dtype="bf16")
    dcase = _to_device(case)
    ref, _ = _run(case, dcase, "bf16", "v1")
    _run(case, dcase, "bf16", "v2", ref=ref, partition_size=512)


@pytest.mark.gpu
def test_large_scores_and_one_dominant_token(rng):
    """Scores of magnitude ~1e4 (overflow unless the max is subtracted) and softmaxes that a
    few tokens dominate (where a P rounded to bf16 alone would be off by 2^-9)."""
    for gqa in (1, 4):
        case = make_case(rng, lengths=[1, 2, 3, 17, 300], nkv=2, gqa=gqa, head_size=128,
                         block_size=16, dtype="bf16")
        case["q"] = (case["q"].astype(np.float32) * 100).astype(BF16)
        dcase = _to_device(case)
        for scale in (1.0, 1 / math.sqrt(128)):
            ref, _ = _run(case, dcase, "bf16", "v2", softmax_scale=scale)
            _run(case, dcase, "bf16", "v1", ref=ref, softmax_scale=scale)


@pytest.mark.gpu
def test_cached_plan_rereads_pointers_and_still_checks_alignment(rng):
    """A second call of the same signature runs from the cached plan: new arrays (new
    pointers, new values) give their own result, and what the signature does not cover (base
    alignment) is still checked."""
    import cupy as cp
    from cuattn._launch import clear_plans
    from cuattn.paged import attention
    cases = [make_case(rng, lengths=[40, 513, 7], nkv=2, gqa=4, head_size=128, block_size=16,
                       dtype="bf16") for _ in range(2)]
    assert all(cases[0][k].shape == cases[1][k].shape for k in ("q", "k_cache", "block_tables"))
    for version in ("v1", "v2"):
        clear_plans()
        for case in cases:
            _run(case, _to_device(case), "bf16", version)
        assert len(attention._plans) == 1
    d = _to_device(cases[0])
    k = d["k_cache"]
    raw = cp.empty(k.size * 2 + 8, dtype=BF16)
    shifted = cp.ndarray(k.shape, BF16, raw.data + 2, strides=k.strides)   # same signature
    with pytest.raises(ValueError, match="k_cache"):
        cuattn.paged_attention(d["q"], shifted, d["v_cache"], d["block_tables"], d["seq_lens"])
    with pytest.raises(TypeError, match="seq_lens"):
        cuattn.paged_attention(d["q"], k, d["v_cache"], d["block_tables"], cases[0]["seq_lens"])


# -- GPU: reshape_and_cache -------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_kind", [("bf16", "same"), ("f16", "same"),
                                              ("bf16", "e4m3"), ("f16", "u8")])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_reshape_and_cache_round_trip(rng, dtype, cache_kind, slot_dtype):
    import cupy as cp
    nkv, hs, bs, num_blocks, n = 3, 128, 16, 20, 70
    dt = DTYPES[dtype]
    cdt = dt if cache_kind == "same" else CACHE_KINDS[cache_kind]
    kshape, vshape = cuattn.paged_kv_cache_shapes(num_blocks, nkv, hs, bs, cdt)
    k0 = rng.integers(0, 255, size=kshape, dtype=np.uint8) if cdt.itemsize == 1 else \
        rng.standard_normal(kshape).astype(cdt)
    v0 = rng.integers(0, 255, size=vshape, dtype=np.uint8) if cdt.itemsize == 1 else \
        rng.standard_normal(vshape).astype(cdt)
    k0, v0 = k0.view(cdt), v0.view(cdt)
    key = rng.standard_normal((n, nkv, hs)).astype(dt)
    value = rng.standard_normal((n, nkv, hs)).astype(dt)
    slots = rng.permutation(num_blocks * bs)[:n].astype(slot_dtype)
    slots[::7] = -1                                    # skipped
    kc, vc = _device(k0), _device(v0)
    ks, vs = (0.05, 0.03) if cdt.itemsize == 1 else (1.0, 1.0)
    cuattn.reshape_and_cache(cp.asarray(key), cp.asarray(value), kc, vc, cp.asarray(slots),
                             k_scale=ks, v_scale=vs)
    k_exp, v_exp = k0.copy(), v0.copy()
    x = kshape[4]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        blk, off = divmod(int(slot), bs)
        kt, vt = key[t], value[t]
        if cdt.itemsize == 1:
            kt = (kt.astype(np.float32) / np.float32(ks)).astype(E4M3).view(np.uint8).view(cdt)
            vt = (vt.astype(np.float32) / np.float32(vs)).astype(E4M3).view(np.uint8).view(cdt)
        for d in range(0, hs, x):
            k_exp[blk, :, d // x, off, :] = kt[:, d:d + x]
        v_exp[blk, :, :, off] = vt
    bits = np.uint8 if cdt.itemsize == 1 else np.uint16
    assert np.array_equal(kc.get().view(bits), k_exp.view(bits))
    assert np.array_equal(vc.get().view(bits), v_exp.view(bits))


@pytest.mark.gpu
def test_engine_round_trip(rng):
    """reshape_and_cache then paged_attention equals attention over the written tokens."""
    import cupy as cp
    nkv, gqa, hs, bs, n = 2, 4, 128, 16, 100
    kshape, vshape = cuattn.paged_kv_cache_shapes(16, nkv, hs, bs, np.float16)
    kc = cp.full(kshape, np.nan, np.float16)
    vc = cp.full(vshape, np.nan, np.float16)
    blocks = rng.permutation(16)[:7].astype(np.int32)
    slots = (blocks[np.arange(n) // bs] * bs + np.arange(n) % bs).astype(np.int64)
    key = rng.standard_normal((n, nkv, hs)).astype(np.float16)
    value = rng.standard_normal((n, nkv, hs)).astype(np.float16)
    cuattn.reshape_and_cache(cp.asarray(key), cp.asarray(value), kc, vc, cp.asarray(slots))
    q = rng.standard_normal((1, nkv * gqa, hs)).astype(np.float16)
    out = cuattn.paged_attention(cp.asarray(q), kc, vc, cp.asarray(blocks[None]),
                                 cp.asarray(np.array([n], np.int32)))
    kk = np.repeat(key.astype(np.float64), gqa, axis=1)     # (n, nheads, hs)
    vv = np.repeat(value.astype(np.float64), gqa, axis=1)
    logits = np.einsum("hd,nhd->hn", q[0].astype(np.float64), kk) / math.sqrt(hs)
    p = np.exp(logits - logits.max(1, keepdims=True))
    ref = np.einsum("hn,nhd->hd", p / p.sum(1, keepdims=True), vv)
    assert np.abs(out.get()[0].astype(np.float64) - ref).max() < 2e-3


# -- GPU: argument checks ---------------------------------------------------------------------

def _good_args():
    import cupy as cp
    kshape, vshape = cuattn.paged_kv_cache_shapes(8, 2, 128, 16, BF16)
    return dict(q=cp.zeros((3, 8, 128), BF16), k_cache=cp.zeros(kshape, BF16),
                v_cache=cp.zeros(vshape, BF16), block_tables=cp.zeros((3, 4), np.int32),
                seq_lens=cp.ones(3, np.int32))


BAD = [
    ("q float32", lambda a: {**a, "q": a["q"].astype(np.float32)}, TypeError, "q"),
    ("cache dtype differs", lambda a: {**a, "k_cache": a["k_cache"].astype(np.float16)}, TypeError, "k_cache"),
    ("v dtype differs", lambda a: {**a, "v_cache": a["v_cache"].astype(np.float16)}, TypeError, "v_cache"),
    ("head size 100", lambda a: {**a, "q": a["q"][..., :100]}, ValueError, "q"),
    ("block size 64", lambda a: {**a, "k_cache": a["k_cache"].reshape(2, 2, 16, 64, 8),
                                 "v_cache": a["v_cache"].reshape(2, 2, 128, 64)}, ValueError, "block_size"),
    ("int64 block_tables", lambda a: {**a, "block_tables": a["block_tables"].astype(np.int64)}, TypeError, "block_tables"),
    ("block_tables rows", lambda a: {**a, "block_tables": a["block_tables"][:2]}, ValueError, "block_tables"),
    ("seq_lens int64", lambda a: {**a, "seq_lens": a["seq_lens"].astype(np.int64)}, TypeError, "seq_lens"),
    ("seq_lens shape", lambda a: {**a, "seq_lens": a["seq_lens"][:2]}, ValueError, "seq_lens"),
    ("q heads vs kv heads", lambda a: {**a, "q": a["q"][:, :7]}, ValueError, "q"),
    ("v_cache shape", lambda a: {**a, "v_cache": a["v_cache"][:, :1]}, ValueError, "v_cache"),
    ("k_cache rank", lambda a: {**a, "k_cache": a["k_cache"][0]}, ValueError, "k_cache"),
    ("version", lambda a: {**a, "version": "v3"}, ValueError, "version"),
    ("partition", lambda a: {**a, "partition_size": 500}, ValueError, "partition_size"),
    ("alibi dtype", lambda a: {**a, "alibi_slopes": a["q"][0, :, 0]}, TypeError, "alibi_slopes"),
    ("k_scale", lambda a: {**a, "k_scale": -1.0}, ValueError, "k_scale"),
    ("out shape", lambda a: {**a, "out": a["q"][:2]}, ValueError, "out"),
    ("numpy seq_lens", lambda a: {**a, "seq_lens": a["seq_lens"].get()}, TypeError, "seq_lens"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("what,mutate,exc,name", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_naming_the_argument(what, mutate, exc, name):
    import cupy as cp
    with pytest.raises(exc, match=name):
        cuattn.paged_attention(**mutate(_good_args()))
    cp.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("form", [("simt", None)], ids=["simt"], indirect=True)
def test_v1_too_long_is_a_clear_error_and_auto_falls_back(form):
    import cupy as cp
    a = _good_args()
    a["block_tables"] = cp.zeros((3, 20000), np.int32)     # 320k tokens x 4 heads of logits
    with pytest.raises(ValueError, match="v1"):
        cuattn.paged_attention(**a, version="v1")
    out = cuattn.paged_attention(**a, version="auto")
    assert out.shape == (3, 8, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("form", [("mma", None)], ids=["mma"], indirect=True)
def test_v1_of_the_tensor_core_form_has_no_length_limit(rng, form):
    """Its v1 keeps an online softmax, not the logits: a 40000-token sequence runs."""
    case = make_case(rng, lengths=[40000, 7], nkv=1, gqa=4, head_size=64, block_size=32,
                     dtype="f16")
    _run(case, _to_device(case), "f16", "v1")


@pytest.mark.gpu
def test_reshape_and_cache_bad_inputs():
    import cupy as cp
    kshape, vshape = cuattn.paged_kv_cache_shapes(8, 2, 128, 16, BF16)
    kc, vc = cp.zeros(kshape, BF16), cp.zeros(vshape, BF16)
    key = cp.zeros((4, 2, 128), BF16)
    with pytest.raises(TypeError, match="slot_mapping"):
        cuattn.reshape_and_cache(key, key, kc, vc, cp.zeros(4, np.float32))
    with pytest.raises(ValueError, match="slot_mapping"):
        cuattn.reshape_and_cache(key, key, kc, vc, cp.zeros(3, np.int32))
    with pytest.raises(ValueError, match="key"):
        cuattn.reshape_and_cache(key[:, :1], key[:, :1], kc, vc, cp.zeros(4, np.int32))
    with pytest.raises(TypeError, match="value"):
        cuattn.reshape_and_cache(key, key.astype(np.float16), kc, vc, cp.zeros(4, np.int32))
