"""TMA tensor maps of a flash call (cuda_src/flash_fwd_sm90.cuh's FlashTmaMaps).

Q, K and V are each described as a 4-d tensor (head dim, row, head, batch) with the call's
strides (varlen's packed (total, heads, head dim) arrays as batch 1; a paged NHD cache
(num_blocks, block_size, heads, head dim) as (head dim, slot, head, cache block)), 128-byte
swizzle and zero fill out of bounds: the Hopper kernel's producer copies a 64-column block
of a tile (paged: of the tile's keys in one cache block, paged_box_rows) by one
``cp.async.bulk.tensor``. A tensor map holds its tensor's address, so the maps are
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


_COLS = 64                           # a 128-byte swizzle row: 64 16-bit columns per box
_MAX_STRIDE = 1 << 40
_KEEP = 16                           # pointer triples a plan keeps the maps of


def paged_box_rows(block_n: int, block_size: int) -> int:
    """The keys of one box of a paged map: the block size, at most the largest power of two
    dividing block_n (flash_fwd_sm90.cuh's Traits::box_rows)."""
    return min(block_n & -block_n, block_size)


def fits(x) -> bool:
    """Whether a tensor map can describe the ([batch,] rows, heads, head dim) array ``x``:
    the outer strides of its dimensions longer than one positive and below 2**40 bytes (the
    flash checks already made them multiples of 16)."""
    return all(0 < s < _MAX_STRIDE for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)


def encodable(dtype_short: str, arrays) -> bool:
    """Whether tensor maps describe every array of ``arrays``: fits(), and the driver takes
    its map (tried once per call signature, by the plan)."""
    if not all(fits(x) for x in arrays):
        return False
    try:
        for x in arrays:
            encode(dtype_short, x.data.ptr, _Tensor.of(x, 64))
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class _Tensor:
    """What a map of one array says, but its address: dims innermost first, byte strides of
    dims 1..3 and the box."""
    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int]
    box: tuple[int, int, int, int]

    @classmethod
    def of(cls, x, box_rows: int) -> "_Tensor":
        """The map of a (batch, rows, heads, head dim) or varlen (rows, heads, head dim) x."""
        b, s, h, d = x.shape if x.ndim == 4 else (1,) + x.shape
        sb, ss, sh, _ = x.strides if x.ndim == 4 else (0,) + x.strides
        # a dimension of length one is never stepped: any valid stride describes it
        stride = [st if n > 1 else 16 for st, n in ((ss, s), (sh, h), (sb, b))]
        return cls((d, max(s, 1), h, b), tuple(stride), (_COLS, box_rows, 1, 1))

    @functools.cached_property
    def c_arrays(self) -> tuple:
        """dims, strides, box and element strides as the driver call takes them."""
        c = ctypes
        return ((c.c_uint64 * 4)(*self.dims), (c.c_uint64 * 3)(*self.strides),
                (c.c_uint32 * 4)(*self.box), (c.c_uint32 * 4)(1, 1, 1, 1))


class FlashMaps:
    """A plan's launch arguments for the TMA form: ``maps(ptrs)`` -> (FlashTmaMaps bytes,
    FlashSm90Schedule) for the pointers in slots ``slots`` (q, k, v) of the call's pointer
    list, and the tile counter's in slot ``counter_slot`` (varlen calls; None: no counter).
    paged: k and v are paged NHD caches."""

    def __init__(self, dtype_short: str, q, k, v, slots: tuple[int, int, int], block_n: int,
                 counter_slot: int | None = None, paged: bool = False):
        self.data_type = dtype_short
        kv_rows = paged_box_rows(block_n, k.shape[1]) if paged else block_n
        self.tensors = (_Tensor.of(q, 64), _Tensor.of(k, kv_rows), _Tensor.of(v, kv_rows))
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


# cuda.h's enumerators for the maps above (tests/test_flash_sm90.py checks them against
# cuda.bindings.driver's).
DATA_TYPE = {"f16": 6, "bf16": 9}            # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO = 0, 3, 3, 0

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
    err = _driver_encode()(at, DATA_TYPE[dtype_short], 4, ptr, *t.c_arrays, INTERLEAVE_NONE,
                           SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZERO)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for dims "
                           f"{t.dims}, strides {t.strides}, box {t.box}")
    return c.string_at(at, MAP_BYTES)
