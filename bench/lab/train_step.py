"""The training step of issue 35's target: forward + backward of one attention (loss =
sum(out * dout)), hd128 causal bf16, batch 16384 // S, 16 heads, S 2048 / 4096 / 8192.
From the repository root, on a GPU with JAX and PyTorch (FA3's wheel on PYTHONPATH for its
row): PYTHONPATH=. python bench/lab/train_step.py

JAX, one method (harness.wall_ms: a jitted step (jax_peers.train_step) called back to
back, settled; the JAX peers' only method): cuattn.jax.flash_attention, FlashAttention-3's
flash_mha (flash-attn3-jax), jax.nn.dot_product_attention(implementation="cudnn").
PyTorch, one method (eager back to back between two events, settled;
bench/torch_peers.eager_ms): cuattn.torch.flash_attn_func and SDPA forced to
CUDNN_ATTENTION, each step the forward and torch.autograd.grad of the three inputs.
Every step's gradients are checked finite once. TFLOP/s counts the causal half:
3.5 * 4 * B * H * S^2 * D / 2 (forward 1, backward 2.5).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, ".")

import jax                                               # noqa: E402
import jax.numpy as jnp                                  # noqa: E402

import cuattn.jax as cjax                                # noqa: E402
from bench import torch_peers                            # noqa: E402
from bench.harness import wall_ms                        # noqa: E402
from bench.jax_peers import train_step                   # noqa: E402

SEQLENS = (2048, 4096, 8192)
HEADS, HEAD_DIM = 16, 128
CALLS, ROUNDS, SETTLE_S = 20, 5, 0.3


def jax_attentions():
    rows = [("cuattn.jax", lambda q, k, v: cjax.flash_attention(q, k, v, causal=True)),
            ("jax.nn.dot_product_attention cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"))]
    try:
        from flash_attn3_jax import flash_mha
        rows.insert(1, ("FA3 flash_mha (flash-attn3-jax)",
                        lambda q, k, v: flash_mha(q, k, v, is_causal=True)))
    except Exception as exc:
        print(f"FA3 (flash-attn3-jax) not loaded: {type(exc).__name__}: {exc!s:.100}")
    return rows


def torch_steps(tt, q, k, v, dout):
    """(name, step) for cuattn.torch and SDPA cuDNN on torch (B, S, H, D) leaf tensors."""
    torch = tt.torch
    import cuattn.torch as ct

    def cuattn_step():
        out = ct.flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    qt, kt, vt, dt = (x.detach().transpose(1, 2).requires_grad_(x.requires_grad)
                      for x in (q, k, v, dout))

    def sdpa_step():
        with tt.sdpa_kernel(tt.sdpa_backend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return torch.autograd.grad(out, (qt, kt, vt), dt)
    return [("cuattn.torch", cuattn_step), ("torch SDPA CUDNN_ATTENTION", sdpa_step)]


def main():
    rows = []
    tt = torch_peers.load()
    for seqlen in SEQLENS:
        batch = 16384 // seqlen
        flops = 3.5 * 4 * batch * HEADS * seqlen * seqlen * HEAD_DIM / 2
        shape = (batch, seqlen, HEADS, HEAD_DIM)
        keys = jax.random.split(jax.random.PRNGKey(seqlen), 4)
        q, k, v, dout = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
        for name, attention in jax_attentions():
            try:
                step = train_step(attention)
                grads = jax.block_until_ready(step(q, k, v, dout))
                finite = all(bool(jnp.isfinite(g).all()) for g in grads)
                ms = wall_ms(lambda: step(q, k, v, dout), jax.block_until_ready, calls=CALLS,
                             n_repeat=ROUNDS, settle_s=SETTLE_S)
            except Exception as exc:                          # a peer refusing a shape
                print(f"{name} S{seqlen}: {type(exc).__name__}: {exc!s:.160}")
                continue
            rows.append((f"S{seqlen} B{batch} jax wall: {name}", ms, flops / ms / 1e9, finite))
        if tt is None:
            continue
        torch = tt.torch
        gen = torch.Generator(device="cuda").manual_seed(seqlen)
        tq, tk, tv = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
                      .requires_grad_() for _ in range(3))
        tdo = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        for name, step in torch_steps(tt, tq, tk, tv, tdo):
            try:
                finite = all(bool(torch.isfinite(g).all()) for g in step())
                ms = torch_peers.eager_ms(tt, step, calls=CALLS, n_repeat=ROUNDS,
                                          settle_s=SETTLE_S)
            except Exception as exc:
                print(f"{name} S{seqlen}: {type(exc).__name__}: {exc!s:.160}")
                continue
            rows.append((f"S{seqlen} B{batch} torch eager: {name}", ms, flops / ms / 1e9,
                         finite))
        del tq, tk, tv, tdo
    width = max(len(r[0]) for r in rows)
    print(f"{'training step (fwd + bwd), hd128 causal bf16':<{width}}  ms/step  TFLOP/s  finite")
    for name, ms, tflops, finite in rows:
        print(f"{name:<{width}}  {ms:7.3f}  {tflops:7.0f}  {finite}")


if __name__ == "__main__":
    main()
