"""References for the autograd adapters' tests (tests/test_adapters_*.py): the float64
backward of one sequence (tests/reference.py's, the stand-in kernel of the CPU plumbing
tests), and
the attention of the adapters' options as plain jax.numpy / torch math (autodiff gives
its gradients). Each takes q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k,
nheads_kv, headdim); query i sits at position i + seqlen_k - seqlen_q (bottom-right).
"""
from __future__ import annotations

import numpy as np

from tests.reference import attention_backward_reference, attention_reference, visible


def attention_grads_reference(q, k, v, dout, scale, *, sinks=None, **options):
    """Float64 (dq, dk, dv, dsinks) of one sequence (tests/reference.py's backward
    reference; dsinks zeros without sinks): q, dout (sq, H, D), k, v (sk, Hkv, D)."""
    dq, dk, dv, dsinks = attention_backward_reference(q, k, v, dout, scale, sinks=sinks,
                                                      **options)
    return dq, dk, dv, (np.zeros(q.shape[1]) if dsinks is None else dsinks)


def alibi_row(alibi, b: int):
    """The slopes batch entry b sees: alibi (nheads,) itself, row b of (batch, nheads)."""
    return alibi if alibi is None or np.ndim(alibi) == 1 else alibi[b]


def forward_reference(q, k, v, scale, *, alibi=None, **options):
    """Float64 (out, lse) of a batch: out (B, sq, H, D), lse (B, H, sq)."""
    pairs = [attention_reference(q[b], k[b], v[b], scale, alibi=alibi_row(alibi, b), **options)
             for b in range(q.shape[0])]
    return np.stack([o for o, _ in pairs]), np.stack([lse for _, lse in pairs])


def jax_attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0,
                  alibi=None, sinks=None):
    """The adapters' attention as jax.numpy math, in the dtype of its inputs."""
    import jax
    import jax.numpy as jnp
    sq, nheads = q.shape[1], q.shape[2]
    sk, nheads_kv = k.shape[1], k.shape[2]
    k = jnp.repeat(k, nheads // nheads_kv, axis=2)
    v = jnp.repeat(v, nheads // nheads_kv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    if alibi is not None:     # (nheads,) or (batch, nheads)
        pos = np.arange(sq)[:, None] + sk - sq
        rows = alibi if alibi.ndim == 2 else alibi[None]
        s = s - rows[:, :, None, None] * np.abs(pos - np.arange(sk)[None, :]).astype(s.dtype)
    s = jnp.where(visible(sq, sk, causal, window), s, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None].astype(s.dtype), s.shape[:3] + (1,))
        s = jnp.concatenate([s, column], axis=-1)
    p = jax.nn.softmax(s, axis=-1)[..., :sk]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)
