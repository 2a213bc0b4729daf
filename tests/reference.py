"""Float64 NumPy references shared by the tests (and the tolerance rule of docs/ARCHITECTURE.md)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0                                          # e4m3fn's largest finite value


def merge_reference(outs: np.ndarray, lses: np.ndarray):
    """outs (k, T, H, D), lses (k, H, T) -> float64 out (T, H, D), lse (H, T); +/-inf = empty."""
    outs = outs.astype(np.float64)
    lses = lses.astype(np.float64)
    lses = np.where(np.isinf(lses), -np.inf, lses)
    m = lses.max(axis=0)                                  # (H, T)
    safe_m = np.where(np.isinf(m), 0.0, m)
    w = np.exp(lses - safe_m)                             # (k, H, T), 0 for empty
    s = w.sum(axis=0)
    wt = np.transpose(w, (0, 2, 1))[..., None]            # (k, T, H, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(np.transpose(s)[..., None] > 0,
                       (wt * np.nan_to_num(outs)).sum(axis=0) / np.transpose(s)[..., None], 0.0)
        lse = np.where(s > 0, safe_m + np.log(s), -np.inf)
    return out, lse


def tolerance(kernel_err_ref_precision: float, floor: float) -> float:
    """FlashAttention's rule: 2x the error of the same math in the input precision + floor."""
    return 2.0 * kernel_err_ref_precision + floor


def grad_tolerance(kernel_err_ref_precision: float, floor: float) -> float:
    """FlashAttention's rule for gradients: 3x the error of the same math in the input
    precision + floor (flash-attn's backward tests allow 3x: a gradient's error at small
    shapes is mostly its final rounding, where a 2x bound on two maxima is a coin toss)."""
    return 3.0 * kernel_err_ref_precision + floor


def check_attention(out, lse, ref, ref_lse, dtype, lse_rtol=1e-4):
    """A kernel's out (and lse, unless None; CuPy arrays) against float64 references: out by
    FlashAttention's rule (2x the error of the reference rounded to ``dtype``, a NumPy
    dtype), no NaN/inf anywhere, -inf lse exactly where the reference has it."""
    got = out.get().astype(np.float64)
    assert np.isfinite(got).all(), "NaN/inf in out (unwritten, or a NaN slot was read)"
    lowp = ref.astype(dtype).astype(np.float64)
    err = np.abs(got - ref).max(initial=0)
    tol = tolerance(np.abs(lowp - ref).max(initial=0), 1e-3)
    assert err <= tol, f"max error {err} > {tol}"
    if lse is None:
        return
    got_lse = lse.get().astype(np.float64)
    assert not np.isnan(got_lse).any()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.allclose(got_lse[fin], ref_lse[fin], rtol=lse_rtol, atol=1e-3)


def visible(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """(sq, sk) bool: the keys each query sees. Query i sits at position i + sk - sq
    (bottom-right); causal keeps j <= that, window (left, right) keeps position - left <= j
    <= position + right (-1: unbounded)."""
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


def attention_reference(q, k, v, scale, *, causal=False, window=(-1, -1), softcap=0.0,
                        alibi=None, sinks=None):
    """Float64 attention of one sequence, every option of the attention functions.

    q (sq, H, D), k / v (sk, Hkv, D). Query i sits at position i + sk - sq (bottom-right);
    a scaled score s becomes softcap * tanh(s / softcap) (softcap > 0), then
    s - slope_h * |i + sk - sq - j| (alibi (H,)); causal keeps j <= i + sk - sq, window
    (left, right) keeps i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded);
    sinks (H,) join each head's denominator. Returns out (sq, H, D) and lse (H, sq): a row
    that sees no key gives zeros and -inf (with a sink: zeros and the sink).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    sq, nheads, _ = q.shape
    sk, nkv, _ = k.shape
    group = nheads // nkv
    pos = np.arange(sq)[:, None] + sk - sq                 # (sq, 1) query positions
    j = np.arange(sk)[None, :]
    seen = visible(sq, sk, causal, window)
    out = np.zeros(q.shape)
    lse = np.full((nheads, sq), -np.inf)
    for h in range(nheads):
        s = scale * (q[:, h] @ k[:, h // group].T)         # (sq, sk)
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if alibi is not None:
            s = s - float(alibi[h]) * np.abs(pos - j)
        p, _, lse[h] = _softmax(np.where(seen, s, -np.inf),
                                None if sinks is None else float(sinks[h]))
        out[:, h] = p @ v[:, h // group]
    return out, lse


def _softmax(z, sink):
    """Rows of logits z (-inf: masked) and a sink logit or None -> (P, P of the sink or None,
    lse); a row that sees nothing (no key, no sink) gets P = 0 and lse = -inf."""
    m = z.max(axis=1, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, sink)
    safe = np.where(np.isinf(m), 0.0, m)
    e = np.exp(z - safe[:, None])
    e_sink = np.exp(sink - safe) if sink is not None else 0.0
    denom = e.sum(axis=1) + e_sink
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(denom[:, None] > 0, e / denom[:, None], 0.0)
        p_sink = np.where(denom > 0, e_sink / denom, 0.0) if sink is not None else None
        lse = np.where(denom > 0, safe + np.log(denom), -np.inf)
    return p, p_sink, lse


def attention_backward_reference(q, k, v, dout, scale, *, causal=False, window=(-1, -1),
                                 softcap=0.0, alibi=None, sinks=None, lowp=None, tanh=np.tanh):
    """Float64 gradients of attention_reference's out for one sequence: (dq, dk, dv, dsinks).

    q, dout (sq, H, D); k, v (sk, Hkv, D); dk / dv of a KV head sum its query heads; dsinks
    (H,) or None. The algebra (FlashAttention-2's backward, from first principles): with the
    hooked logits z = softcap * tanh(s / softcap) - bias of the scaled scores s = scale q k^T,
    P = exp(z - lse) (lse over the visible keys and the sink), dV = P^T dO, dP = dO V^T,
    D_i = sum_j P_ij dP_ij = rowsum(dO * out), dZ = P (dP - D), dS = dZ (1 - tanh^2),
    dQ = scale dS K, dK = scale dS^T Q, dsink_h = -sum_i P_sink(i) D_i.
    lowp (a NumPy dtype): the same math with every intermediate rounded to it (the error
    of doing it in the input precision: FlashAttention's tolerance rule). tanh: a CPU
    self-test's stand-in for the kernels' approximate one (tests/test_fuzz.py).
    """
    rnd = (lambda x: x) if lowp is None else (lambda x: _round_to(x, lowp))
    q, k, v, dout = (rnd(np.asarray(x, np.float64)) for x in (q, k, v, dout))
    sq, nheads, _ = q.shape
    sk, nkv, _ = k.shape
    group = nheads // nkv
    pos = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    seen = visible(sq, sk, causal, window)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(nheads) if sinks is not None else None
    for h in range(nheads):
        kh, vh = k[:, h // group], v[:, h // group]
        s = rnd(scale * (q[:, h] @ kh.T))
        t = tanh(s / softcap) if softcap > 0 else None
        z = softcap * t if softcap > 0 else s
        if alibi is not None:
            z = z - float(alibi[h]) * np.abs(pos - j)
        p, p_sink, _ = _softmax(np.where(seen, z, -np.inf),
                                None if sinks is None else float(sinks[h]))
        p = rnd(p)
        out = rnd(p @ vh)
        dp = rnd(dout[:, h] @ vh.T)
        d = (dout[:, h] * out).sum(axis=1)
        dz = rnd(p * (dp - d[:, None]))
        ds = dz * (1.0 - t * t) if softcap > 0 else dz
        ds = rnd(ds)
        dq[:, h] = scale * (ds @ kh)
        dk[:, h // group] += scale * (ds.T @ q[:, h])
        dv[:, h // group] += p.T @ dout[:, h]
        if sinks is not None:
            dsinks[h] = -(p_sink * d).sum()
    return rnd(dq), rnd(dk), rnd(dv), dsinks


def quantize_e4m3(x, scale):
    """x / scale (in float32; scale broadcasts) -> float8_e4m3fn, nearest even (ml_dtypes),
    saturated to +/-448 (inf too; NaN stays NaN): what the kernels' cvt.rn.satfinite does
    (ml_dtypes alone turns values past 464 into NaN, e4m3fn having no inf)."""
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)
    return np.clip(y, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def _per_head(descale, batch, nheads):
    """A float32 (batch, nheads_kv) descale (or a scalar) -> float32 (batch, nheads): head h
    takes KV head h // (nheads // nheads_kv)'s factor."""
    d = np.asarray(descale, np.float32)
    d = d if d.ndim == 2 else np.broadcast_to(d, (batch, 1))
    return np.repeat(d, nheads // d.shape[1], axis=1)


def fp8_dequantized(x8, descale):
    """The float64 real values of e4m3 x8 (batch, seqlen, nheads, D) under a float32
    (batch, nheads_kv) descale (q's too: FlashAttention-3 scales q per KV head)."""
    d = _per_head(descale, x8.shape[0], x8.shape[2]).astype(np.float64)
    return x8.astype(np.float64) * d[:, None, :, None]


def fp8_attention_kernel_math(q8, k8, v8, q_descale, k_descale, v_descale, scale, *,
                              causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                              sinks=None, p_scale=256.0):
    """The FP8 forward's math with its roundings, in NumPy: the error that the FP8 kernels'
    tolerance doubles (FlashAttention's rule).

    q8 (batch, sq, H, D), k8 / v8 (batch, sk, Hkv, D) e4m3; descales float32 (batch, Hkv)
    (or scalars), query head h using KV head h // (H // Hkv)'s, q's too. Per row, as
    FlashAttention-3: S = (q8 . k8) accumulated in float32 (summation order not modelled),
    times q_descale * k_descale * scale (float32); masks by ``visible``; m = the row max of
    S (float32; the final one: an online softmax rounds a tile's P at the running max, the
    same rounding statistically); P = p_scale * exp(S - m) in float32, rounded to e4m3
    (nearest even, satfinite) for the PV GEMM; O = (P8 . v8) accumulated in float32, times
    v_descale / l, l the float32 row sum of the *unrounded* P (what an online softmax
    accumulates from its fp32 P).
    p_scale: FlashAttention-3 subtracts Max_offset = 8 from the exp2 argument, P in [0, 256]
    (hopper/softmax.h): e4m3 normals reach down to P = 2^-14 instead of 2^-6. It cancels in
    O, and lse takes log(l / p_scale); p_scale=1 is P in [0, 1] (the seed's 8.9.6 sketch
    scales P per tile by p_max / 448 instead; FA3 does not). softcap, alibi (H,) and sinks
    (H,) as attention_reference has them, in float32 on S (a sink joins m and l unrounded).
    Returns float32 out (batch, sq, H, D) and lse (batch, H, sq), natural log; a row that
    sees no key: zeros and -inf (with a sink: zeros and the sink).
    """
    batch, sq, nheads, _ = q8.shape
    sk, nkv = k8.shape[1], k8.shape[2]
    group = nheads // nkv
    qd, kd, vd = (_per_head(d, batch, nheads) for d in (q_descale, k_descale, v_descale))
    seen = visible(sq, sk, causal, window)
    dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :]).astype(np.float32)
    q, k, v = (x.astype(np.float32) for x in (q8, k8, v8))
    out = np.zeros(q.shape, np.float32)
    lse = np.full((batch, nheads, sq), -np.inf, np.float32)
    for b in range(batch):
        for h in range(nheads):
            c = qd[b, h] * kd[b, h] * np.float32(scale)
            s = (q[b, :, h] @ k[b, :, h // group].T) * c
            if softcap > 0:
                s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
            if alibi is not None:
                s = s - np.float32(alibi[h]) * dist
            s = np.where(seen, s, -np.inf).astype(np.float32)
            m = s.max(axis=1, initial=-np.inf)
            if sinks is not None:
                m = np.maximum(m, np.float32(sinks[h]))
            safe = np.where(np.isinf(m), np.float32(0), m)
            p = np.float32(p_scale) * np.exp(s - safe[:, None])     # float32, 0 where masked
            l = p.sum(axis=1, dtype=np.float32)
            if sinks is not None:
                l = l + np.float32(p_scale) * np.exp(np.float32(sinks[h]) - safe)
            o = quantize_e4m3(p, 1.0).astype(np.float32) @ v[b, :, h // group]
            with np.errstate(invalid="ignore", divide="ignore"):
                out[b, :, h] = np.where(l[:, None] > 0, o * (1 / l[:, None] * vd[b, h]), 0)
                lse[b, h] = np.where(l > 0, safe + np.log(l / np.float32(p_scale)), -np.inf)
    return out, lse


def _round_to(x, dtype):
    """Round float64 values to ``dtype`` (fp16 / bf16, nearest even) and back to float64."""
    return np.asarray(x, np.float64).astype(np.float32).astype(dtype).astype(np.float64)
