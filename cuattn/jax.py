"""cuattn.jax: FlashAttention with gradients inside JAX programs (jax.jit, jax.grad, jax.vmap).

``flash_attention`` and ``flash_attention_varlen`` are ``jax.custom_vjp`` functions whose
forward and backward run cuattn's kernels (flash_forward / flash_backward and their varlen
forms) inside the compiled program, through ``jax.experimental.buffer_callback``: XLA hands
a Python callback its own CUDA stream and device buffers, and cuattn writes its results
straight into XLA's output buffers (out, dq, dk, dv; lse and dsinks by one device copy).
The forward keeps (q, k, v, out, lse) for the backward. FP8 (FlashAttention-3's
conventions, forward only): q, k, v of float8_e4m3fn with optional float32 (batch,
nheads_kv) descales give a bfloat16 output; asking for their gradient is a TypeError when
the backward is traced. docs/api.md, "cuattn.jax", has the contract and the design (why
buffer_callback, command buffers, vmap).

Importing this module imports JAX; ``import cuattn`` alone never does.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

try:
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as exc:
    raise ImportError(
        'cuattn.jax needs JAX 0.6.1 or newer with CUDA: pip install "jax[cuda12]" '
        f"({exc})") from exc

import cupy
import numpy as np

import cuattn

from . import _arrays as A
from ._checks import DESCALES, check_descale_arrays, check_head_dim, check_input_dtypes
from ._hooks import check_softcap
from ._interop import copy_async, device_view, external_stream

__all__ = ["flash_attention", "flash_attention_varlen"]

# XLA may record a callback into its command buffers (CUDA graphs) once and replay the
# kernels without calling Python again; the callback then keeps every allocation it makes
# while being recorded (see _guarded). bench/lab/adapter_overhead.py times both settings.
_COMMAND_BUFFER = True
_DLPACK_CUDA = 2   # kDLCUDA
_FP8 = jnp.float8_e4m3fn


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False,
                    q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention-2 on JAX arrays, differentiable in q, k, v and sinks.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
    float16 or bfloat16, on a CUDA device; the options are cuattn.flash_forward's (causal
    aligned to the bottom-right corner; alibi_slopes float32 (nheads,) or (batch, nheads),
    sinks float32 (nheads,)).
    Returns out like q. Gradients: dq, dk, dv from cuattn.flash_backward (GQA: summed
    over each KV head's query heads); dsinks for sinks; alibi_slopes get zeros (as
    flash-attn, which does not differentiate them). ``deterministic`` orders the
    backward's dq reductions.

    Works eagerly and under jax.jit / jax.grad. jax.vmap adds leading axes: a call whose
    q, k, v are all mapped (and alibi_slopes / sinks not) runs as one call over the
    vmapped axes folded into the batch ((batch, nheads) slopes mapped with them fold
    alike); any other mix runs one cuattn call per mapped element, inside the same callback.

    FP8 (FlashAttention-3's, sm_90 GPUs): q, k, v all float8_e4m3fn (head dim a multiple of
    16), their real values the stored ones times q_descale / k_descale / v_descale (float32
    (batch, nheads_kv), None: 1); out is bfloat16. Forward only: differentiating an FP8
    call raises TypeError when its backward is traced.
    """
    _check_qkv(q, k, v, 4, "(batch, seqlen_q, nheads, headdim)",
               "(batch, seqlen_k, nheads_kv, headdim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch {k.shape[0]} differs from q's {q.shape[0]}")
    _check_head_vectors(alibi_slopes, sinks, q.shape[-2], q.shape[0])
    descales = (q_descale, k_descale, v_descale)
    _check_descales(q.dtype, descales, q.shape[0], k.shape[-2])
    spec = _spec(False, q, causal, softmax_scale, window_size, softcap, deterministic, 0, 0,
                 alibi_slopes)
    return _attention(spec, q, k, v, None, None, alibi_slopes, sinks, *descales)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           *, causal=False, softmax_scale=None, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False,
                           q_descale=None, k_descale=None, v_descale=None):
    """flash_attention over packed variable-length sequences (cuattn.flash_varlen_forward).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); cu_seqlens_q / _k:
    int32 (batch + 1,) prefix sums, on the device; max_seqlen_q / _k: Python ints that
    bound every length (static: they size the grid). Gradients flow to q, k, v and sinks;
    the cu_seqlens get none. Under jax.vmap every mapped element is its own call. FP8 as
    flash_attention (the descales (batch, nheads_kv), batch = len(cu_seqlens_q) - 1).
    """
    _check_qkv(q, k, v, 3, "(total_q, nheads, headdim)", "(total_k, nheads_kv, headdim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not hasattr(cu, "shape") or cu.dtype != jnp.int32 or len(cu.shape) != 1:
            raise TypeError(f"{name}: expected an int32 array of shape (batch + 1,), got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} "
                            f"{getattr(cu, 'shape', '')}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q "
                         f"{cu_seqlens_q.shape} (batch + 1,), got {cu_seqlens_k.shape}")
    _check_head_vectors(alibi_slopes, sinks, q.shape[-2], cu_seqlens_q.shape[0] - 1)
    descales = (q_descale, k_descale, v_descale)
    _check_descales(q.dtype, descales, cu_seqlens_q.shape[0] - 1, k.shape[-2])
    spec = _spec(True, q, causal, softmax_scale, window_size, softcap, deterministic,
                 _static_length(max_seqlen_q, "max_seqlen_q"),
                 _static_length(max_seqlen_k, "max_seqlen_k"), alibi_slopes)
    return _attention(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
                      *descales)


# ---- the differentiable function ------------------------------------------------------------

@dataclass(frozen=True)
class _Spec:
    """Everything static about a call: the custom_vjp's non-differentiable argument."""
    varlen: bool
    causal: bool
    softmax_scale: float
    window_size: tuple[int, int]
    softcap: float
    deterministic: bool
    max_seqlen_q: int
    max_seqlen_k: int
    command_buffer: bool
    alibi_rank: int             # alibi_slopes: 1 (nheads,), 2 (batch, nheads)

    @property
    def rank(self) -> int:
        """Dimensions of q (and k, v, out, their gradients) in one (unmapped) call."""
        return 3 if self.varlen else 4

    def options(self) -> dict:
        return dict(causal=self.causal, softmax_scale=self.softmax_scale,
                    window_size=self.window_size, softcap=self.softcap)


# The last three arguments are the FP8 descales (None for 16-bit calls); they get no gradient.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, q_descale,
               k_descale, v_descale):
    return _forward(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
                    (q_descale, k_descale, v_descale))[0]


def _attention_fwd(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, q_descale,
                   k_descale, v_descale):
    out, lse = _forward(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
                        (q_descale, k_descale, v_descale))
    return out, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)


def _attention_bwd(spec, residuals, dout):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = residuals
    if q.dtype == _FP8:
        raise TypeError(
            "cuattn.jax: float8_e4m3fn q / k / v have no gradient (the FP8 forward, like "
            "FlashAttention-3's, is forward-only); wrap FP8 inputs in jax.lax.stop_gradient, "
            "or take gradients through 16-bit calls")
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        shapes.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    call = buffer_callback(_backward_callback(spec), tuple(shapes), vmap_method="expand_dims",
                           command_buffer_compatible=spec.command_buffer)
    grads = call(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    dsinks = grads[3] if sinks is not None else None
    dalibi = None if alibi_slopes is None else jnp.zeros_like(alibi_slopes)
    return grads[0], grads[1], grads[2], None, None, dalibi, dsinks, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(spec, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, descales):
    """(out, lse): one buffer_callback running cuattn's forward (FP8: out bfloat16)."""
    if spec.varlen:
        lse_shape = (q.shape[1], q.shape[0])                  # (nheads, total_q)
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])      # (batch, nheads, seqlen_q)
    out_dtype = q.dtype
    if q.dtype == _FP8:
        # XLA's buffers give float8 no __cuda_array_interface__ typestr; their bytes as
        # uint8 have one, and cuattn reads uint8 q, k, v as e4m3 (a bitcast: no copy).
        out_dtype = jnp.bfloat16
        q, k, v = (jax.lax.bitcast_convert_type(x, jnp.uint8) for x in (q, k, v))
    shapes = (jax.ShapeDtypeStruct(q.shape, out_dtype),
              jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    call = buffer_callback(_forward_callback(spec), shapes, vmap_method="expand_dims",
                           command_buffer_compatible=spec.command_buffer)
    return call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, *descales)


# One callback object per spec: jax caches compiled programs by the callback's identity,
# so an eager call (no jax.jit) compiles once per spec and shapes, not once per call.
@functools.lru_cache(maxsize=None)
def _forward_callback(spec):
    return functools.partial(_run_forward, spec)


@functools.lru_cache(maxsize=None)
def _backward_callback(spec):
    return functools.partial(_run_backward, spec)


# ---- the callbacks (run by XLA, on its stream, with its buffers) ---------------------------

def _run_forward(spec, ctx, outputs, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks,
                 q_descale, k_descale, v_descale):
    device = _device_of(q)
    stream = _stream_of(ctx, device)
    r = spec.rank
    arrays = _views(device, (outputs[0], r), (outputs[1], r - 1), (q, r), (k, r), (v, r),
                    (cu_seqlens_q, 1), (cu_seqlens_k, 1), (alibi_slopes, spec.alibi_rank),
                    (sinks, 1), (q_descale, 2), (k_descale, 2), (v_descale, 2))
    options = spec.options()

    def work():
        for (out, lse, q, k, v, cu_q, cu_k, alibi, sink,
             *descales) in _calls(spec, arrays, fold=True):
            fp8 = dict(zip(DESCALES, descales))
            if spec.varlen:
                _, lse_new = cuattn.flash_varlen_forward(
                    q, k, v, cu_q, cu_k, spec.max_seqlen_q, spec.max_seqlen_k, **options,
                    alibi_slopes=alibi, sinks=sink, **fp8, return_lse=True, out=out,
                    stream=stream)
            else:
                _, lse_new = cuattn.flash_forward(
                    q, k, v, **options, alibi_slopes=alibi, sinks=sink, **fp8,
                    return_lse=True, out=out, stream=stream)
            _copy(lse, lse_new, stream)

    _guarded(stream, device, work)


def _run_backward(spec, ctx, outputs, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                  alibi_slopes, sinks):
    device = _device_of(q)
    stream = _stream_of(ctx, device)
    r = spec.rank
    dsinks = outputs[3] if sinks is not None else None
    arrays = _views(device, (outputs[0], r), (outputs[1], r), (outputs[2], r), (dsinks, 1),
                    (dout, r), (q, r), (k, r), (v, r), (out, r), (lse, r - 1),
                    (cu_seqlens_q, 1), (cu_seqlens_k, 1), (alibi_slopes, spec.alibi_rank),
                    (sinks, 1))
    options = spec.options()
    backward = _kernel("flash_varlen_backward" if spec.varlen else "flash_backward")

    def work():
        for (dq, dk, dv, dsink, dout, q, k, v, out, lse, cu_q, cu_k, alibi,
             sink) in _calls(spec, arrays, fold=sinks is None):
            lengths = ((cu_q, cu_k, spec.max_seqlen_q, spec.max_seqlen_k)
                       if spec.varlen else ())
            grads = backward(dout, q, k, v, out, lse, *lengths, **options,
                             alibi_slopes=alibi, sinks=sink,
                             deterministic=spec.deterministic, dq=dq, dk=dk, dv=dv,
                             stream=stream)
            if sink is not None:
                _copy(dsink, grads[3], stream)

    _guarded(stream, device, work)


def _device_of(buffer) -> int:
    kind, device = buffer.__dlpack_device__()
    if kind != _DLPACK_CUDA:
        raise TypeError("cuattn.jax: the arrays live on a JAX device that is not a CUDA GPU "
                        f"(DLPack device type {kind}); cuattn's kernels run on CUDA GPUs")
    return device


def _stream_of(ctx, device: int):
    return external_stream(ctx.stream, device)


def _view(buffer, device: int):
    """A CuPy view of an XLA buffer (XLA's buffers are dense, row-major)."""
    return device_view(buffer.__cuda_array_interface__["data"][0], buffer.shape,
                       buffer.dtype, device)


def _copy(dst, src, stream) -> None:
    copy_async(dst, src, stream)


def _views(device: int, *buffers) -> list:
    """[(view or None, rank of one unmapped call)] of the callback's (buffer, rank) pairs."""
    return [(None if b is None else _view(b, device), rank) for b, rank in buffers]


def _calls(spec, arrays: list, fold: bool):
    """The argument lists of the cuattn calls one callback makes, from ``arrays``' (view,
    rank of one unmapped call) pairs. Without jax.vmap: one call. vmap adds leading axes
    (vmap_method="expand_dims": an unmapped operand gets axes of size 1; outputs are always
    mapped). A dense call whose q, k, v, ... are mapped along every vmap axis and whose
    head vectors (alibi_slopes, sinks) are not folds those axes into the batch: one call
    (``fold``: the caller allows it; sinks' gradients differ per mapped element). Any other
    mix, and varlen, loops over the mapped elements, broadcasting the size-1 axes."""
    first, rank = arrays[0]
    lead = first.shape[:first.ndim - rank]
    if not lead:
        yield [x for x, _ in arrays]
        return
    n = len(lead)
    if fold and not spec.varlen and all(
            x.shape[:n] == lead if r > 1 else math.prod(x.shape[:n]) == 1
            for x, r in arrays if x is not None):
        yield [None if x is None else x.reshape((-1,) + x.shape[n + 1:]) if r > 1
               else x.reshape(x.shape[n:]) for x, r in arrays]
        return
    for index in np.ndindex(*lead):
        yield [None if x is None else x[tuple(i if m > 1 else 0 for i, m in zip(index, x.shape))]
               for x, _ in arrays]


def _guarded(stream, device: int, work) -> None:
    """Run ``work`` (cuattn calls on ``stream``) with ``device`` current; _recorded's way
    while XLA records the callback into a command buffer (the stream is capturing)."""
    with cupy.cuda.Device(device):
        if stream.is_capturing():
            _recorded(stream, work)
        else:
            work()


def _recorded(stream, work) -> None:
    """``work`` while its launches are recorded into a graph that will replay into
    whatever memory they allocate (lse and dsinks before their copies, scratch): every
    allocation made here is kept for the life of the process, as cuattn keeps the scratch
    of captured calls; and the thread's capture mode is relaxed meanwhile, so that a first
    call may compile and load its kernel, and the memory pool may grow."""
    from cuda.bindings import driver
    base = cupy.cuda.get_allocator()

    def keeping(nbytes):
        memory = base(nbytes)
        A.keep_if_capturing(stream, memory)
        return memory

    _, previous = driver.cuThreadExchangeStreamCaptureMode(
        driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        with cupy.cuda.using_allocator(keeping):
            work()
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


def _kernel(name: str):
    """cuattn's function ``name`` (the backward arrives with issue 33)."""
    try:
        return getattr(cuattn, name)
    except AttributeError:
        raise RuntimeError(f"cuattn.jax: this cuattn {cuattn.__version__} has no "
                           f"cuattn.{name}, which gradients need") from None


# ---- checks (at trace time: shapes, dtypes and options are static) --------------------------

def _check_qkv(q, k, v, ndim: int, doc_q: str, doc_kv: str) -> None:
    for name, x, doc in (("q", q, doc_q), ("k", k, doc_kv), ("v", v, doc_kv)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name}: expected a jax.Array, got {type(x).__name__}")
        if len(x.shape) != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions {doc}, got shape {x.shape}")
    check_input_dtypes(q, k, v, (jnp.float16, jnp.bfloat16, _FP8))
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    head_dim, nheads, nheads_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    check_head_dim(head_dim, q.dtype == _FP8)
    if k.shape[-1] != head_dim:
        raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {head_dim}")
    if nheads < 1 or nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"k: nheads_kv = {nheads_kv} must divide nheads = {nheads}")


def _check_head_vectors(alibi_slopes, sinks, nheads: int, batch: int) -> None:
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is None:
            continue
        if not hasattr(x, "dtype") or x.dtype != jnp.float32:
            raise TypeError(f"{name}: expected a float32 jax.Array of shape (nheads,), got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        shapes = ((nheads,), (batch, nheads)) if name == "alibi_slopes" else ((nheads,),)
        if tuple(x.shape) not in shapes:
            doc = "(nheads,) or (batch, nheads)" if len(shapes) > 1 else "(nheads,)"
            expected = " or ".join(str(s) for s in shapes)
            raise ValueError(f"{name}: expected shape {expected} {doc}, got {x.shape}")


def _check_descales(dtype, descales, batch: int, nheads_kv: int) -> None:
    """FlashAttention-3's descales: FP8 calls only, float32 arrays (batch, nheads_kv)."""
    check_descale_arrays(descales, dtype, dtype == _FP8, _is_float32, "jax.Array", batch,
                         nheads_kv)


def _is_float32(x) -> bool:
    return hasattr(x, "dtype") and x.dtype == jnp.float32


def _spec(varlen, q, causal, softmax_scale, window_size, softcap, deterministic,
          max_seqlen_q, max_seqlen_k, alibi_slopes) -> _Spec:
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    scale = A.check_softmax_scale(softmax_scale, q.shape[-1])
    window = A.check_window(window_size)
    # XLA must not record a callback that enqueues nothing (an empty CUDA graph).
    empty = 0 in q.shape or (varlen and 0 in (max_seqlen_q, max_seqlen_k))
    return _Spec(varlen, bool(causal), scale, window, check_softcap(softcap),
                 bool(deterministic), max_seqlen_q, max_seqlen_k,
                 _COMMAND_BUFFER and not empty,
                 1 if alibi_slopes is None else len(alibi_slopes.shape))


def _static_length(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected a Python int (static: it sizes the grid), got "
                        f"{type(value).__name__}")
    if not 0 <= value < 2**29:
        raise ValueError(f"{name}: expected 0 <= {name} < 2**29, got {value}")
    return int(value)
