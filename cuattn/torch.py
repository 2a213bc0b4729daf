"""cuattn.torch: flash-attn's flash_attn_func / flash_attn_varlen_func on cuattn's kernels.

Each is a pair of ``torch.library.custom_op``s (``cuattn::flash_fwd`` / ``cuattn::flash_bwd``
and their varlen forms) with a fake implementation and an autograd formula, so the same
call runs eagerly, under ``torch.compile`` and inside ``torch.cuda.CUDAGraph`` capture.
FP8 (FlashAttention-3's conventions, forward only): q, k, v of torch.float8_e4m3fn with
optional float32 (batch, nheads_kv) descales give a bfloat16 output through the same
forward ops; their backward is ``cuattn::flash_fp8_bwd``, which raises when it runs.
cuattn runs on torch's current stream; the outputs are torch tensors cuattn writes in
place (out=, dq=, dk=, dv=), and whatever cuattn allocates inside an op (lse before its
copy, scratch) comes from torch's caching allocator on that stream, so a captured graph's
memory lives in the graph's private pool like torch's own. docs/api.md, "cuattn.torch".

Importing this module imports torch; ``import cuattn`` alone never does.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

try:
    import torch
except ImportError as exc:
    raise ImportError("cuattn.torch needs PyTorch with CUDA: pip install torch "
                      f"({exc})") from exc

import cupy
import ml_dtypes
import numpy as np

import cuattn

from . import _arrays as A
from ._checks import DESCALES, check_descale_arrays, check_input_dtypes
from ._hooks import check_softcap
from ._interop import copy_async, device_view, external_stream

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

Tensor = torch.Tensor
FP8 = torch.float8_e4m3fn
_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
           FP8: np.dtype(ml_dtypes.float8_e4m3fn), torch.float32: np.dtype(np.float32),
           torch.int32: np.dtype(np.int32)}


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None,
                    v_descale=None):
    """flash-attn's flash_attn_func: q (batch, seqlen_q, nheads, headdim), k, v (batch,
    seqlen_k, nheads_kv, headdim), float16 / bfloat16 CUDA tensors; causal aligned to the
    bottom-right corner; alibi_slopes float32 (nheads,). Returns out like q, or with
    return_attn_probs (out, softmax_lse, None): lse float32 (batch, nheads, seqlen_q) and
    no attention probabilities (flash-attn returns them only with dropout). Differentiable
    in q, k, v (alibi_slopes get no gradient; nor does lse). dropout_p must be 0.

    FP8 (FlashAttention-3's flash_attn_func, sm_90 GPUs): q, k, v all torch.float8_e4m3fn,
    their real values the stored ones times q_descale / k_descale / v_descale (float32
    CUDA tensors (batch, nheads_kv), None: 1); out is bfloat16. Forward only: a backward
    through an FP8 call raises RuntimeError when it runs.
    """
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                       q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_dtypes(q, k, v, alibi_slopes, 4, "(batch, seqlen_k, nheads_kv, headdim)")
    descales = (q_descale, k_descale, v_descale)
    _check_descales(q, descales, q.shape[0], k.shape[-2])
    q, k, v = _on_cuda(q=q, k=k, v=v, **dict(zip(DESCALES, descales)))
    out, lse = torch.ops.cuattn.flash_fwd(q, k, v, alibi_slopes, *options, *descales)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, q_descale=None,
                           k_descale=None, v_descale=None):
    """flash-attn's flash_attn_varlen_func: q (total_q, nheads, headdim), k, v (total_k,
    nheads_kv, headdim); cu_seqlens_q / _k int32 (batch + 1,) CUDA tensors; max_seqlen_q /
    _k ints that bound every length. Returns out, or (out, softmax_lse, None) with lse
    float32 (nheads, total_q). Options, gradients and FP8 as flash_attn_func (the
    descales (batch, nheads_kv), batch = len(cu_seqlens_q) - 1).
    """
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                       q, 3, "(total_q, nheads, headdim)")
    _check_dtypes(q, k, v, alibi_slopes, 3, "(total_k, nheads_kv, headdim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(f"{name}: expected an int32 CUDA tensor of shape (batch + 1,), "
                            f"got {getattr(cu, 'dtype', type(cu).__name__)}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
    descales = (q_descale, k_descale, v_descale)
    _check_descales(q, descales, cu_seqlens_q.shape[0] - 1, k.shape[-2])
    q, k, v = _on_cuda(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                       **dict(zip(DESCALES, descales)))
    out, lse = torch.ops.cuattn.flash_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k, alibi_slopes,
                                                 *options, *descales)
    return (out, lse, None) if return_attn_probs else out


def _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, q,
             ndim: int, doc: str) -> tuple:
    """(softmax_scale, causal, window_left, window_right, softcap, deterministic): the
    static arguments of the ops, checked."""
    if not isinstance(q, Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dim() != ndim:
        raise ValueError(f"q: expected {ndim} dimensions {doc}, got shape {tuple(q.shape)}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p: cuattn has no dropout; expected 0.0, got {dropout_p}")
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    scale = A.check_softmax_scale(softmax_scale, q.shape[-1])
    left, right = A.check_window(tuple(window_size) if isinstance(window_size, list)
                                 else window_size)
    return scale, causal, left, right, check_softcap(softcap), deterministic


# The checks run in two stages: everything that needs no GPU (types, dtypes, shapes of the
# descales), then where the tensors are (_on_cuda).

def _check_dtypes(q, k, v, alibi_slopes, ndim: int, doc_kv: str) -> None:
    """q float16, bfloat16 or float8_e4m3fn; k, v tensors of ``ndim`` dimensions and q's
    dtype (no mixing of FP8 and 16-bit inputs); alibi_slopes float32."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions {doc_kv}, got shape "
                             f"{tuple(x.shape)}")
    check_input_dtypes(q, k, v, (torch.float16, torch.bfloat16, FP8))
    if alibi_slopes is not None and (not isinstance(alibi_slopes, Tensor)
                                     or alibi_slopes.dtype != torch.float32):
        raise TypeError(f"alibi_slopes: expected a float32 CUDA tensor of shape (nheads,), "
                        f"got {getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}")


def _check_descales(q, descales, batch: int, nheads_kv: int) -> None:
    """FlashAttention-3's descales: FP8 calls only, float32 tensors (batch, nheads_kv)."""
    check_descale_arrays(descales, q.dtype, q.dtype == FP8, _is_float32, "CUDA tensor", batch,
                         nheads_kv)


def _is_float32(x) -> bool:
    return isinstance(x, Tensor) and x.dtype == torch.float32


def _on_cuda(**tensors) -> tuple:
    """Each of ``tensors`` (None: absent) on a CUDA device; -> q, k, v with a contiguous
    last dimension (flash-attn's rule: copied when not)."""
    for name, x in tensors.items():
        if x is not None and not x.is_cuda:
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {x.device}")
    return tuple(x if x.stride(-1) == 1 else x.contiguous()
                 for x in (tensors["q"], tensors["k"], tensors["v"]))


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The forward's output dtype: q's, bfloat16 for FP8 (FlashAttention-3's)."""
    return torch.bfloat16 if dtype == FP8 else dtype


# ---- the ops --------------------------------------------------------------------------------

# The forward ops take the FP8 descales last, as optional tensors (None for 16-bit calls).

@torch.library.custom_op("cuattn::flash_fwd", mutates_args=(), device_types="cuda")
def _flash_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
               softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, deterministic: bool, q_descale: Optional[Tensor] = None,
               k_descale: Optional[Tensor] = None,
               v_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _forward(cuattn.flash_forward, (q.shape[0], q.shape[2], q.shape[1]), q, k, v,
                    causal=causal, softmax_scale=softmax_scale,
                    window_size=(window_left, window_right), softcap=softcap,
                    alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale,
                    v_descale=v_descale)


@torch.library.custom_op("cuattn::flash_varlen_fwd", mutates_args=(), device_types="cuda")
def _flash_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                      cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                      window_left: int, window_right: int, softcap: float,
                      deterministic: bool, q_descale: Optional[Tensor] = None,
                      k_descale: Optional[Tensor] = None,
                      v_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _forward(cuattn.flash_varlen_forward, (q.shape[1], q.shape[0]), q, k, v,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                    softmax_scale=softmax_scale, window_size=(window_left, window_right),
                    softcap=softcap, alibi_slopes=alibi_slopes, q_descale=q_descale,
                    k_descale=k_descale, v_descale=v_descale)


def _forward(forward, lse_shape: tuple, q: Tensor, *args, **options) -> tuple[Tensor, Tensor]:
    """A cuattn forward (flash_forward / flash_varlen_forward) into new out and lse tensors,
    on torch's stream: tensors among ``args`` and ``options`` go as CuPy views, the rest
    as they are."""
    out = torch.empty_like(q, dtype=_out_dtype(q.dtype))
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    with _on_torch_stream(q) as stream:
        _, lse_new = forward(_view(q), *map(_as_arg, args),
                             **{n: _as_arg(x) for n, x in options.items()}, return_lse=True,
                             out=_view(out), stream=stream)
        copy_async(_view(lse), lse_new, stream)
    return out, lse


@torch.library.custom_op("cuattn::flash_bwd", mutates_args=(), device_types="cuda")
def _flash_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
               window_left: int, window_right: int, softcap: float,
               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with _on_torch_stream(q) as stream:
        cuattn.flash_backward(
            _view(dout), _view(q), _view(k), _view(v), _view(out), _view(lse), causal=causal,
            softmax_scale=softmax_scale, window_size=(window_left, window_right),
            softcap=softcap, alibi_slopes=_view(alibi_slopes), deterministic=deterministic,
            dq=_view(dq), dk=_view(dk), dv=_view(dv), stream=stream)
    return dq, dk, dv


@torch.library.custom_op("cuattn::flash_varlen_bwd", mutates_args=(), device_types="cuda")
def _flash_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, alibi_slopes: Optional[Tensor],
                      softmax_scale: float, causal: bool, window_left: int,
                      window_right: int, softcap: float,
                      deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with _on_torch_stream(q) as stream:
        cuattn.flash_varlen_backward(
            _view(dout), _view(q), _view(k), _view(v), _view(out), _view(lse),
            _view(cu_seqlens_q), _view(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
            causal=causal, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_view(alibi_slopes), deterministic=deterministic,
            dq=_view(dq), dk=_view(dk), dv=_view(dv), stream=stream)
    return dq, dk, dv


@torch.library.custom_op("cuattn::flash_fp8_bwd", mutates_args=())
def _flash_fp8_bwd(dout: Tensor, q: Tensor, k: Tensor,
                   v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of an FP8 forward: there is none (FlashAttention-3's FP8 forward has
    none either). An op, not a raise in the autograd formula, so that torch.compile can
    trace a backward (AOT autograd does so with the forward) that fails only if it runs;
    it takes dout so that the partitioner cannot move it into the forward graph."""
    raise RuntimeError(
        "cuattn.torch: float8_e4m3fn q / k / v have no backward (the FP8 forward, like "
        "FlashAttention-3's, is forward-only); run FP8 calls on tensors that need no "
        "gradient (detach them, or torch.no_grad()), or take gradients through 16-bit calls")


@_flash_fwd.register_fake
def _fake_fwd(q, k, v, alibi_slopes, *options):
    return (torch.empty_like(q, dtype=_out_dtype(q.dtype)),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


@_flash_varlen_fwd.register_fake
def _fake_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    return (torch.empty_like(q, dtype=_out_dtype(q.dtype)),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@_flash_fp8_bwd.register_fake
def _fake_fp8_bwd(dout, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_flash_bwd.register_fake
def _fake_bwd(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_flash_varlen_bwd.register_fake
def _fake_varlen_bwd(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd: the forward keeps (q, k, v, out, lse); lse gets no gradient -------------------

def _setup_context(ctx, inputs, output):
    # inputs: q, k, v, [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: varlen],
    # alibi_slopes, the 6 options (softmax_scale ... deterministic), the 3 FP8 descales
    varlen = len(inputs) == 17          # flash_varlen_fwd's inputs; flash_fwd has 13
    cu_seqlens = inputs[3:5] if varlen else ()
    ctx.max_seqlens = tuple(inputs[5:7]) if varlen else None
    ctx.options = inputs[-9:-3]
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(*inputs[:3], *output, *cu_seqlens, inputs[-10])  # ..., alibi_slopes
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *cu_seqlens, alibi_slopes = ctx.saved_tensors
    none = (None,) * (ctx.num_inputs - 3)
    if q.dtype == FP8:
        return torch.ops.cuattn.flash_fp8_bwd(dout, q, k, v) + none
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if ctx.max_seqlens is None:
        grads = torch.ops.cuattn.flash_bwd(dout, q, k, v, out, lse, alibi_slopes, *ctx.options)
    else:
        grads = torch.ops.cuattn.flash_varlen_bwd(dout, q, k, v, out, lse, *cu_seqlens,
                                                  *ctx.max_seqlens, alibi_slopes,
                                                  *ctx.options)
    return grads + none


torch.library.register_autograd("cuattn::flash_fwd", _backward, setup_context=_setup_context)
torch.library.register_autograd("cuattn::flash_varlen_fwd", _backward,
                                setup_context=_setup_context)


# ---- tensors, stream and memory ------------------------------------------------------------

def _as_arg(x):
    """A tensor as a CuPy view (_view); anything else (None, an int) as it is."""
    return _view(x) if isinstance(x, Tensor) else x


def _view(t: Optional[Tensor]):
    """A CuPy view of a CUDA tensor (no copy, no stream sync), or None."""
    if t is None:
        return None
    itemsize = t.element_size()
    return device_view(t.data_ptr(), tuple(t.shape), _DTYPES[t.dtype], t.device.index,
                       tuple(s * itemsize for s in t.stride()))


@contextmanager
def _on_torch_stream(like: Tensor):
    """Inside: cuattn's calls go to torch's current stream of ``like``'s device (the ``as``
    value, that device current), and CuPy allocates from torch's caching allocator on that
    stream. Under CUDA-graph capture torch's allocator hands out the graph's private pool,
    so cuattn's scratch lives as long as the graph, as torch's own temporaries do."""
    device = like.device.index
    stream = torch.cuda.current_stream(device)

    def malloc(nbytes: int):
        ptr = torch.cuda.caching_allocator_alloc(nbytes, device, stream)
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, _TorchBlock(ptr), device)
        return cupy.cuda.MemoryPointer(memory, 0)

    with cupy.cuda.Device(device), cupy.cuda.using_allocator(malloc):
        yield external_stream(stream.cuda_stream, device)


class _TorchBlock:
    """Owns one block of torch's caching allocator: gives it back when CuPy lets go."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        try:
            torch.cuda.caching_allocator_delete(self.ptr)
        except Exception:        # at interpreter exit torch may be gone first
            pass
