"""flash_forward / flash_varlen_forward: the FlashAttention-2 forward pass.

Kernel: cuda_src/flash_fwd.cuh (one template; the variant key instantiates exactly one
configuration). The head dim is compiled rounded up to a multiple of 32 and the tail
columns are zero-filled on load and never stored. Split-KV (``num_splits``) writes fp32
partial outputs into scratch and merges them with the combine kernel of the same header.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import cupy
import numpy as np

from . import _arrays as A
from . import tuning
from ._dtypes import BY_SHORT, activation_dtype
from .jit import ParamsStruct, Variant, arch_of_device, get_kernel

PARAMS = ParamsStruct("FlashFwdParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("lse", "ptr"),
    ("oaccum", "ptr"), ("lseaccum", "ptr"), ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"),
    ("q_stride_batch", "i64"), ("q_stride_row", "i64"), ("q_stride_head", "i64"),
    ("k_stride_batch", "i64"), ("k_stride_row", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_row", "i64"), ("v_stride_head", "i64"),
    ("o_stride_batch", "i64"), ("o_stride_row", "i64"), ("o_stride_head", "i64"),
    ("lse_stride_batch", "i64"), ("lse_stride_head", "i64"), ("lse_stride_row", "i64"),
    ("batch", "i32"), ("num_heads", "i32"), ("head_group", "i32"), ("seqlen_q", "i32"),
    ("seqlen_k", "i32"), ("total_q", "i32"), ("head_dim", "i32"), ("window_left", "i32"),
    ("window_right", "i32"), ("num_splits", "i32"),
    ("scale_log2", "f32"),
])

MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535
_INT32_MAX = 2**31 - 1
_MAX_SEQLEN = 2**29     # keeps every band bound of the kernel inside int32


def compiled_head_dim(head_dim: int) -> int:
    """The head dim a kernel is compiled for: the real one rounded up to a multiple of 32."""
    return max(32, -(-head_dim // 32) * 32)


@dataclass(frozen=True)
class FlashFwdVariant(Variant):
    dtype: str            # f16 / bf16
    head_dim: int         # compiled head dim (a multiple of 32)
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    causal: bool          # bottom-right causal band (right edge only)
    window: bool          # general (left, right) band from the params
    split: bool           # write fp32 partials for the split-KV combine
    # Performance knobs (tuning.FlashTiles; the defaults are the first measured kernel and
    # leave the symbol unchanged). See the kernel's comment in cuda_src/flash_fwd.cuh.
    q_smem: int = 0       # 1: Q re-read from smem every k16 step (32 rows per warp fit);
                          # 2: and compact ldmatrix offsets
    kv_split: bool = False  # K and V in separate cp.async groups, one more barrier
    softmax: int = 0      # bit 0: branch-free rescale of O; bit 1: P packed right after exp

    op: ClassVar[str] = "flash_fwd"
    header: ClassVar[str] = "flash_fwd.cuh"
    kernel_template: ClassVar[str] = "flash_fwd_kernel"
    params: ClassVar[ParamsStruct] = PARAMS

    def __post_init__(self):
        if self.causal and self.window:
            raise ValueError("FlashFwdVariant: causal with a window is spelled as a window")
        if self.softmax not in (0, 1, 2, 3) or self.q_smem not in (0, 1, 2):
            raise ValueError(f"FlashFwdVariant: softmax is 0 to 3 (got {self.softmax}), "
                             f"q_smem 0 to 2 (got {self.q_smem})")

    def name_parts(self):
        mask = "win" if self.window else ("c1" if self.causal else "c0")
        parts = (self.dtype, f"hd{self.head_dim}", f"bm{self.block_m}", f"bn{self.block_n}",
                 f"w{self.num_warps}", f"st{self.stages}", mask)
        qs = {0: (), 1: ("qs",)}.get(self.q_smem, (f"qs{self.q_smem}",))
        knobs = qs + (("kvs",) if self.kv_split else ()) + \
            ((f"sm{self.softmax}",) if self.softmax else ())
        return parts + knobs + (("split",) if self.split else ())

    def template_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.block_m, self.block_n,
                self.num_warps, self.stages, self.causal, self.window, self.split,
                int(self.q_smem), self.kv_split, self.softmax)

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def dynamic_smem_bytes(self) -> int:
        # FlashFwdTraits::SMEM_BYTES: Q tile + STAGES x (K tile + V tile), 2-byte elements.
        return 2 * self.head_dim * (self.block_m + 2 * self.stages * self.block_n)


@dataclass(frozen=True)
class FlashCombineVariant(Variant):
    dtype: str
    head_dim: int         # compiled head dim (bounds the per-lane column passes)
    num_threads: int = tuning.FLASH_COMBINE_NUM_THREADS

    op: ClassVar[str] = "flash_combine"
    header: ClassVar[str] = "flash_fwd.cuh"
    kernel_template: ClassVar[str] = "flash_fwd_combine_kernel"
    params: ClassVar[ParamsStruct] = PARAMS

    def name_parts(self):
        return (self.dtype, f"hd{self.head_dim}", f"t{self.num_threads}")

    def template_args(self):
        return (BY_SHORT[self.dtype].cpp, self.head_dim, self.num_threads)


def forward_variant(dtype: str, head_dim: int, *, causal: bool, window: bool, split: bool,
                    arch: str) -> FlashFwdVariant:
    """The forward variant for a real head dim, flags and an architecture (tuning table)."""
    hd = compiled_head_dim(head_dim)
    t = tuning.flash_tiles(arch, hd, masked=causal or window or split)
    return FlashFwdVariant(dtype, hd, t.block_m, t.block_n, t.num_warps, t.stages,
                           causal, window, split, q_smem=int(t.q_smem),
                           kv_split=bool(t.kv_split), softmax=int(t.softmax))


def shipped_variants(arch: str | None = None) -> list[Variant]:
    """dtypes x tuned head dims x {non-causal, causal}, and the split-KV combine kernels.

    ``arch=None`` (what ``precompile`` uses, for any architecture): the union of the tile
    choices of every architecture family, so a precompiled cache serves the tiles the
    tuning table picks on sm_80, sm_86/89 and sm_90. Windows and split forward kernels
    compile on first use.
    """
    archs = [arch] if arch is not None else ["sm_90", "sm_86"]   # one per tuning table
    out: dict[Variant, None] = {}
    for dt in ("f16", "bf16"):
        for hd in tuning.FLASH_SHIPPED_HEAD_DIMS:
            for a in archs:
                for causal in (False, True):
                    out[forward_variant(dt, hd, causal=causal, window=False, split=False,
                                        arch=a)] = None
            out[FlashCombineVariant(dt, compiled_head_dim(hd))] = None
    return list(out)


# ---- argument checks ---------------------------------------------------------------------

def _check_qkv(q, k, v, ndim: int, doc_q: str, doc_kv: str):
    q = A.as_device_array(q, "q")
    k = A.as_device_array(k, "k")
    v = A.as_device_array(v, "v")
    A.check_ndim(q, ndim, "q", doc_q)
    A.check_ndim(k, ndim, "k", doc_kv)
    A.check_ndim(v, ndim, "v", doc_kv)
    dtype = activation_dtype(q.dtype, "q")
    A.check_dtype(k, q.dtype, "k")
    A.check_dtype(v, q.dtype, "v")
    head_dim = q.shape[-1]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {head_dim} is not supported; expected a multiple of 8 "
                         f"from 8 to {MAX_HEAD_DIM}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)} {doc_kv}, "
                         f"got {tuple(v.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {head_dim}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads < 1:
        raise ValueError(f"q: expected at least one head {doc_q}, got shape {tuple(q.shape)}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"k: nheads_kv = {nheads_kv} must divide nheads = {nheads} "
                         "(query head h reads kv head h // (nheads // nheads_kv))")
    for name, x in (("q", q), ("k", k), ("v", v)):
        A.check_last_dim_contiguous(x, name)
        A.check_aligned(x, 16, name)
    device_id = q.device.id
    A.check_same_device({"k": k, "v": v}, device_id)
    return q, k, v, dtype


def _check_options(causal, softmax_scale, window_size, num_splits, head_dim):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    softmax_scale = A.check_softmax_scale(softmax_scale, head_dim)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        left = right = None
    if not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in (left, right)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got "
                        f"{window_size!r}")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each side is -1 (unbounded) or >= 0, got {window_size}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits: expected an int, got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits: expected 0 (automatic) or >= 1, got {num_splits}")
    if causal:
        right = 0      # causal = window (left, 0)
    return softmax_scale, left, right, int(num_splits)


def _check_out(out, shape, dtype, doc):
    out = A.as_device_array(out, "out")
    A.check_shape(out, shape, "out", doc)
    A.check_dtype(out, dtype, "out")
    A.check_last_dim_contiguous(out, "out")
    A.check_aligned(out, 16, "out")
    return out


def _check_cu_seqlens(x, name, batch_plus_1=None):
    x = A.as_device_array(x, name)
    A.check_ndim(x, 1, name, "(batch + 1,)")
    A.check_dtype(x, np.int32, name)
    if x.shape[0] < 1:
        raise ValueError(f"{name}: expected at least one entry (batch + 1,), got shape {x.shape}")
    if batch_plus_1 is not None and x.shape[0] != batch_plus_1:
        raise ValueError(f"{name}: expected shape ({batch_plus_1},) like cu_seqlens_q, "
                         f"got {tuple(x.shape)}")
    if x.strides[0] != 4:
        raise ValueError(f"{name}: must be contiguous, got strides {x.strides}")
    A.check_aligned(x, 4, name)
    return x


@functools.cache
def _arch(device_id: int) -> str:
    return arch_of_device(device_id)


@functools.cache
def _sm_count(device_id: int) -> int:
    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


@functools.cache
def _smem_per_sm(device_id: int) -> int:
    try:
        return cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerMultiprocessor"]
    except KeyError:
        return 100 * 1024


def choose_num_splits(blocks: int, n_key_tiles: int, num_sms: int, blocks_per_sm: int) -> int:
    """num_splits=0: the most splits that keep the grid within one wave of resident blocks
    (a partial extra wave costs a whole one: tuning.py has the measurement), each split
    keeping at least FLASH_MIN_TILES_PER_SPLIT key tiles."""
    slots = num_sms * max(1, blocks_per_sm)
    if blocks <= 0:
        return 1
    by_fill = slots // blocks
    by_length = n_key_tiles // tuning.FLASH_MIN_TILES_PER_SPLIT
    return max(1, min(by_fill, by_length, tuning.FLASH_MAX_SPLITS))


def _window_params(left, right, max_sq, max_sk):
    """Window bounds for the kernel: -1 (unbounded) becomes a value no row can reach."""
    unbounded = max_sq + max_sk + 1
    left = unbounded if left < 0 or left > unbounded else left
    right = unbounded if right < 0 or right > unbounded else right
    return left, right


def _run(*, q, k, v, out, lse, dtype, device_id, stream, causal, softmax_scale, left, right,
         num_splits, batch, max_sq, max_sk, total_q, cu_q, cu_k, strides):
    """Pick the variant, size the grid, launch (and combine). Arguments already checked."""
    nheads, head_dim = q.shape[-2], q.shape[-1]
    head_group = nheads // k.shape[-2]
    # causal alone = the causal variant; causal with a left bound, or any bound = a window
    is_causal = causal and left < 0
    window = not is_causal and (left >= 0 or right >= 0)
    if batch > _MAX_GRID_YZ or nheads > _MAX_GRID_YZ:
        raise ValueError(f"q: batch {batch} and nheads {nheads} must each be <= {_MAX_GRID_YZ}")
    arch = _arch(device_id)
    base = forward_variant(dtype.short, head_dim, causal=is_causal, window=window,
                           split=False, arch=arch)
    m_blocks = -(-max_sq // base.block_m)
    if m_blocks == 0 or nheads == 0 or batch == 0:
        return
    n_key_tiles = -(-max_sk // base.block_n)
    if num_splits == 0:
        # Resident blocks per SM: shared memory, and registers (the kernels use ~230-255
        # registers per thread, so count 255).
        per_sm = max(1, min(_smem_per_sm(device_id) // max(base.dynamic_smem_bytes, 1),
                            65536 // (255 * base.num_threads)))
        num_splits = choose_num_splits(batch * nheads * m_blocks, n_key_tiles,
                                       _sm_count(device_id), per_sm)
    num_splits = max(1, min(num_splits, max(n_key_tiles, 1), _MAX_GRID_YZ // batch))
    wl, wr = _window_params(left, right, max_sq, max_sk)
    split = num_splits > 1
    variant = base
    if split:
        # Split-KV kernels take the tiles of the masked table (see tuning.flash_tiles);
        # the grid follows their BLOCK_M.
        variant = forward_variant(dtype.short, head_dim, causal=is_causal, window=window,
                                  split=True, arch=arch)
        m_blocks = -(-max_sq // variant.block_m)
    fields = dict(strides)
    oaccum = lseaccum = None
    if split:
        oaccum = cupy.empty((num_splits, total_q, nheads, head_dim), dtype=np.float32)
        lseaccum = cupy.empty((num_splits, nheads, total_q), dtype=np.float32)
        A.keep_if_capturing(stream, oaccum, lseaccum)
    params = PARAMS.pack(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out=out.data.ptr,
        lse=0 if lse is None else lse.data.ptr,
        oaccum=0 if oaccum is None else oaccum.data.ptr,
        lseaccum=0 if lseaccum is None else lseaccum.data.ptr,
        cu_seqlens_q=0 if cu_q is None else cu_q.data.ptr,
        cu_seqlens_k=0 if cu_k is None else cu_k.data.ptr,
        batch=batch, num_heads=nheads, head_group=head_group, seqlen_q=fields.pop("seqlen_q"),
        seqlen_k=fields.pop("seqlen_k"), total_q=total_q, head_dim=head_dim,
        window_left=wl, window_right=wr, num_splits=num_splits,
        scale_log2=softmax_scale * A.LOG2E, **fields)
    kernel = get_kernel(variant, device_id)
    grid = (m_blocks, nheads, batch * num_splits)
    kernel(grid, (variant.num_threads,), (params,), stream=stream,
           shared_mem=variant.dynamic_smem_bytes)
    if split and total_q * nheads > 0:
        combine = FlashCombineVariant(dtype.short, compiled_head_dim(head_dim))
        rows_per_block = combine.num_threads // 32
        grid = (-(-total_q * nheads // rows_per_block),)
        get_kernel(combine, device_id)(grid, (combine.num_threads,), (params,), stream=stream)


def _result(out, lse, return_lse):
    return (out, lse) if return_lse else out


def flash_forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  return_lse=False, num_splits=0, out=None, stream=None):
    """FlashAttention-2 forward.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    float16 or bfloat16, any strides with a contiguous last dim. Causal is aligned to the
    bottom-right corner; ``window_size=(left, right)`` limits query i to keys
    i + sk - sq - left <= j <= i + sk - sq + right (-1 = unbounded). Returns out (like q)
    or (out, lse) with lse float32 (batch, nheads, seqlen_q), natural log; a row that sees
    no key gives zeros and lse = -inf.
    """
    doc_q = "(batch, seqlen_q, nheads, headdim)"
    doc_kv = "(batch, seqlen_k, nheads_kv, headdim)"
    q, k, v, dtype = _check_qkv(q, k, v, 4, doc_q, doc_kv)
    batch, sq, nheads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k: batch {k.shape[0]} differs from q's {batch}")
    sk = k.shape[1]
    if max(sq, sk) >= _MAX_SEQLEN or batch * sq > _INT32_MAX:
        raise ValueError(f"q: sequence lengths ({sq}, {sk}) must be < 2**29 and batch x "
                         "seqlen_q must fit in int32")
    softmax_scale, left, right, num_splits = _check_options(causal, softmax_scale, window_size,
                                                            num_splits, head_dim)
    device_id = q.device.id
    stream = A.resolve_stream(stream)
    # Allocations are made on the launch stream: CuPy's pool recycles a freed block on the
    # stream it was allocated on, which must be the stream that uses it.
    with cupy.cuda.Device(device_id), stream:
        if out is None:
            out = cupy.empty((batch, sq, nheads, head_dim), dtype=q.dtype)
        else:
            out = _check_out(out, (batch, sq, nheads, head_dim), q.dtype, doc_q)
            A.check_same_device({"out": out}, device_id)
        lse = cupy.empty((batch, nheads, sq), dtype=np.float32) if return_lse else None
        qs, ks, vs, os_ = (A.element_strides(x) for x in (q, k, v, out))
        ls = A.element_strides(lse) if lse is not None else (0, 0, 0)
        strides = dict(
            q_stride_batch=qs[0], q_stride_row=qs[1], q_stride_head=qs[2],
            k_stride_batch=ks[0], k_stride_row=ks[1], k_stride_head=ks[2],
            v_stride_batch=vs[0], v_stride_row=vs[1], v_stride_head=vs[2],
            o_stride_batch=os_[0], o_stride_row=os_[1], o_stride_head=os_[2],
            lse_stride_batch=ls[0], lse_stride_head=ls[1], lse_stride_row=ls[2],
            seqlen_q=sq, seqlen_k=sk)
        _run(q=q, k=k, v=v, out=out, lse=lse, dtype=dtype, device_id=device_id, stream=stream,
             causal=bool(causal), softmax_scale=softmax_scale, left=left, right=right,
             num_splits=num_splits, batch=batch, max_sq=sq, max_sk=sk, total_q=batch * sq,
             cu_q=None, cu_k=None, strides=strides)
    return _result(out, lse, return_lse)


def flash_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal=False, softmax_scale=None, window_size=(-1, -1),
                         return_lse=False, num_splits=0, out=None, stream=None):
    """FlashAttention-2 forward over packed variable-length sequences.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); cu_seqlens_q/k:
    int32 (batch + 1,) prefix sums on the device (not read by the host: max_seqlen_q/k must
    bound every length); lse: float32 (nheads, total_q). Same options as flash_forward;
    a sequence of length 0 is allowed.
    """
    doc_q = "(total_q, nheads, headdim)"
    doc_kv = "(total_k, nheads_kv, headdim)"
    q, k, v, dtype = _check_qkv(q, k, v, 3, doc_q, doc_kv)
    total_q, nheads, head_dim = q.shape
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", cu_q.shape[0])
    batch = cu_q.shape[0] - 1
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(val).__name__}")
        if val < 0 or val >= _MAX_SEQLEN:
            raise ValueError(f"{name}: expected 0 <= {name} < 2**29, got {val}")
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if total_q > _INT32_MAX or k.shape[0] > _INT32_MAX:
        raise ValueError(f"q: total_q {total_q} must fit in int32")
    softmax_scale, left, right, num_splits = _check_options(causal, softmax_scale, window_size,
                                                            num_splits, head_dim)
    device_id = q.device.id
    A.check_same_device({"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, device_id)
    stream = A.resolve_stream(stream)
    # Allocations are made on the launch stream: CuPy's pool recycles a freed block on the
    # stream it was allocated on, which must be the stream that uses it.
    with cupy.cuda.Device(device_id), stream:
        if out is None:
            out = cupy.empty((total_q, nheads, head_dim), dtype=q.dtype)
        else:
            out = _check_out(out, (total_q, nheads, head_dim), q.dtype, doc_q)
            A.check_same_device({"out": out}, device_id)
        lse = cupy.empty((nheads, total_q), dtype=np.float32) if return_lse else None
        qs, ks, vs, os_ = (A.element_strides(x) for x in (q, k, v, out))
        ls = A.element_strides(lse) if lse is not None else (0, 0)
        strides = dict(
            q_stride_batch=0, q_stride_row=qs[0], q_stride_head=qs[1],
            k_stride_batch=0, k_stride_row=ks[0], k_stride_head=ks[1],
            v_stride_batch=0, v_stride_row=vs[0], v_stride_head=vs[1],
            o_stride_batch=0, o_stride_row=os_[0], o_stride_head=os_[1],
            lse_stride_batch=0, lse_stride_head=ls[0], lse_stride_row=ls[1],
            seqlen_q=max(total_q, 1), seqlen_k=0)
        # Rows never covered by a sequence (past cu_seqlens_q[-1]) are not written.
        _run(q=q, k=k, v=v, out=out, lse=lse, dtype=dtype, device_id=device_id, stream=stream,
             causal=bool(causal), softmax_scale=softmax_scale, left=left, right=right,
             num_splits=num_splits, batch=batch, max_sq=max_seqlen_q, max_sk=max_seqlen_k,
             total_q=total_q, cu_q=cu_q, cu_k=cu_k, strides=strides)
    return _result(out, lse, return_lse)
