"""The argument checks the ops share (the flash forward and backward, flash_with_kvcache,
paged_prefill, block_tables_from_flashinfer), and the adapters' checks that must run
before the core is reached (cuattn.jax at trace time, cuattn.torch's fake tensors): one
helper per rule, so that an error reads the same wherever it is raised. Each raises a
ValueError / TypeError naming the argument.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import _tma
from ._dtypes import BY_SHORT, FP8_E4M3, UINT8_E4M3, activation_dtype
from .constants import SM90_ARCH
from .jit import device_info

MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535
INT32_MAX = 2**31 - 1
MAX_SEQLEN = 2**29      # keeps every band bound of the kernel inside int32
DESCALES = ("q_descale", "k_descale", "v_descale")


def check_head_dim(head_dim: int, fp8: bool) -> None:
    """q's head dim: a multiple of 8 (FP8: of 16, whole 16-byte rows) up to MAX_HEAD_DIM."""
    unit = 16 if fp8 else 8
    if head_dim % unit or not unit <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim {head_dim} is not supported; expected a multiple of "
                         f"{unit} from {unit} to {MAX_HEAD_DIM}" +
                         (" (float8_e4m3fn: 16-byte rows)" if fp8 else ""))


def check_qkv(q, k, v, ndim: int, doc_q: str, doc_kv: str, fp8: bool = False):
    """q, k, v of one dtype: 16-bit, or (fp8: the forward) float8_e4m3fn."""
    A.check_ndim(q, ndim, "q", doc_q)
    A.check_ndim(k, ndim, "k", doc_kv)
    A.check_ndim(v, ndim, "v", doc_kv)
    is_fp8 = fp8 and q.dtype in (FP8_E4M3.numpy, UINT8_E4M3.numpy)
    if is_fp8:
        dtype = FP8_E4M3
    elif fp8 and q.dtype not in (np.float16, BY_SHORT["bf16"].numpy):
        raise TypeError(f"q: dtype {q.dtype} is not supported; expected float16, "
                        "ml_dtypes.bfloat16 or ml_dtypes.float8_e4m3fn (or uint8 bytes "
                        "holding e4m3 values)")
    else:
        dtype = activation_dtype(q.dtype, "q")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} like q (no mixing of fp8 and "
                            f"16-bit inputs), got {x.dtype}" if fp8 else
                            f"{name}: expected dtype {q.dtype}, got {x.dtype}")
    head_dim = q.shape[-1]
    check_head_dim(head_dim, is_fp8)
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
    A.check_same_device({"k": k, "v": v}, q.device.id)
    return dtype


def check_options(causal, softmax_scale, window_size, num_splits, return_lse, head_dim):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    softmax_scale = A.check_softmax_scale(softmax_scale, head_dim)
    left, right = A.check_window(window_size)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits: expected an int, got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits: expected 0 (automatic) or >= 1, got {num_splits}")
    if causal:
        right = 0      # causal = window (left, 0)
    return softmax_scale, left, right, int(num_splits), bool(return_lse)


def check_cu_seqlens(x, name, batch_plus_1=None):
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


def check_fixed_lengths(q, k) -> int:
    """The fixed-length calls' batch and sequence lengths (q and k 4-d); -> seqlen_k."""
    batch, sq = q.shape[0], q.shape[1]
    if k.shape[0] != batch:
        raise ValueError(f"k: batch {k.shape[0]} differs from q's {batch}")
    sk = k.shape[1]
    if max(sq, sk) >= MAX_SEQLEN or batch * sq > INT32_MAX:
        raise ValueError(f"q: sequence lengths ({sq}, {sk}) must be < 2**29 and batch x "
                         "seqlen_q must fit in int32")
    return sk


def check_max_seqlen(val, name: str) -> int:
    """A varlen call's bound on its sequences' lengths: an int, 0 <= n < 2**29."""
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(val).__name__}")
    if val < 0 or val >= MAX_SEQLEN:
        raise ValueError(f"{name}: expected 0 <= {name} < 2**29, got {val}")
    return int(val)


def check_max_seqlens(max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """The varlen calls' bounds (check_max_seqlen), q's then k's."""
    return (check_max_seqlen(max_seqlen_q, "max_seqlen_q"),
            check_max_seqlen(max_seqlen_k, "max_seqlen_k"))


def _dtype_or_none(x):
    """np.dtype(x), or None for what names no dtype."""
    try:
        return np.dtype(x)
    except TypeError:
        return None


def check_fp8(dtype, out_dtype, descales, batch: int, nheads_kv: int, device_id: int,
               qkv) -> tuple:
    """An FP8 call's output dtype, descale fields and arguments (16-bit calls: their own
    dtype, no descale); every bad option a ValueError / TypeError naming it."""
    fp8 = dtype is FP8_E4M3
    fields = {}
    if not fp8:
        for name, d in zip(DESCALES, descales):
            if d is not None:
                raise ValueError(f"{name}: only for float8_e4m3fn q / k / v, got {dtype.numpy}")
        if out_dtype is not None and _dtype_or_none(out_dtype) != dtype.numpy:
            raise ValueError(f"out_dtype: a {dtype.numpy} call writes {dtype.numpy}, got "
                             f"{out_dtype!r}")
        return dtype, fields
    try:
        out = BY_SHORT["bf16"] if out_dtype is None else activation_dtype(out_dtype, "out_dtype")
    except TypeError:
        raise ValueError(f"out_dtype: an FP8 call writes float16 or ml_dtypes.bfloat16, got "
                         f"{out_dtype}") from None
    for name, d in zip(DESCALES, descales):
        stride = (0, 0)
        if d is not None:
            A.check_ndim(d, 2, name, "(batch, nheads_kv)")
            A.check_shape(d, (batch, nheads_kv), name, "(batch, nheads_kv)")
            A.check_dtype(d, np.float32, name)
            A.check_same_device({name: d}, device_id)
            A.check_aligned(d, 4, name)
            stride = A.element_strides(d)
        fields[f"{name}_stride_batch"], fields[f"{name}_stride_head"] = stride
    device = device_info(device_id)
    if device.arch != SM90_ARCH:
        raise ValueError(f"q: float8_e4m3fn inputs run on Hopper (sm_90) GPUs only; this "
                         f"device is {device.arch}")
    for name, x in zip(("q", "k", "v"), qkv):   # (the driver's own check: _plan's encodable)
        if x.size and not _tma.fits(x):
            raise ValueError(f"{name}: float8_e4m3fn inputs are loaded by TMA, which needs "
                             f"positive strides, multiples of 16 bytes, below 2**40; got "
                             f"{x.strides}")
    return out, fields


# ---- before the core is reached: the adapters' own checks ----------------------------------
# cuattn.jax checks at trace time (a callback's error would surface late, as XLA's), and
# cuattn.torch before its custom op (whose fake implementation never reaches the core);
# both on their framework's arrays, whose dtypes they pass in.

def check_input_dtypes(q, k, v, allowed: tuple) -> None:
    """q of one of ``allowed`` (the framework's float16, bfloat16, float8_e4m3fn); k and v
    of q's dtype."""
    if q.dtype not in allowed:
        raise TypeError(f"q: expected dtype float16, bfloat16 or float8_e4m3fn, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {q.dtype} (no mixing of FP8 and "
                            f"16-bit inputs), got {x.dtype}")


def check_descale_arrays(descales, dtype, fp8: bool, is_float32, kind: str, batch: int,
                         nheads_kv: int) -> None:
    """FlashAttention-3's descales (q_descale, k_descale, v_descale; None: absent): FP8 calls
    only (``fp8``: q's ``dtype`` is float8_e4m3fn), float32 ``kind`` arrays (is_float32(d))
    of shape (batch, nheads_kv)."""
    for name, d in zip(DESCALES, descales):
        if d is None:
            continue
        if not fp8:
            raise ValueError(f"{name}: only for float8_e4m3fn q / k / v, got {dtype}")
        if not is_float32(d):
            raise TypeError(f"{name}: expected a float32 {kind} of shape (batch, nheads_kv), "
                            f"got {getattr(d, 'dtype', type(d).__name__)}")
        if tuple(d.shape) != (batch, nheads_kv):
            raise ValueError(f"{name}: expected shape {(batch, nheads_kv)} (batch, nheads_kv), "
                             f"got {tuple(d.shape)}")
