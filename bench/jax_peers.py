"""JAX peers: FlashAttention-3 through the ``flash-attn3-jax`` wheel (0.2.3: Hopper, head dim
128 only), on CuPy's inputs shared through DLPack.

JAX offers no graph or event API that CuPy can share, so its one method is wall clock
(``harness.wall_ms``): jitted calls back to back, one ``jax.block_until_ready`` on the last
result, wall time / calls. It is valid where one call's kernels take milliseconds (the
host's dispatch of the first call and the sync's wake-up are then a small part); a ratio
with cuattn divides it only by cuattn timed the same way. Each library runs on its own
stream: the device is synchronised before JAX reads CuPy's arrays, and JAX's results are
waited for before anything else runs.

The wheel (``pip install --target /tmp/site .whl/flash_attn3_jax-*.whl``, then
``PYTHONPATH=/tmp/site``) needs jax >= 0.6 and einops, and bundles its own CUDA 12.4 runtime.
Its non-causal outputs were inf in an earlier run (shared/PEERS-H200.md): every call here
checks that the forward's output and the three gradients are finite.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import cupy

from bench.harness import wall_ms

FA3_HEAD_DIMS = (128,)          # the wheel's only compiled head dim


@dataclass
class Fa3:
    jax: object
    jnp: object
    flash: object               # flash_attn3_jax.flash: _flash_mha_fwd / _flash_mha_bwd, flash_mha


def load() -> Fa3 | None:
    """flash_attn3_jax over a JAX that sees a GPU, or None (with one line saying why).
    JAX is asked not to preallocate 75% of the GPU (CuPy and torch share it)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
        from flash_attn3_jax import flash
        if not any(d.platform == "gpu" for d in jax.devices()):
            print("FA3 (flash-attn3-jax): JAX sees no GPU; its cells stay empty", flush=True)
            return None
        return Fa3(jax, jnp, flash)
    except Exception as exc:
        print(f"FA3 (flash-attn3-jax) not loaded, its cells stay empty: "
              f"{type(exc).__name__}: {exc!s:.120}", flush=True)
        return None


def _backward(fa3: Fa3, q, k, v, *, causal: bool, scale: float):
    """(backward, out): ``backward(dout) -> (dq, dk, dv)`` jitted, over the forward's residuals
    computed once here, and the forward's output. Through the wheel's own primitives
    (``_flash_mha_fwd`` / ``_flash_mha_bwd``, what its custom VJP calls), or where those names
    are missing, the VJP of ``flash_mha``, its pullback (a pytree holding the residuals)
    passed into one jitted call."""
    jax, flash = fa3.jax, fa3.flash
    window = (-1, -1)
    if hasattr(flash, "_flash_mha_fwd") and hasattr(flash, "_flash_mha_bwd"):
        out, lse = jax.jit(lambda q, k, v: flash._flash_mha_fwd(
            q, k, v, scale, causal, window))(q, k, v)
        bwd = jax.jit(lambda do, q, k, v, o, lse: flash._flash_mha_bwd(
            do, q, k, v, o, lse, scale, causal, window))
        return (lambda do: bwd(do, q, k, v, out, lse)), out
    out, pullback = jax.vjp(lambda q, k, v: flash.flash_mha(
        q, k, v, softmax_scale=scale, is_causal=causal, window_size=window), q, k, v)
    apply = jax.jit(lambda f, do: f(do))
    return (lambda do: apply(pullback, do)), out


def fa3_backward(fa3: Fa3, q, k, v, dout, *, causal: bool):
    """(call, finite): a callable running only FA3's backward on the (B, S, H, D) CuPy arrays
    (viewed through DLPack), its forward computed once here, and whether that forward's
    output and the gradients are all finite; or (None, why) where FA3 refuses."""
    jnp = fa3.jnp
    d = q.shape[-1]
    if d not in FA3_HEAD_DIMS:
        return None, f"head dim {d}: the wheel has {FA3_HEAD_DIMS} only"
    cupy.cuda.Device().synchronize()         # JAX's stream does not wait for CuPy's
    try:
        jq, jk, jv, jdo = (jnp.from_dlpack(x) for x in (q, k, v, dout))
        backward, out = _backward(fa3, jq, jk, jv, causal=causal, scale=1.0 / math.sqrt(d))

        def call():
            return backward(jdo)
        grads = fa3.jax.block_until_ready(call())
        finite = all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
    except Exception as exc:
        return None, f"refused: {type(exc).__name__}: {exc!s:.100}"
    return call, finite


def fa3_wall_ms(fa3: Fa3, call, *, calls: int, n_repeat: int, settle_s: float) -> float:
    """Wall clock per call of ``call`` (harness.wall_ms with jax.block_until_ready)."""
    return wall_ms(call, fa3.jax.block_until_ready, calls=calls, n_repeat=n_repeat,
                   settle_s=settle_s)


def train_step(attention):
    """A jitted training step of one attention: (q, k, v, dout) -> the gradients of
    sum(attention(q, k, v) * dout) for q, k and v (bench/lab's training-step rows)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(q, k, v, dout):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v).astype(jnp.float32) * dout)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return step
