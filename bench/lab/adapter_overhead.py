"""What cuattn.jax costs beside its kernels (issue 33). From the repository root, on a GPU
with JAX: PYTHONPATH=. python bench/lab/adapter_overhead.py

1. Per call, small shape (2, 1024, 16, 128) bf16 causal: a jitted flash_attention called
   back to back (wall clock / N after one block_until_ready: the method for a library with
   no graph API, docs/ARCHITECTURE.md section 4, bench/harness.py wall_ms),
   with XLA's command buffers allowed (the adapter's default) and not
   (command_buffer_compatible=False: Python runs on every call), beside the bare
   cuattn.flash_forward's kernel time (CuPy graph replays), its eager back-to-back time, and
   the floor of a jitted call (x + 1 on one element).
2. A jitted training step (forward + backward of one attention, loss = sum(out * dout)),
   hd128 causal bf16, batch 16384 // S, 2048 // 128 = 16 heads, S 1024 / 4096: through
   cuattn.jax beside jax.nn.dot_product_attention(implementation="cudnn"), same method.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, ".")

import cupy                                              # noqa: E402
import jax                                               # noqa: E402
import jax.numpy as jnp                                  # noqa: E402

import cuattn                                            # noqa: E402
import cuattn.jax as cjax                                # noqa: E402
from bench.harness import CupyGraph, eager_ms, randn     # noqa: E402
from bench.jax_peers import train_step                   # noqa: E402

CALLS, ROUNDS = 200, 5


def per_call_ms(fn, *args) -> float:
    """Median over rounds of (wall clock of CALLS back-to-back calls) / CALLS, settled."""
    jax.block_until_ready(fn(*args))
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / CALLS * 1e3)
    return sorted(times)[len(times) // 2]


def jitted_attention(command_buffer: bool):
    cjax._COMMAND_BUFFER = command_buffer           # read when the function is traced
    return jax.jit(lambda q, k, v: cjax.flash_attention(q, k, v, causal=True))


def main():
    rows = []
    shape = (2, 1024, 16, 128)
    q, k, v = (randn(*shape) for _ in range(3))
    out = cupy.empty_like(q)
    graph = CupyGraph(lambda: cuattn.flash_forward(q, k, v, causal=True, out=out), calls=20)
    rows.append(("cuattn.flash_forward, kernel (graph)", graph.median_ms()))
    rows.append(("cuattn.flash_forward, eager back-to-back",
                 eager_ms(lambda: cuattn.flash_forward(q, k, v, causal=True, out=out))))
    jq, jk, jv = (jnp.from_dlpack(x) for x in (q, k, v))
    one = jnp.ones((1,), jnp.float32)
    rows.append(("jax.jit floor: x + 1 on one element", per_call_ms(jax.jit(lambda x: x + 1),
                                                                   one)))
    for command_buffer in (True, False):
        fn = jitted_attention(command_buffer)
        rows.append((f"cuattn.jax jitted, command buffer {'on' if command_buffer else 'off'}",
                     per_call_ms(fn, jq, jk, jv)))
    cjax._COMMAND_BUFFER = True

    for seqlen in (1024, 4096):
        batch = 16384 // seqlen
        key = jax.random.split(jax.random.PRNGKey(seqlen), 4)
        q, k, v, dout = (jax.random.normal(kk, (batch, seqlen, 16, 128), jnp.bfloat16)
                         for kk in key)
        dout = dout.astype(jnp.float32)
        flops = 3.5 * 4 * batch * 16 * seqlen * seqlen * 128 / 2    # fwd + bwd, causal
        for name, attention in (
                ("cuattn.jax", lambda q, k, v: cjax.flash_attention(q, k, v, causal=True)),
                ("dot_product_attention cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="cudnn"))):
            try:
                ms = per_call_ms(train_step(attention), q, k, v, dout)
            except Exception as exc:                          # cuDNN refusing a shape
                print(f"{name} S{seqlen}: {exc!r:.200}")
                continue
            rows.append((f"train step S{seqlen} B{batch}: {name} "
                         f"({flops / ms / 1e9:.0f} TFLOP/s)", ms))

    width = max(len(name) for name, _ in rows)
    print(f"{'what':<{width}}  ms per call")
    for name, ms in rows:
        print(f"{name:<{width}}  {ms:.4f}")


if __name__ == "__main__":
    main()
