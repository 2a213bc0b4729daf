"""References for the autograd adapters' tests (tests/test_adapters_*.py): the float64
backward of one sequence in NumPy (the stand-in kernel of the CPU plumbing tests), and
the attention of the adapters' options as plain jax.numpy / torch math (autodiff gives
its gradients). Each takes q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k,
nheads_kv, headdim); query i sits at position i + seqlen_k - seqlen_q (bottom-right).
"""
from __future__ import annotations

import numpy as np

from tests.reference import attention_reference


def visible(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """(sq, sk) bool: the keys each query sees (cuattn's causal and window rules)."""
    pos = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    seen = np.ones((sq, sk), bool)
    if right >= 0:
        seen &= j <= pos + right
    if left >= 0:
        seen &= j >= pos - left
    return seen


def attention_grads_reference(q, k, v, dout, scale, *, causal=False, window=(-1, -1),
                              softcap=0.0, alibi=None, sinks=None):
    """Float64 (dq, dk, dv, dsinks) of one sequence: q, dout (sq, H, D), k, v (sk, Hkv, D).

    FlashAttention-2's backward written out: P from the scores, dV = P^T dO, dP = dO V^T,
    D = rowsum(dO * O), dS = P (dP - D) (times 1 - tanh^2 under softcap), dQ = scale dS K,
    dK = scale dS^T Q; a sink h gets -sum_i P_sink(i) D_i. Rows that see nothing: zeros.
    """
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    sq, nheads, _ = q.shape
    sk, nheads_kv, _ = k.shape
    group = nheads // nheads_kv
    pos = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    seen = visible(sq, sk, causal, window)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(nheads)
    for h in range(nheads):
        kh, vh = k[:, h // group], v[:, h // group]
        s = scale * (q[:, h] @ kh.T)
        tanh = None
        if softcap > 0:
            tanh = np.tanh(s / softcap)
            s = softcap * tanh
        if alibi is not None:
            s = s - float(alibi[h]) * np.abs(pos - j)
        s = np.where(seen, s, -np.inf)
        m = s.max(axis=1, initial=-np.inf)
        if sinks is not None:
            m = np.maximum(m, float(sinks[h]))
        m = np.where(np.isinf(m), 0.0, m)
        p = np.exp(s - m[:, None])
        sink = np.exp(float(sinks[h]) - m) if sinks is not None else np.zeros(sq)
        denom = p.sum(axis=1) + sink
        with np.errstate(invalid="ignore", divide="ignore"):
            p = np.where(denom[:, None] > 0, p / denom[:, None], 0.0)
            sink = np.where(denom > 0, sink / denom, 0.0)
        do = dout[:, h]
        d = (do * (p @ vh)).sum(axis=1)
        ds = p * (do @ vh.T - d[:, None])
        if tanh is not None:
            ds = ds * (1 - tanh**2)
        dv[:, h // group] += p.T @ do
        dq[:, h] = scale * ds @ kh
        dk[:, h // group] += scale * ds.T @ q[:, h]
        dsinks[h] = -(sink * d).sum()
    return dq, dk, dv, dsinks


def forward_reference(q, k, v, scale, **options):
    """Float64 (out, lse) of a batch: out (B, sq, H, D), lse (B, H, sq)."""
    pairs = [attention_reference(q[b], k[b], v[b], scale, **options) for b in range(q.shape[0])]
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
    if alibi is not None:
        pos = np.arange(sq)[:, None] + sk - sq
        s = s - alibi[None, :, None, None] * np.abs(pos - np.arange(sk)[None, :]).astype(s.dtype)
    s = jnp.where(visible(sq, sk, causal, window), s, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks[None, :, None, None].astype(s.dtype), s.shape[:3] + (1,))
        s = jnp.concatenate([s, column], axis=-1)
    p = jax.nn.softmax(s, axis=-1)[..., :sk]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)
