"""JAX arrays in, a JAX array out, through DLPack: no copies.

cupy.from_dlpack(x) is a CuPy view of a JAX array (cuattn's input) and jnp.from_dlpack(out)
a JAX array over cuattn's result; the DLPack exchange orders the work of the two
libraries' streams. The result is checked against jax.nn.dot_product_attention, which
takes the same (batch, seqlen, heads, headdim) layout (and the same GQA rule).

    python examples/interop_jax.py     # exit 0: ran and matched; 1: wrong; 2: could not run
"""
from __future__ import annotations

import sys

from _example import need_gpu, need_jax_gpu



def main() -> int:
    need_gpu()
    jax = need_jax_gpu()
    import cupy as cp
    import jax.numpy as jnp

    import cuattn

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (2, 1024, 16, 128), dtype=jnp.bfloat16)
    k = jax.random.normal(kk, (2, 1024, 4, 128), dtype=jnp.bfloat16)    # GQA: 4 kv heads
    v = jax.random.normal(kv, (2, 1024, 4, 128), dtype=jnp.bfloat16)
    q_view = cp.from_dlpack(q)
    out_view = cuattn.flash_forward(q_view, cp.from_dlpack(k), cp.from_dlpack(v), causal=True)
    out = jnp.from_dlpack(out_view)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    err = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
    shared = (q_view.data.ptr == q.unsafe_buffer_pointer()
              and out.unsafe_buffer_pointer() == out_view.data.ptr)
    print(f"flash_forward on JAX arrays: shape {out.shape}, {out.dtype}, "
          f"max |out - dot_product_attention| = {err:.2e}, memory shared (no copy): {shared}")
    return 0 if shared and err < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
