"""cuattn.torch: flash-attn's flash_attn_func / flash_attn_varlen_func on cuattn's kernels.

Each is a pair of ``torch.library.custom_op``s (``cuattn::flash_fwd`` / ``cuattn::flash_bwd``
and their varlen forms) with a fake implementation and an autograd formula, so the same
call runs eagerly, under ``torch.compile`` and inside ``torch.cuda.CUDAGraph`` capture.
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
from ._hooks import check_softcap
from ._interop import copy_async, device_view, external_stream

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]

Tensor = torch.Tensor
_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
           torch.float32: np.dtype(np.float32), torch.int32: np.dtype(np.int32)}


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn's flash_attn_func: q (batch, seqlen_q, nheads, headdim), k, v (batch,
    seqlen_k, nheads_kv, headdim), float16 / bfloat16 CUDA tensors; causal aligned to the
    bottom-right corner; alibi_slopes float32 (nheads,). Returns out like q, or with
    return_attn_probs (out, softmax_lse, None): lse float32 (batch, nheads, seqlen_q) and
    no attention probabilities (flash-attn returns them only with dropout). Differentiable
    in q, k, v (alibi_slopes get no gradient; nor does lse). dropout_p must be 0.
    """
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                       q, 4, "(batch, seqlen_q, nheads, headdim)")
    q, k, v = _tensors(q, k, v, alibi_slopes)
    out, lse = torch.ops.cuattn.flash_fwd(q, k, v, alibi_slopes, *options)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """flash-attn's flash_attn_varlen_func: q (total_q, nheads, headdim), k, v (total_k,
    nheads_kv, headdim); cu_seqlens_q / _k int32 (batch + 1,) CUDA tensors; max_seqlen_q /
    _k ints that bound every length. Returns out, or (out, softmax_lse, None) with lse
    float32 (nheads, total_q). Options and gradients as flash_attn_func.
    """
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                       q, 3, "(total_q, nheads, headdim)")
    q, k, v = _tensors(q, k, v, alibi_slopes)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or not cu.is_cuda:
            raise TypeError(f"{name}: expected an int32 CUDA tensor of shape (batch + 1,), "
                            f"got {getattr(cu, 'dtype', type(cu).__name__)}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
    out, lse = torch.ops.cuattn.flash_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k, alibi_slopes,
                                                 *options)
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


def _tensors(q, k, v, alibi_slopes):
    """q, k, v with a contiguous last dimension (flash-attn's rule: copied when not)."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_cuda:
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {x.device}")
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name}: expected dtype float16 or bfloat16, got {x.dtype}")
    if alibi_slopes is not None and (not isinstance(alibi_slopes, Tensor)
                                     or alibi_slopes.dtype != torch.float32):
        raise TypeError(f"alibi_slopes: expected a float32 CUDA tensor of shape (nheads,), "
                        f"got {getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}")
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))


# ---- the ops --------------------------------------------------------------------------------

@torch.library.custom_op("cuattn::flash_fwd", mutates_args=(), device_types="cuda")
def _flash_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
               softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, deterministic: bool) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    with _on_torch_stream(q) as stream:
        _, lse_new = cuattn.flash_forward(
            _view(q), _view(k), _view(v), causal=causal, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_view(alibi_slopes), return_lse=True, out=_view(out), stream=stream)
        copy_async(_view(lse), lse_new, stream)
    return out, lse


@torch.library.custom_op("cuattn::flash_varlen_fwd", mutates_args=(), device_types="cuda")
def _flash_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                      cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      alibi_slopes: Optional[Tensor], softmax_scale: float, causal: bool,
                      window_left: int, window_right: int, softcap: float,
                      deterministic: bool) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    with _on_torch_stream(q) as stream:
        _, lse_new = cuattn.flash_varlen_forward(
            _view(q), _view(k), _view(v), _view(cu_seqlens_q), _view(cu_seqlens_k),
            max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=_view(alibi_slopes), return_lse=True, out=_view(out), stream=stream)
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


@_flash_fwd.register_fake
def _fake_fwd(q, k, v, alibi_slopes, *options):
    return (torch.empty_like(q),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))


@_flash_varlen_fwd.register_fake
def _fake_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *options):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@_flash_bwd.register_fake
def _fake_bwd(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_flash_varlen_bwd.register_fake
def _fake_varlen_bwd(dout, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd: the forward keeps (q, k, v, out, lse); lse gets no gradient -------------------

def _setup_context(ctx, inputs, output):
    varlen = len(inputs) == 14          # flash_varlen_fwd's inputs; flash_fwd has 10
    cu_seqlens = inputs[3:5] if varlen else ()
    ctx.max_seqlens = tuple(inputs[5:7]) if varlen else None
    ctx.options = inputs[-6:]           # softmax_scale, causal, window, softcap, deterministic
    ctx.save_for_backward(*inputs[:3], *output, *cu_seqlens, inputs[-7])   # ..., alibi_slopes
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *cu_seqlens, alibi_slopes = ctx.saved_tensors
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if ctx.max_seqlens is None:
        grads = torch.ops.cuattn.flash_bwd(dout, q, k, v, out, lse, alibi_slopes, *ctx.options)
        return grads + (None,) * 7
    grads = torch.ops.cuattn.flash_varlen_bwd(dout, q, k, v, out, lse, *cu_seqlens,
                                              *ctx.max_seqlens, alibi_slopes, *ctx.options)
    return grads + (None,) * 11


torch.library.register_autograd("cuattn::flash_fwd", _backward, setup_context=_setup_context)
torch.library.register_autograd("cuattn::flash_varlen_fwd", _backward,
                                setup_context=_setup_context)


# ---- tensors, stream and memory ------------------------------------------------------------

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
