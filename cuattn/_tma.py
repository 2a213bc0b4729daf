"""TMA tensor maps of a flash call (cuda_src/flash_fwd_sm90.cuh's FlashTmaMaps).

Q, K and V are each described as a 4-d tensor (head dim, row, head, batch) with the call's
strides (varlen's packed (total, heads, head dim) arrays as batch 1; a paged NHD cache
(num_blocks, block_size, heads, head dim) as (head dim, slot, head, cache block)), 128-byte
swizzle and zero fill out of bounds: the Hopper kernel's producer copies a 64-column block
of a tile (paged: of the tile's keys in one cache block, paged_box_rows) by one
``cp.async.bulk.tensor``. vLLM's paged layout takes 5-d maps without swizzle whose strides
do not increase (_Tensor.vllm_k / vllm_v): a box of a cache block's keys lands as the
no-swizzle core matrices wgmma reads. A tensor map holds its tensor's address, so the maps are
encoded on the host (the driver's ``cuTensorMapEncodeTiled``, which touches no device) for
the pointers of each call, and kept per plan for the pointers seen last: a call on the
buffers of an earlier one encodes nothing.
"""
from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

import numpy as np

from .constants import KV_DENSE, KV_PAGED_NHD, KV_PAGED_VLLM

MAP_BYTES = 128                      # sizeof(CUtensorMap)
MAPS_DTYPE = np.dtype([("q", f"V{MAP_BYTES}"), ("k", f"V{MAP_BYTES}"), ("v", f"V{MAP_BYTES}")])
# The argument of a cp.async form of the kernel, which never reads it.
NO_MAPS = np.zeros((), MAPS_DTYPE)[()]
# FlashSm90Schedule (its tile counter's pointer: 8 bytes) of a call whose grid is its
# schedule.
NO_SCHEDULE = np.uint64(0)


def no_maps(ptrs: list) -> tuple:
    """The launch arguments of a cp.async form (Launch.extra): no maps, no schedule."""
    return (NO_MAPS, NO_SCHEDULE)


_ROW_BYTES = 128                     # a 128-byte swizzle row: the columns of a box
_MAX_STRIDE = 1 << 40
_KEEP = 16                           # pointer triples a plan keeps the maps of

# cuda.h's enumerators for the maps below (tests/test_flash_sm90.py checks them against
# cuda.bindings.driver's).
# CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _UINT8 (e4m3 bytes: TMA moves them as bytes)
DATA_TYPE = {"f16": 6, "bf16": 9, "e4m3": 0}
INTERLEAVE_NONE, L2_PROMOTION_256B, OOB_FILL_ZERO = 0, 3, 0
SWIZZLE_NONE, SWIZZLE_32B, SWIZZLE_128B = 0, 1, 3
# vLLM's V boxes hold at most this many keys (flash_fwd_sm90.cuh's VLLM_V_BOX)
VLLM_V_BOX = 16


def paged_box_rows(block_n: int, block_size: int) -> int:
    """The keys of one box of a paged map: the block size, at most the largest power of two
    dividing block_n (flash_fwd_sm90.cuh's Traits::box_rows)."""
    return min(block_n & -block_n, block_size)


def fits(x) -> bool:
    """Whether a tensor map can describe the ([batch,] rows, heads, head dim) array ``x``:
    the outer strides of its dimensions longer than one positive and below 2**40 bytes (the
    flash checks already made them multiples of 16)."""
    return all(0 < s < _MAX_STRIDE for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)


def _fits_vllm(k, v) -> bool:
    """vLLM's caches (cuattn.paged.layout): a K token's 16 bytes next to the next token's
    (8 tokens of one chunk are one 128-byte run; for blocks of 8 likewise V's 8 dims),
    every stride a positive multiple of 16 below 2**40 bytes."""
    strides = [s for s, n in zip(k.strides[:3] + v.strides[:3], k.shape[:3] + v.shape[:3])
               if n > 1]
    return k.strides[3] == 16 and (v.shape[3] > 8 or v.strides[2] == 16) and \
        all(0 < s < _MAX_STRIDE and s % 16 == 0 for s in strides)


def _vllm_tensors(q, k, v, block_n: int, head_dim: int) -> tuple:
    """The maps of a call on vLLM's caches: K's boxes of paged_box_rows keys, V's of at most
    VLLM_V_BOX."""
    rows = paged_box_rows(block_n, k.shape[3])
    return (_Tensor.of(q, 64), _Tensor.vllm_k(k, rows, head_dim),
            _Tensor.vllm_v(v, min(rows, VLLM_V_BOX), head_dim))


@dataclass(frozen=True)
class ArraySpec:
    """The shape of an array a plan makes itself (scratch), as _Tensor.of reads an array."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]     # bytes
    itemsize: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], itemsize: int) -> "ArraySpec":
        strides, step = [], itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(tuple(shape), tuple(reversed(strides)), itemsize)


def encodable(dtype_short: str, arrays, kv_layout: str | None = None) -> bool:
    """Whether tensor maps describe every array of ``arrays`` (q, k, v; kv_layout "vllm":
    k and v are vLLM's paged caches): fits(), and the driver takes its maps (tried once per
    call signature, by the plan). q None: a copy the plan makes (always describable)."""
    q, k, v = arrays
    if kv_layout == "vllm":
        if not (fits(q) and _fits_vllm(k, v)):
            return False
        tensors = zip(arrays, _vllm_tensors(q, k, v, 128, 64))
    else:
        arrays = [x for x in arrays if x is not None]
        if not all(fits(x) for x in arrays):
            return False
        tensors = [(x, _Tensor.of(x, 64)) for x in arrays]
    try:
        for x, t in tensors:
            encode(dtype_short, x.data.ptr, t)
    except RuntimeError:
        return False
    return True


def _length_one_free(pairs) -> tuple:
    """The byte strides of (stride, length) pairs, 16 for a dimension of length one: it is
    never stepped, and any valid stride describes it."""
    return tuple(st if n > 1 else 16 for st, n in pairs)


@dataclass(frozen=True)
class _Tensor:
    """What a map of one array says, but its address: dims innermost first, the byte strides
    of the dims after the first, the box and the swizzle."""
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = SWIZZLE_128B

    @classmethod
    def of(cls, x, box_rows: int) -> "_Tensor":
        """The map of a (batch, rows, heads, head dim) or varlen (rows, heads, head dim) x."""
        b, s, h, d = x.shape if x.ndim == 4 else (1,) + x.shape
        sb, ss, sh, _ = x.strides if x.ndim == 4 else (0,) + x.strides
        return cls((d, max(s, 1), h, b), _length_one_free(((ss, s), (sh, h), (sb, b))),
                   (_ROW_BYTES // x.itemsize, box_rows, 1, 1))

    @classmethod
    def vllm_k(cls, k, box_rows: int, head_dim: int) -> "_Tensor":
        """vLLM's K cache (num_blocks, kvh, hd / 8, block, 8) as (8 tokens x 8 columns, chunk,
        token group, KV head, cache block), no swizzle: a box of box_rows tokens lands as
        [group][chunk][token % 8][8 columns] (the chunk's stride, block x 16 bytes, comes
        before the group's 128: the driver takes strides that do not increase). head_dim:
        the compiled one (whole chunks past the real head size land as zeros)."""
        nb, nkv, chunks, bs, _ = k.shape
        sb, sh, sx, st, _ = k.strides
        return cls((64, chunks, bs // 8, nkv, nb),
                   _length_one_free(((sx, chunks), (8 * st, bs // 8), (sh, nkv), (sb, nb))),
                   (64, head_dim // 8, box_rows // 8, 1, 1), SWIZZLE_NONE)

    @classmethod
    def vllm_v(cls, v, box_rows: int, head_dim: int) -> "_Tensor":
        """vLLM's V cache (num_blocks, kvh, hd, block), a box per cache block (box_rows 16:
        16 tokens; 8: blocks of 8). 16: (16 tokens, dim, 16-token group, KV head, cache
        block) with 32-byte swizzle, a box landing as a dim's 16 tokens per 32-byte row. 8:
        (8 dims x 8 tokens, 8-dim group, 1, KV head, cache block), no swizzle: a box lands
        as [dim][8 tokens], 128-byte core matrices."""
        nb, nkv, hs, bs = v.shape
        sb, sh, sd, _ = v.strides
        if box_rows == 16:
            return cls((16, hs, bs // 16, nkv, nb),
                       _length_one_free(((sd, hs), (32, bs // 16), (sh, nkv), (sb, nb))),
                       (16, head_dim, 1, 1, 1), SWIZZLE_32B)
        return cls((64, hs // 8, 1, nkv, nb),
                   _length_one_free(((8 * sd, hs // 8), (16, 1), (sh, nkv), (sb, nb))),
                   (64, head_dim // 8, 1, 1, 1), SWIZZLE_NONE)

    @functools.cached_property
    def c_arrays(self) -> tuple:
        """dims, strides, box and element strides as the driver call takes them."""
        c, n = ctypes, len(self.dims)
        return ((c.c_uint64 * n)(*self.dims), (c.c_uint64 * (n - 1))(*self.strides),
                (c.c_uint32 * n)(*self.box), (c.c_uint32 * n)(*([1] * n)))


class FlashMaps:
    """A plan's launch arguments for the TMA form: ``maps(ptrs)`` -> (FlashTmaMaps bytes,
    FlashSm90Schedule) for the pointers in slots ``slots`` (q, k, v) of the call's pointer
    list, and the tile counter's in slot ``counter_slot`` (varlen calls; None: no counter).
    kv (cuattn.constants KV_*): k and v are dense, or paged caches (NHD, vLLM's); head_dim:
    the kernel's (vLLM's maps box whole compiled rows)."""

    def __init__(self, dtype_short: str, q, k, v, slots: tuple[int, int, int], block_n: int,
                 counter_slot: int | None = None, kv: int = KV_DENSE, head_dim: int = 0):
        self.data_type = dtype_short
        if kv == KV_PAGED_VLLM:
            self.tensors = _vllm_tensors(q, k, v, block_n, head_dim)
        else:
            rows = paged_box_rows(block_n, k.shape[1]) if kv == KV_PAGED_NHD else block_n
            self.tensors = (_Tensor.of(q, 64), _Tensor.of(k, rows), _Tensor.of(v, rows))
        self.slots = slots
        self.counter_slot = counter_slot
        self._kept: dict[tuple, tuple] = {}

    def __call__(self, ptrs: list) -> tuple:
        key = (ptrs[self.slots[0]], ptrs[self.slots[1]], ptrs[self.slots[2]])
        args = self._kept.get(key) or self._encode(key)
        if self.counter_slot is None:
            return args
        return args[0], np.uint64(ptrs[self.counter_slot])   # (the counter: per call scratch)

    def _encode(self, key: tuple[int, int, int]) -> tuple:
        if len(self._kept) >= _KEEP:
            self._kept.clear()
        blob = b"".join(encode(self.data_type, p, t) for p, t in zip(key, self.tensors))
        args = self._kept[key] = (np.frombuffer(blob, MAPS_DTYPE)[0], NO_SCHEDULE)
        return args


_encode_tiled = None


def _driver_encode():
    """cuTensorMapEncodeTiled of the driver CuPy has loaded, called through ctypes (the first
    use of cuda.bindings' driver module probes entry points the driver may lack, which
    compute-sanitizer reports as API errors: 34 on the H200's driver)."""
    global _encode_tiled
    if _encode_tiled is None:
        c = ctypes
        lib = c.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = c.c_int
        fn.argtypes = [c.c_void_p, c.c_int, c.c_uint32, c.c_void_p, c.POINTER(c.c_uint64),
                       c.POINTER(c.c_uint64), c.POINTER(c.c_uint32), c.POINTER(c.c_uint32),
                       c.c_int, c.c_int, c.c_int, c.c_int]
        _encode_tiled = fn
    return _encode_tiled


def encode(dtype_short: str, ptr: int, t: _Tensor) -> bytes:
    """The 128 bytes of one tensor map (a RuntimeError naming the driver's error code)."""
    c = ctypes
    buf = c.create_string_buffer(MAP_BYTES + 64)
    at = (c.addressof(buf) + 63) & ~63           # the driver writes a 64-byte-aligned map
    err = _driver_encode()(at, DATA_TYPE[dtype_short], len(t.dims), ptr, *t.c_arrays,
                           INTERLEAVE_NONE, t.swizzle, L2_PROMOTION_256B, OOB_FILL_ZERO)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for dims "
                           f"{t.dims}, strides {t.strides}, box {t.box}")
    return c.string_at(at, MAP_BYTES)
