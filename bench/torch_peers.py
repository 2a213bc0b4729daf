"""PyTorch peers, timed by the same two methods as cuattn (bench.harness), on CuPy's inputs.

- kernel-only: ``calls`` back-to-back calls captured in a ``torch.cuda.CUDAGraph`` (torch
  captures on its own side stream), replays timed with torch CUDA events on torch's current
  stream, median per call: the counterpart of ``harness.CupyGraph``.
- eager back-to-back: ``calls`` calls between two torch events, no sync inside, median of
  time / calls: the counterpart of ``harness.eager_ms``.

Inputs are CuPy arrays shared through DLPack (no copy). Each library runs on its own current
stream, so every hand-over synchronises the whole device first (a non-blocking stream does
not wait for the null stream, and torch's stream need not be CuPy's).
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy

from bench.harness import event_median_ms, repeat_calls


@dataclass
class Torch:
    torch: object
    sdpa_backend: object        # torch.nn.attention.SDPBackend
    sdpa_kernel: object         # torch.nn.attention.sdpa_kernel


def load() -> Torch | None:
    """torch with a usable CUDA device, or None."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if not torch.cuda.is_available():
            return None
        return Torch(torch, SDPBackend, sdpa_kernel)
    except Exception:
        return None


def bhsd_views(tt: Torch | None, *arrays):
    """(B, S, H, D) CuPy arrays -> torch (B, H, S, D) views of the same memory (after a
    device sync), or None without torch or where DLPack refuses the arrays."""
    if tt is None:
        return None
    cupy.cuda.Device().synchronize()
    try:
        return tuple(tt.torch.from_dlpack(x).transpose(1, 2) for x in arrays)
    except Exception as exc:
        print(f"torch peers skipped: DLPack refused the inputs: {exc!r:.120}", flush=True)
        return None


def graph_ms(tt: Torch, fn, *, calls: int, n_warmup: int = 2, n_repeat: int = 20,
             settle_s: float = 0.0) -> float:
    """Kernel-only: median per call of CUDA-graph replays of ``calls`` calls of ``fn``.
    ``fn`` must already have run once (compiled, plans built); ``settle_s`` as
    harness.event_median_ms."""
    torch = tt.torch
    torch.cuda.synchronize()
    side = torch.cuda.Stream()            # warm-up on a side stream, as torch asks before capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        repeat_calls(fn, 2)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        repeat_calls(fn, calls)
    ms = event_median_ms(g.replay, *_events(torch), n_warmup=n_warmup, n_repeat=n_repeat,
                         per=calls, settle_s=settle_s)
    del g
    torch.cuda.synchronize()
    return ms


def eager_ms(tt: Torch, fn, *, calls: int = 20, n_warmup: int = 1, n_repeat: int = 5,
             settle_s: float = 0.0) -> float:
    """Eager back-to-back: ``calls`` calls between two torch events on torch's current
    stream, no sync inside; median of time / calls (``settle_s`` as
    harness.event_median_ms)."""
    torch = tt.torch
    torch.cuda.synchronize()
    return event_median_ms(lambda: repeat_calls(fn, calls), *_events(torch), n_warmup=n_warmup,
                           n_repeat=n_repeat, per=calls, settle_s=settle_s)


def _events(torch):
    return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
            lambda a, b: a.elapsed_time(b))


def sdpa_times(tt: Torch, tq, tk, tv, *, causal: bool, backend_name: str, graph_calls: int,
               eager_calls: int, graph_reps: int = 20, eager_reps: int = 5,
               settle_s: float = 0.0):
    """(kernel-only ms, eager ms) per call of SDPA forced to one backend on (B, H, S, D)
    tensors, or (None, None) where the backend is missing or refuses the shape (checked by
    an eager call first), or (None, eager) where only the capture fails; ``settle_s`` before
    each (harness.event_median_ms)."""
    torch = tt.torch
    backend = getattr(tt.sdpa_backend, backend_name, None)
    if backend is None:
        return None, None

    def call():
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    # The backend is forced once around everything, so the eager calls do not pay for
    # entering the context manager each time.
    with tt.sdpa_kernel(backend), torch.no_grad():
        return both_methods(tt, call, f"torch SDPA {backend_name}", graph_calls=graph_calls,
                            eager_calls=eager_calls, graph_reps=graph_reps,
                            eager_reps=eager_reps, settle_s=settle_s)


def both_methods(tt: Torch, call, name: str, *, graph_calls: int, eager_calls: int,
                 graph_reps: int, eager_reps: int, settle_s: float):
    """(kernel-only ms, eager ms) per call of ``call`` (graph_ms, eager_ms): (None, None)
    where one eager call raises (the peer refuses the shape), (None, eager) where only the
    capture fails. The device is synchronised before and after (a hand-over to CuPy)."""
    torch = tt.torch
    try:
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
    except Exception:                # not built here, or not for this shape / dtype
        return None, None
    eager = eager_ms(tt, call, calls=eager_calls, n_repeat=eager_reps, settle_s=settle_s)
    try:
        kernel = graph_ms(tt, call, calls=graph_calls, n_repeat=graph_reps, settle_s=settle_s)
    except Exception as exc:         # capture refused: report eager only
        print(f"{name}: graph capture failed: {exc!r:.120}", flush=True)
        torch.cuda.synchronize()
        kernel = None
    cupy.cuda.Device().synchronize()
    return kernel, eager


def sdpa_backward_call(tt: Torch, tq, tk, tv, tdout, *, causal: bool, backend_name: str):
    """(call, route): a callable that runs only the backward of SDPA forced to one backend on
    (B, H, S, D) tensors (key / value heads may divide the query heads: GQA), the forward's
    outputs computed once here; or (None, why) where the backend is missing or refuses.

    Route "aten": the backend's own backward op (``_scaled_dot_product_flash_attention_backward``
    or ``_scaled_dot_product_cudnn_attention_backward``, PyTorch 2.11 schemas) on the saved
    outputs of its forward op: no autograd in the timed call. Route "autograd" where that
    raises: ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` over one SDPA
    forward under ``sdpa_kernel`` (re-runs only the backward; its capture may be refused,
    since autograd runs a backward op on its forward's stream). Each call allocates its
    gradients from torch's caching allocator."""
    torch = tt.torch
    backend = getattr(tt.sdpa_backend, backend_name, None)
    if backend is None:
        return None, f"no SDPBackend.{backend_name}"
    aten = torch.ops.aten
    try:
        if backend_name == "FLASH_ATTENTION":
            out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = \
                aten._scaled_dot_product_flash_attention(tq, tk, tv, 0.0, causal, False)

            def call():
                return aten._scaled_dot_product_flash_attention_backward(
                    tdout, tq, tk, tv, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed,
                    offset)
        elif backend_name == "CUDNN_ATTENTION":
            out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = \
                aten._scaled_dot_product_cudnn_attention(tq, tk, tv, None, True, 0.0, causal, False)

            def call():
                return aten._scaled_dot_product_cudnn_attention_backward(
                    tdout, tq, tk, tv, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k,
                    0.0, causal)
        else:
            raise ValueError(f"no backward op named for {backend_name}")
        call()
        torch.cuda.synchronize()
        return call, "aten"
    except Exception as exc:
        aten_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:100]
    torch.cuda.synchronize()
    q, k, v = (x.detach().requires_grad_() for x in (tq, tk, tv))
    try:
        with tt.sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=tq.shape[1] != tk.shape[1])

        def call():
            return torch.autograd.grad(out, (q, k, v), tdout, retain_graph=True)
        call()
        torch.cuda.synchronize()
        return call, f"autograd (aten op: {aten_error})"
    except Exception as exc:
        torch.cuda.synchronize()
        return None, f"refused: aten op: {aten_error}; autograd: {type(exc).__name__}"
