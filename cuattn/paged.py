"""paged_attention / reshape_and_cache / paged_kv_cache_shapes: decode over a paged KV cache.

Kernels: cuda_src/paged_attention.cuh (v1, v2 and the partition reduce) and
cuda_src/reshape_and_cache.cuh. Layouts are vLLM's (DESIGN.md section 1):
K cache (num_blocks, nheads_kv, head_size // x, block_size, x) with x = 16 // itemsize,
V cache (num_blocks, nheads_kv, head_size, block_size).

One thread block serves ``group`` query heads of one KV head (the largest divisor of the
GQA ratio up to tuning.PAGED_MAX_GROUP), so each K/V byte leaves memory once per group.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import ClassVar

import cupy
import numpy as np

from . import _arrays as A
from . import tuning
from ._dtypes import BY_SHORT, FP8_E4M3, UINT8_E4M3, activation_dtype
from .jit import ParamsStruct, Variant, get_kernel

HEAD_SIZES = (64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)

PARAMS = ParamsStruct("PagedParams", [
    ("out", "ptr"), ("lse", "ptr"), ("tmp_out", "ptr"), ("tmp_lse", "ptr"), ("q", "ptr"),
    ("k_cache", "ptr"), ("v_cache", "ptr"), ("block_tables", "ptr"), ("seq_lens", "ptr"),
    ("alibi_slopes", "ptr"),
    ("q_stride_seq", "i64"), ("q_stride_head", "i64"),
    ("out_stride_seq", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_seq", "i64"),
    ("k_stride_block", "i64"), ("k_stride_head", "i64"), ("k_stride_x", "i64"),
    ("k_stride_token", "i64"),
    ("v_stride_block", "i64"), ("v_stride_head", "i64"), ("v_stride_dim", "i64"),
    ("bt_stride_seq", "i64"),
    ("scale_log2", "f32"), ("v_scale", "f32"),
    ("num_seqs", "i32"), ("num_heads", "i32"), ("gqa_ratio", "i32"),
    ("max_blocks_per_seq", "i32"), ("max_parts", "i32"), ("logits_stride", "i32"),
])

REDUCE_PARAMS = ParamsStruct("PagedReduceParams", [
    ("out", "ptr"), ("lse", "ptr"), ("tmp_out", "ptr"), ("tmp_lse", "ptr"), ("seq_lens", "ptr"),
    ("out_stride_seq", "i64"), ("out_stride_head", "i64"),
    ("lse_stride_head", "i64"), ("lse_stride_seq", "i64"),
    ("num_heads", "i32"), ("max_parts", "i32"), ("partition_size", "i32"),
    ("max_seq_len", "i32"),
])

RESHAPE_PARAMS = ParamsStruct("ReshapeCacheParams", [
    ("key", "ptr"), ("value", "ptr"), ("k_cache", "ptr"), ("v_cache", "ptr"),
    ("slot_mapping", "ptr"),
    ("key_stride_token", "i64"), ("key_stride_head", "i64"),
    ("value_stride_token", "i64"), ("value_stride_head", "i64"),
    ("k_stride_block", "i64"), ("k_stride_head", "i64"), ("k_stride_x", "i64"),
    ("k_stride_token", "i64"),
    ("v_stride_block", "i64"), ("v_stride_head", "i64"), ("v_stride_dim", "i64"),
    ("k_scale", "f32"), ("v_scale", "f32"),
    ("num_tokens", "i32"), ("num_kv_heads", "i32"), ("head_size", "i32"), ("block_size", "i32"),
])


# -- variants ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PagedVariant(Variant):
    dtype: str            # q / out: f16 / bf16
    cache_dtype: str      # f16 / bf16 (same as dtype) or e4m3
    head_size: int
    block_size: int
    group: int            # query heads per thread block (divides the GQA ratio)
    partition_size: int   # 0 = v1 (whole sequence), else v2's partition in tokens
    alibi: bool
    num_threads: int = tuning.PAGED_NUM_THREADS
    min_blocks: int = -1  # __launch_bounds__ min blocks per SM (0: ptxas decides);
                          # -1: tuning.paged_min_blocks picks
    pipeline: int = -1    # -1: tuning.paged_pipeline picks; bit 0: refill K registers with the next
                          # step's vectors during the math; bit 1: the same for V, and the
                          # first V batch issued before the softmax

    op: ClassVar[str] = "paged"
    header: ClassVar[str] = "paged_attention.cuh"
    kernel_template: ClassVar[str] = "paged_attention_kernel"
    params: ClassVar[ParamsStruct] = PARAMS

    def __post_init__(self):
        if self.pipeline < 0:
            object.__setattr__(self, "pipeline", tuning.paged_pipeline(
                self.cache_dtype, self.head_size, self.block_size, self.group))
        if self.min_blocks < 0:
            object.__setattr__(self, "min_blocks", tuning.paged_min_blocks(
                self.cache_dtype, self.head_size, self.block_size, self.group, self.pipeline))

    def name_parts(self):
        return (self.dtype, f"kv{self.cache_dtype}", f"hd{self.head_size}", f"bs{self.block_size}",
                f"g{self.group}", f"p{self.partition_size}" if self.partition_size else "v1",
                f"a{int(self.alibi)}", f"t{self.num_threads}") + \
            ((f"m{self.min_blocks}",) if self.min_blocks else ()) + \
            ((f"pl{self.pipeline}",) if self.pipeline else ())

    def source(self) -> str:
        # The base entry point says __launch_bounds__(num_threads), under which ptxas may cap
        # a 256-thread kernel at 128 registers and spill; min_blocks = 1 lifts the cap.
        src = super().source()
        if not self.min_blocks:
            return src
        plain = f"__launch_bounds__({self.num_threads})"
        assert plain in src
        return src.replace(plain, f"__launch_bounds__({self.num_threads}, {self.min_blocks})")

    def template_args(self):
        return (BY_SHORT[self.dtype].cpp, BY_SHORT[self.cache_dtype].cpp, self.head_size,
                self.block_size, self.group, self.partition_size, self.alibi, self.num_threads,
                self.pipeline)

    def logits_stride(self, max_context: int) -> int:
        """Floats per head of the dynamic shared logits buffer (also holds the V slot sums)."""
        tokens = self.partition_size or max_context
        return max(-(-tokens // 4) * 4, self.num_threads)

    @property
    def dynamic_smem_bytes(self) -> int:
        # v2: fixed. v1: set per call (paged_attention raises the limit itself).
        return 4 * self.group * self.logits_stride(0) if self.partition_size else 0


@dataclass(frozen=True)
class PagedMmaVariant(Variant):
    """The tensor-core form (cuda_src/paged_attention_mma.cuh): 16-bit caches, head sizes
    that are multiples of 16; same params, grid and outputs as PagedVariant."""
    dtype: str            # q / out / caches: f16 / bf16
    head_size: int
    block_size: int
    group: int            # query heads per thread block (the N columns of the MMAs, <= 8)
    partition_size: int   # 0 = v1 (whole sequence), else v2's partition in tokens
    alibi: bool
    num_warps: int = 0    # 0 (the ring knobs): tuning.paged_mma_tiles picks
    stages: int = 0
    tile: int = 0
    p_split: int = -1     # -1: tuning picks; 1: P as hi + lo halves (two P.V MMAs)
    evict_first: int = -1  # -1: tuning picks; 1: K/V copies with an L2 evict-first policy

    op: ClassVar[str] = "paged_mma"
    header: ClassVar[str] = "paged_attention_mma.cuh"
    kernel_template: ClassVar[str] = "paged_attention_mma_kernel"
    params: ClassVar[ParamsStruct] = PARAMS

    def __post_init__(self):
        tiles = tuning.paged_mma_tiles(self.head_size)
        for knob, unset in (("num_warps", 0), ("stages", 0), ("tile", 0), ("p_split", -1),
                            ("evict_first", -1)):
            if getattr(self, knob) == unset:
                object.__setattr__(self, knob, int(getattr(tiles, knob)))

    def name_parts(self):
        return (self.dtype, f"hd{self.head_size}", f"bs{self.block_size}", f"g{self.group}",
                f"p{self.partition_size}" if self.partition_size else "v1",
                f"a{int(self.alibi)}", f"w{self.num_warps}", f"st{self.stages}",
                f"tile{self.tile}") + (("psplit",) if self.p_split else ()) + \
            (("ef",) if self.evict_first else ())

    def template_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_size, self.block_size, self.group,
                self.partition_size, self.alibi, self.num_warps, self.stages, self.tile,
                bool(self.p_split), bool(self.evict_first))

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def source(self) -> str:
        # Shared memory, not registers, bounds the blocks per SM (2 at hd128); under a plain
        # __launch_bounds__(threads) ptxas capped some rings at 96 registers and spilled
        # (NVRTC 12.x, sm_90, stages 4), while (threads, 1) leaves it 150-230 spill-free.
        plain = f"__launch_bounds__({self.num_threads})"
        src = super().source()
        assert plain in src
        return src.replace(plain, f"__launch_bounds__({self.num_threads}, 1)")

    @property
    def dynamic_smem_bytes(self) -> int:
        # each warp's ring: stages x (K tile + V tile), 2-byte elements
        return self.num_warps * self.stages * 2 * self.tile * self.head_size * 2


@dataclass(frozen=True)
class PagedReduceVariant(Variant):
    dtype: str
    head_size: int
    num_threads: int = 32   # 4 dims per thread, whole warps, x thread groups: _reduce_threads

    op: ClassVar[str] = "paged_reduce"
    header: ClassVar[str] = "paged_attention.cuh"
    kernel_template: ClassVar[str] = "paged_attention_reduce_kernel"
    params: ClassVar[ParamsStruct] = REDUCE_PARAMS

    def name_parts(self):
        return (self.dtype, f"hd{self.head_size}", f"t{self.num_threads}")

    def template_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_size, self.num_threads)


@dataclass(frozen=True)
class ReshapeCacheVariant(Variant):
    dtype: str            # key / value
    cache_dtype: str
    slot64: bool          # slot_mapping int64 (else int32)
    num_threads: int = tuning.RESHAPE_CACHE_NUM_THREADS

    op: ClassVar[str] = "reshape_and_cache"
    header: ClassVar[str] = "reshape_and_cache.cuh"
    kernel_template: ClassVar[str] = "reshape_and_cache_kernel"
    params: ClassVar[ParamsStruct] = RESHAPE_PARAMS

    def name_parts(self):
        return (self.dtype, f"kv{self.cache_dtype}", "s64" if self.slot64 else "s32",
                f"t{self.num_threads}")

    def template_args(self):
        return (BY_SHORT[self.dtype].cpp, BY_SHORT[self.cache_dtype].cpp, self.slot64,
                self.num_threads)


def _reduce_threads(head_size: int) -> int:
    """One thread per 4 dims (whole warps) x tuning.PAGED_REDUCE_GROUPS."""
    return -(-head_size // 4 // 32) * 32 * tuning.PAGED_REDUCE_GROUPS


def shipped_variants() -> list[Variant]:
    """bf16/f16 x tuned head sizes x block 16 x v1/v2 x common GQA groups (the form
    paged_attention picks for each), plus the reduce and reshape_and_cache variants."""
    out: list[Variant] = []
    for dt in ("f16", "bf16"):
        for hs in tuning.PAGED_SHIPPED_HEAD_SIZES:
            for bs in tuning.PAGED_SHIPPED_BLOCK_SIZES:
                for g in tuning.PAGED_SHIPPED_GROUPS:
                    for ps in (0, 512):
                        out.append(_variant(dt, dt, hs, bs, g, ps, False))
            out.append(PagedReduceVariant(dt, hs, _reduce_threads(hs)))
        for slot64 in (False, True):
            out.append(ReshapeCacheVariant(dt, dt, slot64))
    return out


# -- checks -----------------------------------------------------------------------------------

def _cache_dtype(x: cupy.ndarray, name: str, q_dtype):
    """Short name of a cache dtype: the activation dtype itself, or e4m3 (float8_e4m3fn/uint8)."""
    if x.dtype == FP8_E4M3.numpy or x.dtype == UINT8_E4M3.numpy:
        return "e4m3"
    if x.dtype == q_dtype.numpy:
        return q_dtype.short
    raise TypeError(f"{name}: dtype {x.dtype} is not supported; expected the query's dtype "
                    f"({q_dtype.numpy}), "
                    "ml_dtypes.float8_e4m3fn or uint8 (fp8 e4m3)")


def _check_scale(value, name: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}") from None
    if not (math.isfinite(f) and f > 0):
        raise ValueError(f"{name}: expected a positive finite float, got {value!r}")
    return f


def _check_caches(k_cache, v_cache, q_dtype, head_size=None):
    """-> (k_cache, v_cache, cache short name, num_kv_heads, head_size, block_size)."""
    k_cache = A.as_device_array(k_cache, "k_cache")
    v_cache = A.as_device_array(v_cache, "v_cache")
    kdoc = "(num_blocks, nheads_kv, head_size // x, block_size, x)"
    vdoc = "(num_blocks, nheads_kv, head_size, block_size)"
    A.check_ndim(k_cache, 5, "k_cache", kdoc)
    A.check_ndim(v_cache, 4, "v_cache", vdoc)
    cache = _cache_dtype(k_cache, "k_cache", q_dtype)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    x = 16 // k_cache.itemsize
    num_blocks, nkv, ngroups, block_size, kx = k_cache.shape
    if kx != x:
        raise ValueError(f"k_cache: the last dimension must be x = 16 // itemsize = {x} "
                         f"for {k_cache.dtype}, got shape {tuple(k_cache.shape)} {kdoc}")
    hs = ngroups * x
    if head_size is not None and hs != head_size:
        raise ValueError(f"k_cache: head_size {hs} (= shape[2] * x) differs from the "
                         f"query's {head_size}")
    if hs not in HEAD_SIZES:
        raise ValueError(f"k_cache: head_size {hs} is not supported; expected one of {HEAD_SIZES}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"k_cache: block_size {block_size} is not supported; "
                         f"expected one of {BLOCK_SIZES}")
    A.check_shape(v_cache, (num_blocks, nkv, hs, block_size), "v_cache", vdoc)
    A.check_last_dim_contiguous(k_cache, "k_cache")
    A.check_last_dim_contiguous(v_cache, "v_cache")
    A.check_aligned(k_cache, 16, "k_cache")
    A.check_aligned(v_cache, min(16, block_size * v_cache.itemsize), "v_cache")
    return k_cache, v_cache, cache, nkv, hs, block_size


def paged_kv_cache_shapes(num_blocks: int, nheads_kv: int, head_size: int, block_size: int,
                          dtype) -> tuple[tuple, tuple]:
    """(k_cache_shape, v_cache_shape) of a paged cache of ``dtype`` elements.

    K: (num_blocks, nheads_kv, head_size // x, block_size, x) with x = 16 // itemsize;
    V: (num_blocks, nheads_kv, head_size, block_size).
    """
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
    if head_size not in HEAD_SIZES:
        raise ValueError(f"head_size: {head_size} is not supported; expected one of {HEAD_SIZES}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size: {block_size} is not supported; expected one of {BLOCK_SIZES}")
    x = 16 // dt.itemsize
    if head_size % x:
        raise ValueError(f"head_size: {head_size} is not a multiple of x = {x} "
                         f"(16-byte vectors of {dt})")
    return ((int(num_blocks), int(nheads_kv), head_size // x, block_size, x),
            (int(num_blocks), int(nheads_kv), head_size, block_size))


# -- per-device facts (cached: the hot path is dictionary hits) -------------------------------

_num_sms: dict[int, int] = {}
_v1_smem_limit: dict[tuple[int, PagedVariant], int] = {}


def _sm_count(device_id: int) -> int:
    n = _num_sms.get(device_id)
    if n is None:
        n = _num_sms[device_id] = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    return n


def _v1_kernel(key: PagedVariant, device_id: int):
    """The v1 kernel with its dynamic shared memory limit raised to the device's maximum."""
    kernel = get_kernel(key, device_id)
    limit = _v1_smem_limit.get((device_id, key))
    if limit is None:
        drv = cupy.cuda.driver
        with cupy.cuda.Device(device_id):
            optin = cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
            static = drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kernel.ptr)
            limit = optin - static
            drv.funcSetAttribute(kernel.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 limit)
        _v1_smem_limit[(device_id, key)] = limit
    return kernel, limit


def _v1_fits(key, device_id: int, max_context: int) -> tuple[bool, int, int]:
    """Whether v1's logits fit in shared memory (the tensor-core form keeps none: always)."""
    if isinstance(key, PagedMmaVariant):
        return True, 0, 0
    _, limit = _v1_kernel(key, device_id)
    need = 4 * key.group * key.logits_stride(max_context)
    return need <= limit, need, limit


def _variant(dtype: str, cache: str, head_size: int, block_size: int, group: int,
             partition_size: int, alibi: bool) -> PagedVariant | PagedMmaVariant:
    """The main kernel's key: the tensor-core form where tuning.paged_uses_mma says so (or
    _MMA_OVERRIDES["use"] forces it), else the CUDA-core form."""
    use = _MMA_OVERRIDES.get("use")
    if use is None:
        use = tuning.paged_uses_mma(cache, head_size, group)
    if use and cache != "e4m3" and head_size % 16 == 0:
        knobs = {k: v for k, v in _MMA_OVERRIDES.items() if k != "use"}
        return PagedMmaVariant(dtype, head_size, block_size, group, partition_size, alibi,
                               **knobs)
    return PagedVariant(dtype, cache, head_size, block_size, group, partition_size, alibi,
                        **_VARIANT_OVERRIDES)


def _choose(v1_key, version: str, partition_size: int | None, num_heads: int, num_seqs: int,
            max_context: int, device_id: int) -> tuple[str, int]:
    """(version, partition_size) that a call runs: "auto" by the tuning rule of its form, and
    v2's partition when the call names none."""
    num_ctas_v1 = (num_heads // v1_key.group) * num_seqs
    if isinstance(v1_key, PagedMmaVariant):
        if version == "auto":
            return tuning.paged_mma_plan(num_ctas_v1, max_context, _sm_count(device_id),
                                         partition_size)
        if version == "v2" and partition_size is None:
            return "v2", tuning.paged_mma_partition(num_ctas_v1, max_context,
                                                    _sm_count(device_id))
        return version, partition_size or 0
    partition_size = partition_size or tuning.PAGED_PARTITION_SIZE
    if version == "auto":
        version = tuning.paged_version(num_ctas_v1, max_context, partition_size,
                                       _sm_count(device_id))
        if version == "v1" and not _v1_fits(v1_key, device_id, max_context)[0]:
            version = "v2"
    return version, partition_size


def auto_version(q_shape, cache_dtype, nheads_kv: int, block_size: int, max_blocks_per_seq: int,
                 *, alibi: bool = False, partition_size: int | None = None,
                 device_id: int = 0) -> str:
    """What version="auto" runs for these shapes ("v1" or "v2 p<partition>"); for
    benchmarks and tests."""
    num_seqs, num_heads, head_size = q_shape
    gqa = num_heads // nheads_kv
    group = max(g for g in range(1, tuning.PAGED_MAX_GROUP + 1) if gqa % g == 0)
    dt = np.dtype(cache_dtype)
    cache = "e4m3" if dt.itemsize == 1 else ("f16" if dt == np.float16 else "bf16")
    key = _variant("f16" if cache == "e4m3" else cache, cache, head_size, block_size, group,
                   0, alibi)
    version, ps = _choose(key, "auto", partition_size, num_heads, num_seqs,
                          max_blocks_per_seq * block_size, device_id)
    return version if version == "v1" else f"v2 p{ps}"


# -- paged_attention --------------------------------------------------------------------------
#
# Host path. Everything validated about a call depends only on its *signature* (shapes,
# strides, dtypes, devices, flags, scalars): the first call of a signature runs every check
# and builds a _Plan (kernels, grids, the static part of the params structs); a later call
# with the same signature re-reads the data pointers, packs them in front of the plan's
# static bytes and launches. Values inside the arrays (seq_lens, block_tables) are never read
# on the host. Only base-address alignment depends on more than the signature: it is checked
# on every call.

_PTR = struct.Struct("<10Q")          # PARAMS' leading ten pointers
_RPTR = struct.Struct("<5Q")          # REDUCE_PARAMS' leading five pointers
_PLAN_CACHE_MAX = 512
_plans: dict = {}
# Knobs forced on every PagedVariant that paged_attention builds (pipeline, min_blocks,
# num_threads): for bench/lab/decode_sweep.py only, which clears _plans after changing it.
_VARIANT_OVERRIDES: dict = {}
# The same for the tensor-core form (num_warps, stages, tile, p_split, evict_first), and
# "use": True / False to force it on / off where it can run.
_MMA_OVERRIDES: dict = {}


def _static_tail(ps: ParamsStruct, n_ptrs: int, **fields) -> bytes:
    """The bytes of ``ps`` after its first ``n_ptrs`` pointer fields (all 8-byte, at offset 0)."""
    names = [n for n, _ in ps.fields]
    assert all(k == "ptr" for _, k in ps.fields[:n_ptrs])
    assert [ps.offsets()[n] for n in names[:n_ptrs]] == [8 * i for i in range(n_ptrs)]
    return ps.pack(**{n: 0 for n in names[:n_ptrs]}, **fields).tobytes()[8 * n_ptrs:]


@dataclass(frozen=True)
class _Plan:
    version: str                 # "v1" / "v2" / "" (num_seqs == 0: nothing to launch)
    out_shape: tuple
    out_dtype: np.dtype
    lse_shape: tuple | None      # None: return_lse=False
    v_align: int                 # v_cache base alignment (k_cache: 16)
    kernel: object = None
    grid: tuple = ()
    block: tuple = ()
    smem: int = 0
    tail: bytes = b""            # PARAMS after the pointers
    launch_main: bool = True     # v2 with max_context == 0 runs the reduce only
    reduce: object = None
    rgrid: tuple = ()
    rblock: tuple = ()
    rtail: bytes = b""
    tmp_out_bytes: int = 0
    tmp_bytes: int = 0           # tmp_out + tmp_lse, one allocation


def _arr_sig(x):
    return (x.shape, x.strides, x.dtype, x.data.device_id)


def _signature(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, out, scalars):
    """Hashable description of a call, or None when an input is not a cupy.ndarray."""
    nd = cupy.ndarray
    if not (type(q) is nd and type(k_cache) is nd and type(v_cache) is nd
            and type(block_tables) is nd and type(seq_lens) is nd
            and (alibi_slopes is None or type(alibi_slopes) is nd)
            and (out is None or type(out) is nd)):
        return None
    return (_arr_sig(q), _arr_sig(k_cache), _arr_sig(v_cache), _arr_sig(block_tables),
            _arr_sig(seq_lens), None if alibi_slopes is None else _arr_sig(alibi_slopes),
            None if out is None else _arr_sig(out), scalars)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, softmax_scale=None,
                    k_scale=1.0, v_scale=1.0, alibi_slopes=None, version="auto",
                    partition_size=None, return_lse=False, out=None, stream=None):
    """Decode attention of one query token per sequence over a paged KV cache.

    q: (num_seqs, nheads, head_size) float16 / bfloat16.
    k_cache: (num_blocks, nheads_kv, head_size // x, block_size, x), x = 16 // itemsize.
    v_cache: (num_blocks, nheads_kv, head_size, block_size). Same dtype as q, or fp8 e4m3
        (ml_dtypes.float8_e4m3fn or uint8) dequantised as value * k_scale / v_scale (the
        scales are ignored for 16-bit caches, as in vLLM).
    block_tables: int32 (num_seqs, max_blocks_per_seq); seq_lens: int32 (num_seqs,). A
        sequence longer than max_blocks_per_seq * block_size is clamped to that.
    alibi_slopes: float32 (nheads,) or None; bias slope * (j - seq_len + 1) on key j.
    version: "v1", "v2" or "auto"; partition_size: v2's tokens per thread block, one of
        128 / 256 / 512 / 1024, or None: the tuning rule's choice (cuattn.tuning).
    Returns out (like q), or (out, lse) with lse float32 (nheads, num_seqs), natural log,
    -inf for an empty sequence: the layout cuattn.merge_attn_states takes.
    """
    try:
        sig = _signature(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, out,
                         (softmax_scale, k_scale, v_scale, version, partition_size,
                          bool(return_lse)))
        plan = _plans.get(sig) if sig is not None else None
    except TypeError:                 # an unhashable scalar: the checks below say what is wrong
        sig = plan = None
    if plan is not None and (k_cache.data.ptr % 16 or v_cache.data.ptr % plan.v_align
                             or (block_tables.data.ptr | seq_lens.data.ptr) % 4
                             or (alibi_slopes is not None and alibi_slopes.data.ptr % 4)):
        plan = None                   # the checks below raise the alignment error
    if plan is None:
        plan, (q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, out) = _make_plan(
            q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
            alibi_slopes, version, partition_size, bool(return_lse), out)
        if sig is not None:
            if len(_plans) >= _PLAN_CACHE_MAX:
                _plans.clear()
            _plans[sig] = plan
    device_id = q.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            return _execute(plan, q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes,
                            out, stream)
    return _execute(plan, q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, out, stream)


def _execute(plan: _Plan, q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, out,
             stream):
    """Allocate the outputs (and v2 scratch), pack the params, launch. No checks here."""
    current = cupy.cuda.get_current_stream()
    if stream is None:
        stream = current
    else:
        stream = A.resolve_stream(stream)
    if out is None:
        out = cupy.empty(plan.out_shape, dtype=plan.out_dtype)
    lse = cupy.empty(plan.lse_shape, dtype=np.float32) if plan.lse_shape is not None else None
    if not plan.version:
        return (out, lse) if lse is not None else out
    out_ptr = out.data.ptr
    lse_ptr = lse.data.ptr if lse is not None else 0
    q_ptr, k_ptr, v_ptr = q.data.ptr, k_cache.data.ptr, v_cache.data.ptr
    bt_ptr, sl_ptr = block_tables.data.ptr, seq_lens.data.ptr
    al_ptr = alibi_slopes.data.ptr if alibi_slopes is not None else 0
    if plan.version == "v1":
        params = np.frombuffer(_PTR.pack(out_ptr, lse_ptr, 0, 0, q_ptr, k_ptr, v_ptr, bt_ptr,
                                         sl_ptr, al_ptr) + plan.tail, PARAMS.dtype)[0]
        plan.kernel(plan.grid, plan.block, (params,), shared_mem=plan.smem, stream=stream)
        return (out, lse) if lse is not None else out
    # v2: one scratch allocation (tmp_out, then tmp_lse), from the pool of the launch stream
    # so that it is not handed to another stream's allocation while the kernels still run.
    if stream is current or stream.ptr == current.ptr:
        scratch = cupy.cuda.alloc(plan.tmp_bytes)
    else:
        with stream:
            scratch = cupy.cuda.alloc(plan.tmp_bytes)
    A.keep_if_capturing(stream, scratch)
    tmp_out = scratch.ptr
    tmp_lse = tmp_out + plan.tmp_out_bytes
    if plan.launch_main:
        params = np.frombuffer(_PTR.pack(0, 0, tmp_out, tmp_lse, q_ptr, k_ptr, v_ptr, bt_ptr,
                                         sl_ptr, al_ptr) + plan.tail, PARAMS.dtype)[0]
        plan.kernel(plan.grid, plan.block, (params,), shared_mem=plan.smem, stream=stream)
    rparams = np.frombuffer(_RPTR.pack(out_ptr, lse_ptr, tmp_out, tmp_lse, sl_ptr) + plan.rtail,
                            REDUCE_PARAMS.dtype)[0]
    plan.reduce(plan.rgrid, plan.rblock, (rparams,), stream=stream)
    return (out, lse) if lse is not None else out


def _make_plan(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
               alibi_slopes, version, partition_size, return_lse, out):
    """Every check of paged_attention (raising before any launch) -> (_Plan, the arrays)."""
    q = A.as_device_array(q, "q")
    A.check_ndim(q, 3, "q", "(num_seqs, nheads, head_size)")
    dtype = activation_dtype(q.dtype, "q")
    num_seqs, num_heads, head_size = q.shape
    if head_size not in HEAD_SIZES:
        raise ValueError(f"q: head_size {head_size} is not supported; expected one of {HEAD_SIZES}")
    if num_seqs > 65535:
        raise ValueError(f"q: num_seqs {num_seqs} is more than one launch's 65535 "
                         "(a grid dimension); split the batch")
    A.check_last_dim_contiguous(q, "q")
    k_cache, v_cache, cache, num_kv_heads, _, block_size = _check_caches(
        k_cache, v_cache, dtype, head_size)
    if num_heads == 0:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q: nheads {num_heads} is not a multiple of the caches' nheads_kv "
                         f"{num_kv_heads}")
    block_tables = A.as_device_array(block_tables, "block_tables")
    A.check_ndim(block_tables, 2, "block_tables", "(num_seqs, max_blocks_per_seq)")
    A.check_dtype(block_tables, np.int32, "block_tables")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected {num_seqs} rows (num_seqs), got shape "
                         f"{tuple(block_tables.shape)}")
    A.check_last_dim_contiguous(block_tables, "block_tables")
    A.check_aligned(block_tables, 4, "block_tables")
    seq_lens = A.as_device_array(seq_lens, "seq_lens")
    A.check_dtype(seq_lens, np.int32, "seq_lens")
    A.check_shape(seq_lens, (num_seqs,), "seq_lens", "(num_seqs,)")
    A.check_last_dim_contiguous(seq_lens, "seq_lens")
    A.check_aligned(seq_lens, 4, "seq_lens")
    if alibi_slopes is not None:
        alibi_slopes = A.as_device_array(alibi_slopes, "alibi_slopes")
        A.check_dtype(alibi_slopes, np.float32, "alibi_slopes")
        A.check_shape(alibi_slopes, (num_heads,), "alibi_slopes", "(nheads,)")
        A.check_last_dim_contiguous(alibi_slopes, "alibi_slopes")
        A.check_aligned(alibi_slopes, 4, "alibi_slopes")
    if not isinstance(version, str) or version not in ("auto", "v1", "v2"):
        raise ValueError(f"version: expected 'auto', 'v1' or 'v2', got {version!r}")
    if partition_size is not None:
        if partition_size not in tuning.PAGED_PARTITION_SIZES or isinstance(partition_size, bool):
            raise ValueError(f"partition_size: expected None or one of "
                             f"{tuning.PAGED_PARTITION_SIZES}, got {partition_size!r}")
        partition_size = int(partition_size)
    k_scale = _check_scale(k_scale, "k_scale")
    v_scale = _check_scale(v_scale, "v_scale")
    if cache != "e4m3":
        k_scale = v_scale = 1.0
    softmax_scale = A.check_softmax_scale(softmax_scale, head_size, k_scale)
    device_id = q.device.id
    A.check_same_device({"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
                         "seq_lens": seq_lens, "alibi_slopes": alibi_slopes}, device_id)
    if out is not None:
        out = A.as_device_array(out, "out")
        A.check_shape(out, q.shape, "out", "(num_seqs, nheads, head_size)")
        A.check_dtype(out, q.dtype, "out")
        A.check_last_dim_contiguous(out, "out")
        A.check_same_device({"out": out}, device_id)

    gqa = num_heads // num_kv_heads
    group = max(g for g in range(1, tuning.PAGED_MAX_GROUP + 1) if gqa % g == 0)
    max_blocks = block_tables.shape[1]
    max_context = max_blocks * block_size
    alibi = alibi_slopes is not None
    arrays = (q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, out)
    base = dict(out_shape=tuple(q.shape), out_dtype=q.dtype,
                lse_shape=(num_heads, num_seqs) if return_lse else None,
                v_align=min(16, block_size * v_cache.itemsize))

    with cupy.cuda.Device(device_id):
        v1_key = _variant(dtype.short, cache, head_size, block_size, group, 0, alibi)
        version, partition_size = _choose(v1_key, version, partition_size, num_heads, num_seqs,
                                          max_context, device_id)
        if version == "v1":
            fits, need, limit = _v1_fits(v1_key, device_id, max_context)
            if not fits:
                raise ValueError(
                    f"block_tables: v1 keeps the logits of a whole sequence in shared memory; "
                    f"max_blocks_per_seq * block_size = {max_context} tokens x {group} heads "
                    f"needs {need} bytes, more than this device's {limit}; use version='v2' "
                    "or 'auto'")
        if num_seqs == 0:
            return _Plan(version="", **base), arrays

        # out strides: the given out's, or those of the contiguous array _execute allocates
        if out is not None:
            o_seq, o_head, _ = A.element_strides(out)
        else:
            o_seq, o_head = num_heads * head_size, head_size
        l_head, l_seq = (num_seqs, 1) if return_lse else (0, 0)
        common = dict(
            q_stride_seq=q.strides[0] // q.itemsize, q_stride_head=q.strides[1] // q.itemsize,
            k_stride_block=k_cache.strides[0] // k_cache.itemsize,
            k_stride_head=k_cache.strides[1] // k_cache.itemsize,
            k_stride_x=k_cache.strides[2] // k_cache.itemsize,
            k_stride_token=k_cache.strides[3] // k_cache.itemsize,
            v_stride_block=v_cache.strides[0] // v_cache.itemsize,
            v_stride_head=v_cache.strides[1] // v_cache.itemsize,
            v_stride_dim=v_cache.strides[2] // v_cache.itemsize,
            bt_stride_seq=block_tables.strides[0] // 4,
            scale_log2=softmax_scale * k_scale * A.LOG2E, v_scale=v_scale,
            num_seqs=num_seqs, num_heads=num_heads, gqa_ratio=gqa,
            max_blocks_per_seq=max_blocks)
        grid_x = num_heads // group

        if version == "v1":
            if isinstance(v1_key, PagedMmaVariant):   # online softmax: no logits buffer
                kernel, ls, smem = get_kernel(v1_key, device_id), 0, v1_key.dynamic_smem_bytes
            else:
                kernel, _ = _v1_kernel(v1_key, device_id)
                ls = v1_key.logits_stride(max_context)
                smem = 4 * group * ls
            tail = _static_tail(PARAMS, 10, out_stride_seq=o_seq, out_stride_head=o_head,
                                lse_stride_head=l_head, lse_stride_seq=l_seq, max_parts=1,
                                logits_stride=ls, **common)
            return _Plan(version="v1", kernel=kernel, grid=(grid_x, num_seqs, 1),
                         block=(v1_key.num_threads,), smem=smem, tail=tail, **base), arrays

        key = _variant(dtype.short, cache, head_size, block_size, group, partition_size, alibi)
        rkey = PagedReduceVariant(dtype.short, head_size, _reduce_threads(head_size))
        kernel = get_kernel(key, device_id)
        reduce = get_kernel(rkey, device_id)
        max_parts = max(1, -(-max_context // partition_size))
        tmp_out_bytes = num_seqs * num_heads * max_parts * head_size * 4   # a multiple of 16
        tmp_lse_bytes = num_seqs * num_heads * max_parts * 4
        tail = _static_tail(PARAMS, 10, out_stride_seq=0, out_stride_head=0, lse_stride_head=0,
                            lse_stride_seq=0, max_parts=max_parts,
                            logits_stride=0 if isinstance(key, PagedMmaVariant)
                            else key.logits_stride(0), **common)
        rtail = _static_tail(REDUCE_PARAMS, 5, out_stride_seq=o_seq, out_stride_head=o_head,
                             lse_stride_head=l_head, lse_stride_seq=l_seq, num_heads=num_heads,
                             max_parts=max_parts, partition_size=partition_size,
                             max_seq_len=max_context)
        return _Plan(version="v2", kernel=kernel, grid=(grid_x, num_seqs, max_parts),
                     block=(key.num_threads,), smem=key.dynamic_smem_bytes, tail=tail,
                     launch_main=max_context > 0, reduce=reduce,
                     rgrid=(num_heads, num_seqs), rblock=(rkey.num_threads,), rtail=rtail,
                     tmp_out_bytes=tmp_out_bytes, tmp_bytes=tmp_out_bytes + tmp_lse_bytes,
                     **base), arrays


# -- reshape_and_cache ------------------------------------------------------------------------

_RS_PTR = struct.Struct("<5Q")       # RESHAPE_PARAMS' leading five pointers
_rs_plans: dict = {}


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0,
                      stream=None):
    """Write new tokens into the paged caches: token i goes to slot slot_mapping[i]
    (= physical_block * block_size + offset); a negative slot is skipped.

    key, value: (num_tokens, nheads_kv, head_size) float16 / bfloat16.
    k_cache / v_cache: as for paged_attention, the same dtype as key, or fp8 e4m3 (then the
    cache stores round-to-nearest(key / k_scale) and (value / v_scale)).
    slot_mapping: int32 or int64 (num_tokens,).
    """
    # Same scheme as paged_attention: the checks run once per signature; a repeated call
    # re-reads the pointers (whose alignment is checked every time) and launches.
    nd = cupy.ndarray
    plan = sig = None
    if (type(key) is nd and type(value) is nd and type(k_cache) is nd and type(v_cache) is nd
            and type(slot_mapping) is nd):
        try:
            sig = (_arr_sig(key), _arr_sig(value), _arr_sig(k_cache), _arr_sig(v_cache),
                   _arr_sig(slot_mapping), k_scale, v_scale)
            plan = _rs_plans.get(sig)
        except TypeError:
            sig = plan = None
    if plan is not None and ((key.data.ptr | value.data.ptr | k_cache.data.ptr) % 16
                             or v_cache.data.ptr % plan[4]
                             or slot_mapping.data.ptr % slot_mapping.itemsize):
        plan = None
    if plan is None:
        plan, (key, value, k_cache, v_cache, slot_mapping) = _reshape_plan(
            key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        if sig is not None:
            if len(_rs_plans) >= _PLAN_CACHE_MAX:
                _rs_plans.clear()
            _rs_plans[sig] = plan
    stream = cupy.cuda.get_current_stream() if stream is None else A.resolve_stream(stream)
    kernel, grid, block, tail, _ = plan
    if kernel is None:
        return
    params = np.frombuffer(_RS_PTR.pack(key.data.ptr, value.data.ptr, k_cache.data.ptr,
                                        v_cache.data.ptr, slot_mapping.data.ptr) + tail,
                           RESHAPE_PARAMS.dtype)[0]
    device_id = key.data.device_id
    if cupy.cuda.runtime.getDevice() != device_id:
        with cupy.cuda.Device(device_id):
            kernel(grid, block, (params,), stream=stream)
    else:
        kernel(grid, block, (params,), stream=stream)


def _reshape_plan(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """Every check of reshape_and_cache -> ((kernel, grid, block, static tail, v_cache
    alignment), the arrays); kernel None when there is nothing to write."""
    key = A.as_device_array(key, "key")
    value = A.as_device_array(value, "value")
    doc = "(num_tokens, nheads_kv, head_size)"
    A.check_ndim(key, 3, "key", doc)
    dtype = activation_dtype(key.dtype, "key")
    A.check_dtype(value, key.dtype, "value")
    A.check_shape(value, key.shape, "value", doc)
    num_tokens, nkv, head_size = key.shape
    if head_size not in HEAD_SIZES:
        raise ValueError(f"key: head_size {head_size} is not supported; expected one of {HEAD_SIZES}")
    k_cache, v_cache, cache, cache_nkv, _, block_size = _check_caches(
        k_cache, v_cache, dtype, head_size)
    if cache_nkv != nkv:
        raise ValueError(f"key: nheads_kv {nkv} differs from the caches' {cache_nkv}")
    for name, x in (("key", key), ("value", value)):
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)
    slot_mapping = A.as_device_array(slot_mapping, "slot_mapping")
    if slot_mapping.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"slot_mapping: expected dtype int32 or int64, got {slot_mapping.dtype}")
    A.check_shape(slot_mapping, (num_tokens,), "slot_mapping", "(num_tokens,)")
    A.check_last_dim_contiguous(slot_mapping, "slot_mapping")
    A.check_aligned(slot_mapping, slot_mapping.itemsize, "slot_mapping")
    k_scale = _check_scale(k_scale, "k_scale")
    v_scale = _check_scale(v_scale, "v_scale")
    device_id = key.device.id
    A.check_same_device({"value": value, "k_cache": k_cache, "v_cache": v_cache,
                         "slot_mapping": slot_mapping}, device_id)
    arrays = (key, value, k_cache, v_cache, slot_mapping)
    v_align = min(16, block_size * v_cache.itemsize)
    if num_tokens == 0:
        return (None, (), (), b"", v_align), arrays
    variant = ReshapeCacheVariant(dtype.short, cache, slot_mapping.dtype == np.int64)
    with cupy.cuda.Device(device_id):
        kernel = get_kernel(variant, device_id)
    ks, vs = k_cache.strides, v_cache.strides
    ci = k_cache.itemsize
    tail = _static_tail(
        RESHAPE_PARAMS, 5,
        key_stride_token=key.strides[0] // key.itemsize,
        key_stride_head=key.strides[1] // key.itemsize,
        value_stride_token=value.strides[0] // value.itemsize,
        value_stride_head=value.strides[1] // value.itemsize,
        k_stride_block=ks[0] // ci, k_stride_head=ks[1] // ci, k_stride_x=ks[2] // ci,
        k_stride_token=ks[3] // ci,
        v_stride_block=vs[0] // ci, v_stride_head=vs[1] // ci, v_stride_dim=vs[2] // ci,
        k_scale=k_scale, v_scale=v_scale, num_tokens=num_tokens, num_kv_heads=nkv,
        head_size=head_size, block_size=block_size)
    return (kernel, (num_tokens,), (variant.num_threads,), tail, v_align), arrays
