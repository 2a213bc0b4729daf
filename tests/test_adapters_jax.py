"""cuattn.jax: flash_attention / flash_attention_varlen under jax.jit, jax.grad, jax.vmap.

Two kinds of tests (both skip without JAX):

- CPU (plumbing): the custom_vjp, the buffer callbacks and their vmap rule on JAX's CPU
  backend, with NumPy stand-ins for cuattn's kernels (float64 forward and backward of
  tests/reference.py and tests/adapter_reference.py) and for the CuPy views: everything
  but the kernels and the stream, against jax.numpy attention differentiated by JAX. FP8:
  the descales reach the forward in their slots (the stand-in dequantizes), out is
  bfloat16, a gradient is a TypeError when traced, bad FP8 inputs raise before tracing.
- GPU: the real kernels on XLA's stream, against jax.nn.dot_product_attention (or the
  jax.numpy attention where it lacks the option) in float32, by the project's tolerance
  rule (tests/reference.py), with XLA's command buffers on and off. FP8 (sm_90 only): the
  same bits as cuattn.flash_forward / flash_varlen_forward on the same inputs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.adapter_reference import (alibi_row, attention_grads_reference, forward_reference,
                                     jax_attention)
from tests.reference import attention_reference, fp8_dequantized, grad_tolerance, tolerance

jax = pytest.importorskip("jax", exc_type=ImportError)
jnp = pytest.importorskip("jax.numpy")
cjax = pytest.importorskip("cuattn.jax", exc_type=ImportError)

import cuattn  # noqa: E402
from cuattn._checks import DESCALES  # noqa: E402


# ---- CPU: the plumbing, with NumPy stand-ins for the kernels --------------------------------

def _fake_forward(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes,
                  sinks, q_descale, k_descale, v_descale, return_lse, out, stream):
    if q.dtype == np.uint8:     # FP8 (cuattn.jax passes e4m3 bytes): the real values
        q, k, v = (x.view(jnp.float8_e4m3fn) for x in (q, k, v))
        ones = np.ones((q.shape[0], k.shape[2]), np.float32)
        q, k, v = (fp8_dequantized(x, ones if d is None else d)
                   for x, d in ((q, q_descale), (k, k_descale), (v, v_descale)))
    o, lse = forward_reference(q, k, v, softmax_scale, causal=causal, window=window_size,
                               softcap=softcap, alibi=alibi_slopes, sinks=sinks)
    out[...] = o.astype(out.dtype)
    return out, lse.astype(np.float32)


def _fake_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, window_size, softcap,
                   alibi_slopes, sinks, deterministic, dq, dk, dv, stream):
    grads = [attention_grads_reference(q[b], k[b], v[b], dout[b], softmax_scale,
                                       causal=causal, window=window_size, softcap=softcap,
                                       alibi=alibi_row(alibi_slopes, b), sinks=sinks)
             for b in range(q.shape[0])]
    for i, dx in enumerate((dq, dk, dv)):
        dx[...] = np.stack([g[i] for g in grads]).astype(dx.dtype)
    dsinks = np.sum([g[3] for g in grads], axis=0).astype(np.float32)
    return (dq, dk, dv, dsinks) if sinks is not None else (dq, dk, dv)


def _segments(cu_q, cu_k):
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]))
            for b in range(len(cu_q) - 1)]


def _fake_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, out, q_descale, k_descale,
                         v_descale, **options):
    lse = np.zeros((q.shape[1], q.shape[0]), np.float32)
    for b, (sq, sk) in enumerate(_segments(cu_q, cu_k)):
        rows = {name: None if d is None else d[b:b + 1] for name, d in
                (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))}
        _, seg_lse = _fake_forward(q[None, sq], k[None, sk], v[None, sk], out=out[None, sq],
                                   **rows, **options)
        lse[:, sq] = seg_lse[0]
    return out, lse


def _fake_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dq, dk, dv,
                          sinks, **options):
    dsinks = np.zeros(q.shape[1], np.float32)
    for sq, sk in _segments(cu_q, cu_k):
        grads = _fake_backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], None,
                               None, dq=dq[None, sq], dk=dk[None, sk], dv=dv[None, sk],
                               sinks=sinks, **options)
        if sinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv, dsinks) if sinks is not None else (dq, dk, dv)


@pytest.fixture
def on_cpu(monkeypatch):
    """cuattn.jax on JAX's CPU backend, its kernels and CuPy views replaced by NumPy."""
    monkeypatch.setattr(cjax, "_device_of", lambda buffer: 0)
    monkeypatch.setattr(cjax, "_stream_of", lambda ctx, device: None)
    monkeypatch.setattr(cjax, "_view", lambda buffer, device: np.asarray(buffer))
    monkeypatch.setattr(cjax, "_copy", lambda dst, src, stream: np.copyto(dst, src))
    monkeypatch.setattr(cjax, "_guarded", lambda stream, device, work: work())
    for name, fake in (("flash_forward", _fake_forward), ("flash_backward", _fake_backward),
                       ("flash_varlen_forward", _fake_varlen_forward),
                       ("flash_varlen_backward", _fake_varlen_backward)):
        monkeypatch.setattr(cuattn, name, fake, raising=False)
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _inputs(seed, shape_q, shape_kv, dtype=None, heads=None):
    rng = np.random.default_rng(seed)
    dtype = dtype or jnp.bfloat16
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
               for s in (shape_q, shape_kv, shape_kv))
    dout = jnp.asarray(rng.standard_normal(shape_q), dtype)
    return q, k, v, dout


def _grads(fn, q, k, v, dout, *extra):
    """(out, dq, dk, dv, d extra...) of sum(fn(q, k, v, *extra) * dout)."""
    out, vjp = jax.vjp(fn, q, k, v, *extra)
    return (out,) + vjp(dout.astype(out.dtype))


def _assert_close(got, want, dtype, floor=1e-3, what=""):
    """The project's rule: |got - want| <= 2 x the error of want rounded to dtype + floor."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all(), f"{what}: NaN/inf"
    lowp = np.asarray(jnp.asarray(want, dtype).astype(jnp.float32), np.float64)
    err = np.abs(got - want).max(initial=0)
    tol = tolerance(np.abs(lowp - want).max(initial=0), floor)
    assert err <= tol, f"{what}: max error {err} > {tol}"


CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(causal=True, softcap=5.0),
    dict(sinks=True),
    dict(alibi=True, causal=True),
    dict(alibi="batch", causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(c) or "plain")
def test_plumbing_gradients_match_jax_autodiff(on_cpu, case):
    """jax.grad through the custom_vjp (jitted) equals JAX's own autodiff of the same
    attention; GQA (4 query heads on 2 kv heads), seqlen_q < seqlen_k."""
    q, k, v, dout = _inputs(0, (2, 5, 4, 16), (2, 7, 2, 16))
    rng = np.random.default_rng(1)
    alibi_shape = (2, 4) if case.get("alibi") == "batch" else (4,)
    alibi = jnp.asarray(rng.uniform(0.1, 0.5, alibi_shape), jnp.float32) \
        if case.get("alibi") else None
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32) if case.get("sinks") else None
    options = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
                   softcap=case.get("softcap", 0.0))
    scale = 1 / math.sqrt(16)

    @jax.jit
    def ours(q, k, v, alibi, sinks):
        return cjax.flash_attention(q, k, v, alibi_slopes=alibi, sinks=sinks, **options)

    def theirs(q, k, v, alibi, sinks):
        return jax_attention(q, k, v, scale=scale, causal=options["causal"],
                             window=options["window_size"], softcap=options["softcap"],
                             alibi=alibi, sinks=sinks)

    got = _grads(ours, q, k, v, dout, alibi, sinks)
    f32 = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, dout)]
    want = _grads(theirs, *f32, alibi, sinks)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        _assert_close(g, w, jnp.bfloat16, what=name)
    if alibi is not None:
        assert not np.asarray(got[4]).any()          # flash-attn: no gradient for ALiBi
    if sinks is not None:
        _assert_close(got[5], want[5], jnp.float32, floor=1e-4, what="dsinks")
    else:
        assert got[5] is None


@pytest.mark.parametrize("mapped", ["all", "q only", "with sinks"])
def test_plumbing_vmap(on_cpu, mapped):
    """jax.vmap over a leading axis of the loss's gradients: folded into the batch when
    q, k, v are all mapped (one call), else one call per element; the same numbers as
    calling each element alone."""
    q, k, v, dout = _inputs(2, (3, 2, 6, 4, 16), (3, 2, 6, 2, 16))
    sinks = jnp.asarray(np.random.default_rng(3).standard_normal(4), jnp.float32)
    if mapped == "q only":
        k, v = k[0], v[0]
    use_sinks = mapped == "with sinks"

    def loss(q, k, v, sinks, dout):
        out = cjax.flash_attention(q, k, v, causal=True, sinks=sinks if use_sinks else None)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    kv_axis = 0 if mapped != "q only" else None
    batched = jax.jit(jax.vmap(grad, in_axes=(0, kv_axis, kv_axis, None, 0)))(q, k, v, sinks,
                                                                             dout)
    for i in range(q.shape[0]):
        ki, vi = (k[i], v[i]) if kv_axis == 0 else (k, v)
        alone = grad(q[i], ki, vi, sinks, dout[i])
        for name, b, a in zip(("dq", "dk", "dv"), batched, alone):
            if name != "dq" and kv_axis is None:
                continue                       # summed over the mapped axis by vmap
            np.testing.assert_array_equal(np.asarray(b[i]), np.asarray(a), err_msg=name)
        if use_sinks:
            np.testing.assert_allclose(np.asarray(batched[3][i]), np.asarray(alone[3]),
                                       rtol=1e-6, atol=1e-6)


def test_plumbing_varlen(on_cpu):
    """flash_attention_varlen's gradients equal the dense call's of each sequence, and the
    cu_seqlens get none (a zero cotangent)."""
    lengths_q, lengths_k = [3, 0, 5], [4, 2, 6]
    cu_q = jnp.asarray(np.cumsum([0] + lengths_q), jnp.int32)
    cu_k = jnp.asarray(np.cumsum([0] + lengths_k), jnp.int32)
    q, k, v, dout = _inputs(4, (sum(lengths_q), 4, 16), (sum(lengths_k), 2, 16))
    sinks = jnp.asarray(np.random.default_rng(5).standard_normal(4), jnp.float32)

    def packed(q, k, v, sinks):
        return cjax.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q),
                                           max(lengths_k), causal=True, sinks=sinks)

    out, dq, dk, dv, dsinks = _grads(jax.jit(packed), q, k, v, dout, sinks)
    want_dsinks = np.zeros(4)
    for b in range(3):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = attention_grads_reference(q[sq], k[sk], v[sk], dout[sq], 0.25, causal=True,
                                        sinks=np.asarray(sinks))
        want_out, _ = attention_reference(q[sq], k[sk], v[sk], 0.25, causal=True,
                                          sinks=np.asarray(sinks))
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out[sq], dq[sq], dk[sk], dv[sk]),
                              (want_out,) + ref[:3]):
            _assert_close(g, w, jnp.bfloat16, what=f"{name} of sequence {b}")
        want_dsinks += ref[3]
    _assert_close(dsinks, want_dsinks, jnp.float32, floor=1e-4, what="dsinks")


def test_plumbing_eager_calls_reuse_one_compiled_program(on_cpu):
    """Without jax.jit: the callbacks are one object per set of options, so a second
    eager call compiles nothing new."""
    q, k, v, _ = _inputs(6, (1, 4, 2, 16), (1, 4, 2, 16))
    first = cjax.flash_attention(q, k, v, causal=True)
    spec = (False, q, True, None, (-1, -1), 0.0, False, 0, 0, None)
    assert cjax._forward_callback(cjax._spec(*spec)) is cjax._forward_callback(cjax._spec(*spec))
    np.testing.assert_array_equal(np.asarray(first),
                                  np.asarray(cjax.flash_attention(q, k, v, causal=True)))


# ---- CPU: FP8 plumbing ----------------------------------------------------------------------

def _fp8_inputs(seed, shape_q, shape_kv, shape_descale=None):
    """q, k, v float8_e4m3fn jax arrays and three float32 descales of ``shape_descale``
    (None: no descales), each in its own range, so that a swapped v_descale shows (q's and
    k's act through their product alone)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s) * 4, jnp.float8_e4m3fn)
               for s in (shape_q, shape_kv, shape_kv))
    if shape_descale is None:
        return q, k, v, None, None, None
    return (q, k, v) + tuple(jnp.asarray(rng.uniform(lo, lo + 0.5, shape_descale), jnp.float32)
                             for lo in (0.1, 0.7, 1.5))


def _fp8_reference(q, k, v, qd, kd, vd, scale, **options):
    """Float64 attention of the dequantized inputs (batch, s, heads, D)."""
    ones = np.ones((q.shape[0], k.shape[2]), np.float32)
    qr, kr, vr = (fp8_dequantized(np.asarray(x), ones if d is None else np.asarray(d))
                  for x, d in ((q, qd), (k, kd), (v, vd)))
    return forward_reference(qr, kr, vr, scale, **options)[0]


@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_plumbing_fp8_forward(on_cpu, descales, causal):
    """jitted FP8 flash_attention (GQA): bfloat16 out, the attention of the dequantized
    inputs, each descale in its own slot."""
    q, k, v, qd, kd, vd = _fp8_inputs(20, (2, 5, 4, 16), (2, 7, 2, 16),
                                      (2, 2) if descales else None)

    @jax.jit
    def ours(q, k, v, qd, kd, vd):
        return cjax.flash_attention(q, k, v, causal=causal, q_descale=qd, k_descale=kd,
                                    v_descale=vd)

    out = ours(q, k, v, qd, kd, vd)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    want = _fp8_reference(q, k, v, qd, kd, vd, 0.25, causal=causal)
    _assert_close(out, want, jnp.bfloat16, what="out")


def test_plumbing_fp8_varlen(on_cpu):
    """flash_attention_varlen in FP8: sequence b takes row b of each descale."""
    lengths_q, lengths_k = [3, 0, 5], [4, 2, 6]
    cu_q = jnp.asarray(np.cumsum([0] + lengths_q), jnp.int32)
    cu_k = jnp.asarray(np.cumsum([0] + lengths_k), jnp.int32)
    q, k, v, qd, kd, vd = _fp8_inputs(21, (sum(lengths_q), 4, 16), (sum(lengths_k), 2, 16),
                                      (3, 2))
    out = jax.jit(lambda *a: cjax.flash_attention_varlen(
        *a[:3], cu_q, cu_k, 5, 6, causal=True, q_descale=a[3], k_descale=a[4],
        v_descale=a[5]))(q, k, v, qd, kd, vd)
    assert out.dtype == jnp.bfloat16
    for b in range(3):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.start == sq.stop:
            continue
        want = _fp8_reference(q[None, sq], k[None, sk], v[None, sk], qd[b:b + 1],
                              kd[b:b + 1], vd[b:b + 1], 0.25, causal=True)
        _assert_close(out[sq], want[0], jnp.bfloat16, what=f"out of sequence {b}")


@pytest.mark.parametrize("mapped", ["all", "descales unmapped"])
def test_plumbing_fp8_vmap(on_cpu, mapped):
    """jax.vmap of an FP8 call: descales mapped with q, k, v fold into the batch with
    them; unmapped ones broadcast over the mapped axis; the same bits as each element."""
    d_axis = 0 if mapped == "all" else None
    q, k, v, *ds = _fp8_inputs(23, (3, 2, 6, 4, 16), (3, 2, 6, 2, 16),
                               (3, 2, 2) if d_axis == 0 else (2, 2))

    def f(q, k, v, qd, kd, vd):
        return cjax.flash_attention(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                    v_descale=vd)

    batched = jax.jit(jax.vmap(f, in_axes=(0, 0, 0) + (d_axis,) * 3))(q, k, v, *ds)
    for i in range(3):
        di = [d[i] for d in ds] if d_axis == 0 else ds
        np.testing.assert_array_equal(np.asarray(batched[i]),
                                      np.asarray(f(q[i], k[i], v[i], *di)))


def test_plumbing_fp8_gradient_is_a_type_error(on_cpu):
    """FP8 is forward-only: jax.grad (and a vjp's pullback) raise TypeError naming
    float8_e4m3fn when the backward is traced; stop_gradient'ed inputs run the forward."""
    q, k, v, qd, kd, vd = _fp8_inputs(25, (1, 4, 2, 16), (1, 4, 2, 16), (1, 2))

    def loss(q, k, v):
        out = cjax.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
        return jnp.sum(out.astype(jnp.float32))

    with pytest.raises(TypeError, match="float8_e4m3fn"):
        jax.grad(loss)(q, k, v)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        jax.jit(jax.grad(loss, argnums=2))(q, k, v)
    value, pullback = jax.vjp(loss, q, k, v)          # the forward alone runs
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        pullback(jnp.ones_like(value))
    stopped = jax.jit(lambda q, k, v: loss(*map(jax.lax.stop_gradient, (q, k, v))))
    assert np.isfinite(float(stopped(q, k, v)))


# ---- CPU: bad inputs raise before anything is traced ----------------------------------------

def _E4M3(shape):
    return jnp.zeros(shape, jnp.float8_e4m3fn)


FP8 = dict(q=_E4M3((1, 8, 4, 64)), k=_E4M3((1, 8, 2, 64)), v=_E4M3((1, 8, 2, 64)))


def _bad(**change):
    q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    args = dict(q=q, k=kv, v=kv)
    args.update({k: v for k, v in change.items() if k in args})
    options = {k: v for k, v in change.items() if k not in args}
    return lambda: cjax.flash_attention(args["q"], args["k"], args["v"], **options)


@pytest.mark.parametrize("change,error,name", [
    (dict(q=jnp.zeros((1, 8, 4, 64), jnp.float32)), TypeError, "q"),
    (dict(k=jnp.zeros((1, 8, 2, 64), jnp.float16)), TypeError, "k"),
    (dict(q=jnp.zeros((8, 4, 64), jnp.bfloat16)), ValueError, "q"),
    (dict(v=jnp.zeros((1, 9, 2, 64), jnp.bfloat16)), ValueError, "v"),
    (dict(k=jnp.zeros((1, 8, 3, 64), jnp.bfloat16),
          v=jnp.zeros((1, 8, 3, 64), jnp.bfloat16)), ValueError, "k"),
    (dict(q=jnp.zeros((1, 8, 4, 60), jnp.bfloat16)), ValueError, "q"),
    (dict(k=jnp.zeros((2, 8, 2, 64), jnp.bfloat16),
          v=jnp.zeros((2, 8, 2, 64), jnp.bfloat16)), ValueError, "k"),
    (dict(causal=1), TypeError, "causal"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=3), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(sinks=jnp.zeros(4, jnp.float16)), TypeError, "sinks"),
    (dict(alibi_slopes=jnp.zeros(2, jnp.float32)), ValueError, "alibi_slopes"),
    # FP8
    (dict(q=jnp.zeros((1, 8, 4, 64), jnp.float8_e4m3fn)), TypeError, "k"),      # mixed
    (dict(q=_E4M3((1, 8, 4, 64)), k=_E4M3((1, 8, 2, 64))), TypeError, "v"),
    (dict(q=jnp.zeros((1, 8, 4, 64), jnp.float8_e5m2)), TypeError, "q"),
    (dict(q=_E4M3((1, 8, 4, 40)), k=_E4M3((1, 8, 2, 40)), v=_E4M3((1, 8, 2, 40))),
     ValueError, "q"),                                      # FP8 head dims: multiples of 16
    (dict(q_descale=jnp.ones((1, 2), jnp.float32)), ValueError, "q_descale"),   # 16-bit
    (dict(FP8, k_descale=jnp.ones((1, 2), jnp.float16)), TypeError, "k_descale"),
    (dict(FP8, v_descale=np.ones((1, 2), np.float64)), TypeError, "v_descale"),
    (dict(FP8, q_descale=jnp.ones((1, 4), jnp.float32)), ValueError, "q_descale"),
    (dict(FP8, k_descale=jnp.ones((2,), jnp.float32)), ValueError, "k_descale"),
])
def test_bad_inputs_name_the_argument(change, error, name):
    with pytest.raises(error, match=rf"^{name}: "):
        _bad(**change)()


def test_bad_fp8_inputs_raise_at_trace_time():
    """Under jax.jit the descales' shapes and dtypes are checked when the call is traced."""
    q, kv = _E4M3((1, 8, 4, 64)), _E4M3((1, 8, 2, 64))
    call = jax.jit(lambda d: cjax.flash_attention(q, kv, kv, v_descale=d))
    with pytest.raises(ValueError, match="^v_descale: "):
        call(jnp.ones((1, 4), jnp.float32))
    with pytest.raises(TypeError, match="^v_descale: "):
        call(jnp.ones((1, 2), jnp.int32))


def test_bad_varlen_inputs_name_the_argument():
    q = jnp.zeros((8, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((8, 2, 64), jnp.bfloat16)
    cu = jnp.asarray([0, 8], jnp.int32)
    with pytest.raises(TypeError, match="^cu_seqlens_k: "):
        cjax.flash_attention_varlen(q, kv, kv, cu, cu.astype(jnp.float32), 8, 8)
    with pytest.raises(TypeError, match="^max_seqlen_q: "):
        cjax.flash_attention_varlen(q, kv, kv, cu, cu, 8.0, 8)
    with pytest.raises(ValueError, match="^max_seqlen_k: "):
        cjax.flash_attention_varlen(q, kv, kv, cu, cu, 8, -1)
    with pytest.raises(TypeError, match="^max_seqlen_q: "):
        jax.jit(lambda n: cjax.flash_attention_varlen(q, kv, kv, cu, cu, n, 8))(8)
    q8, kv8 = q.astype(jnp.float8_e4m3fn), kv.astype(jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="^k_descale: "):     # batch: len(cu_seqlens_q) - 1
        cjax.flash_attention_varlen(q8, kv8, kv8, cu, cu, 8, 8,
                                    k_descale=jnp.ones((2, 2), jnp.float32))
    with pytest.raises(TypeError, match="^v: "):
        cjax.flash_attention_varlen(q8, kv8, kv, cu, cu, 8, 8)


# ---- GPU: the real kernels on XLA's stream --------------------------------------------------

def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("this jax has no GPU backend")


@pytest.fixture(params=[True, False], ids=["command-buffer", "no-command-buffer"])
def command_buffer(request, monkeypatch):
    """Both settings of buffer_callback's command_buffer_compatible."""
    monkeypatch.setattr(cjax, "_COMMAND_BUFFER", request.param)
    return request.param


def _check_against(ours, theirs, args, dout, dtype, what):
    """ours' and theirs' outputs and gradients; theirs in float32 is the reference, theirs
    in ``dtype`` sets the tolerance (the project's rule)."""
    got = _grads(jax.jit(ours), *args[:3], dout, *args[3:])
    f32 = [None if x is None else x.astype(jnp.float32) for x in args]
    want = _grads(jax.jit(theirs), *f32[:3], dout.astype(jnp.float32), *f32[3:])
    lowp = _grads(jax.jit(theirs), *args[:3], dout, *args[3:])
    for name, g, w, lo in zip(("out", "dq", "dk", "dv", "dalibi", "dsinks"), got, want, lowp):
        if g is None or name == "dalibi":
            continue
        g, w, lo = (np.asarray(x, np.float64) for x in (g, w, lo))
        assert np.isfinite(g).all(), f"{what} {name}: NaN/inf"
        err = np.abs(g - w).max(initial=0)
        rule = tolerance if name == "out" else grad_tolerance   # 2x out, 3x gradients
        tol = rule(np.abs(lo - w).max(initial=0), 1e-3 if name != "dsinks" else 1e-4)
        assert err <= tol, f"{what} {name}: max error {err} > {tol}"


GPU_CASES = [
    dict(name="plain", shape=(2, 128, 4, 64), kv=(2, 128, 4, 64)),
    dict(name="causal", shape=(2, 128, 4, 64), kv=(2, 128, 4, 64), causal=True),
    dict(name="causal GQA hd128", shape=(1, 200, 8, 128), kv=(1, 200, 2, 128), causal=True),
    dict(name="window", shape=(2, 96, 4, 64), kv=(2, 160, 4, 64), window=(32, 8)),
    dict(name="softcap", shape=(2, 128, 4, 64), kv=(2, 128, 2, 64), causal=True, softcap=20.0),
    dict(name="sinks", shape=(2, 128, 4, 64), kv=(2, 128, 4, 64), causal=True, sinks=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c["name"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gradients_against_jax(case, dtype, command_buffer):
    """out, dq, dk, dv (and dsinks) of jax.jit(jax.vjp(flash_attention)) against
    jax.nn.dot_product_attention where it has the option (plain, causal, GQA; its causal
    mask is top-left aligned, so equal lengths there), else the jax.numpy attention."""
    device = _gpu()
    dtype = getattr(jnp, dtype)
    rng = np.random.default_rng(7)
    with jax.default_device(device):
        q, k, v, dout = _inputs(8, case["shape"], case["kv"], dtype)
        sinks = (jnp.asarray(rng.standard_normal(case["shape"][2]), jnp.float32)
                 if case.get("sinks") else None)
        causal, window = case.get("causal", False), case.get("window", (-1, -1))
        softcap = case.get("softcap", 0.0)
        scale = 1 / math.sqrt(case["shape"][-1])

        def ours(q, k, v, sinks):
            return cjax.flash_attention(q, k, v, causal=causal, window_size=window,
                                        softcap=softcap, sinks=sinks)

        if window == (-1, -1) and softcap == 0 and sinks is None:
            def theirs(q, k, v, sinks):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        else:
            def theirs(q, k, v, sinks):
                return jax_attention(q, k, v, scale=scale, causal=causal, window=window,
                                     softcap=softcap, sinks=sinks)

        _check_against(ours, theirs, (q, k, v, sinks), dout, dtype, case["name"])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [False, True], ids=["nheads", "batch-nheads"])
def test_alibi_gradient_is_zero_and_output_matches(rows):
    """alibi_slopes (nheads,) and (batch, nheads) (a row per batch entry)."""
    device = _gpu()
    with jax.default_device(device):
        q, k, v, dout = _inputs(9, (2, 64, 4, 64), (2, 64, 4, 64))
        alibi = jnp.asarray([0.1, 0.2, 0.3, 0.4], jnp.float32)
        if rows:
            alibi = jnp.stack([alibi, alibi[::-1] * 0.5])

        def ours(q, k, v, alibi):
            return cjax.flash_attention(q, k, v, causal=True, alibi_slopes=alibi)

        got = _grads(jax.jit(ours), q, k, v, dout, alibi)
        want = _grads(lambda q, k, v, a: jax_attention(q, k, v, scale=0.125, causal=True,
                                                       alibi=a),
                      *(x.astype(jnp.float32) for x in (q, k, v)), dout.astype(jnp.float32),
                      alibi)
        _assert_close(got[0], want[0], jnp.bfloat16, what="out")
        _assert_close(got[1], want[1], jnp.bfloat16, floor=2e-3, what="dq")
        assert not np.asarray(got[4]).any()


@pytest.mark.gpu
def test_varlen_gradients_equal_the_dense_calls(command_buffer):
    """flash_attention_varlen of three packed sequences (one empty): each sequence's out
    and gradients against the jax.numpy attention of that sequence alone."""
    device = _gpu()
    lengths_q, lengths_k = [37, 0, 64], [50, 16, 64]
    with jax.default_device(device):
        cu_q = jnp.asarray(np.cumsum([0] + lengths_q), jnp.int32)
        cu_k = jnp.asarray(np.cumsum([0] + lengths_k), jnp.int32)
        q, k, v, dout = _inputs(10, (sum(lengths_q), 4, 64), (sum(lengths_k), 2, 64))

        def packed(q, k, v):
            return cjax.flash_attention_varlen(q, k, v, cu_q, cu_k, 64, 64, causal=True)

        out, dq, dk, dv = _grads(jax.jit(packed), q, k, v, dout)
        for b in range(3):
            sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
            sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
            f32 = [x[None].astype(jnp.float32) for x in (q[sq], k[sk], v[sk])]
            want = _grads(lambda q, k, v: jax_attention(q, k, v, scale=0.125, causal=True),
                          *f32, dout[sq][None].astype(jnp.float32))
            for name, g, w in zip(("out", "dq", "dk", "dv"),
                                  (out[sq], dq[sq], dk[sk], dv[sk]), want):
                _assert_close(g, w[0], jnp.bfloat16, floor=2e-3, what=f"{name}, sequence {b}")


@pytest.mark.gpu
@pytest.mark.parametrize("mapped", ["all", "q only"])
def test_vmap_of_grad_equals_the_unmapped_calls(mapped, command_buffer):
    device = _gpu()
    with jax.default_device(device):
        q, k, v, dout = _inputs(11, (3, 2, 64, 4, 64), (3, 2, 64, 2, 64))
        kv_axis = 0 if mapped == "all" else None
        if kv_axis is None:
            k, v = k[0], v[0]

        def loss(q, k, v, dout):
            out = cjax.flash_attention(q, k, v, causal=True)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

        grad = jax.grad(loss, argnums=(0, 1, 2))
        batched = jax.jit(jax.vmap(grad, in_axes=(0, kv_axis, kv_axis, 0)))(q, k, v, dout)
        for i in range(q.shape[0]):
            ki, vi = (k[i], v[i]) if kv_axis == 0 else (k, v)
            alone = jax.jit(grad)(q[i], ki, vi, dout[i])
            np.testing.assert_array_equal(np.asarray(batched[0][i]), np.asarray(alone[0]))
            if kv_axis == 0:
                np.testing.assert_array_equal(np.asarray(batched[1][i]), np.asarray(alone[1]))


@pytest.mark.gpu
def test_repeated_jitted_steps_give_the_same_bits(command_buffer):
    """A jitted value-and-grad called many times (XLA replays its command buffer after the
    first calls): every call's gradients the same bits as the first's."""
    device = _gpu()
    with jax.default_device(device):
        q, k, v, dout = _inputs(12, (2, 256, 8, 128), (2, 256, 2, 128))

        @jax.jit
        def step(q, k, v):
            def loss(q, k, v):
                out = cjax.flash_attention(q, k, v, causal=True, deterministic=True)
                return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

        first = jax.block_until_ready(step(q, k, v))
        for _ in range(20):
            again = step(q, k, v)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # new values in the same shapes: the replayed program reads them
        moved = step(q * 2, k, v)
        assert not np.array_equal(np.asarray(moved[1][0]), np.asarray(first[1][0]))


# ---- GPU: FP8, the same bits as cuattn's own forward ----------------------------------------

def _hopper():
    device = _gpu()
    from cuattn import tuning
    from cuattn.jit import device_info
    if device_info(0).arch != tuning.SM90_ARCH:
        pytest.skip("the FP8 forward runs on sm_90 devices")
    return device


def _fp8_host(seed, shape_q, shape_kv, shape_descale):
    """q, k, v NumPy float8_e4m3fn arrays and three float32 descales (None: none)."""
    rng = np.random.default_rng(seed)
    qkv = [(rng.standard_normal(s) * 2).astype(np.float32).astype(jnp.float8_e4m3fn)
           for s in (shape_q, shape_kv, shape_kv)]
    descales = [None if shape_descale is None else
                rng.uniform(0.5, 1.5, shape_descale).astype(np.float32) for _ in range(3)]
    return qkv, descales


def _on_cupy(x):
    import cupy as cp
    if x is None:
        return None
    if x.dtype == np.dtype(jnp.float8_e4m3fn):
        return cp.asarray(x.view(np.uint8)).view(x.dtype)
    return cp.asarray(x)


def _assert_same_bits(got, want, what):
    import cupy as cp
    got, want = np.asarray(got), cp.asnumpy(want)
    assert got.dtype == want.dtype == np.dtype(jnp.bfloat16), what
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=what)


FP8_CASES = [
    dict(name="plain", shape=(2, 128, 4, 128), kv=(2, 128, 4, 128)),
    dict(name="causal", shape=(2, 128, 4, 128), kv=(2, 160, 4, 128), causal=True),
    dict(name="causal GQA", shape=(1, 200, 8, 128), kv=(1, 200, 2, 128), causal=True),
    dict(name="GQA window hd64", shape=(2, 96, 8, 64), kv=(2, 160, 2, 64), window=(32, 8)),
    dict(name="GQA softcap hd256", shape=(1, 64, 4, 256), kv=(1, 64, 2, 256), causal=True,
         softcap=20.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c["name"])
def test_fp8_equals_flash_forward(case, descales, command_buffer):
    """jax.jit(flash_attention) on float8_e4m3fn arrays: bfloat16, the same bits as
    cuattn.flash_forward on the same inputs, on the first call and on a later one (XLA
    replays its command buffer)."""
    device = _hopper()
    batch, nkv = case["kv"][0], case["kv"][2]
    qkv, ds = _fp8_host(30, case["shape"], case["kv"], (batch, nkv) if descales else None)
    options = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
                   softcap=case.get("softcap", 0.0))
    want = cuattn.flash_forward(*map(_on_cupy, qkv), **options,
                                **dict(zip(DESCALES, map(_on_cupy, ds))))
    with jax.default_device(device):
        args = [None if x is None else jnp.asarray(x) for x in qkv + ds]

        @jax.jit
        def ours(q, k, v, qd, kd, vd):
            return cjax.flash_attention(q, k, v, **options, q_descale=qd, k_descale=kd,
                                        v_descale=vd)

        first = ours(*args)
        for _ in range(3):
            again = ours(*args)
    _assert_same_bits(first, want, f"{case['name']} first call")
    _assert_same_bits(again, want, f"{case['name']} replayed")


@pytest.mark.gpu
@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
def test_fp8_varlen_equals_flash_varlen_forward(descales, command_buffer):
    """flash_attention_varlen in FP8 (three sequences, one empty, GQA, causal): the bits of
    cuattn.flash_varlen_forward."""
    device = _hopper()
    lengths_q, lengths_k = [37, 0, 64], [50, 16, 64]
    cu_q = np.cumsum([0] + lengths_q).astype(np.int32)
    cu_k = np.cumsum([0] + lengths_k).astype(np.int32)
    qkv, ds = _fp8_host(31, (sum(lengths_q), 8, 128), (sum(lengths_k), 2, 128),
                        (3, 2) if descales else None)
    want = cuattn.flash_varlen_forward(*map(_on_cupy, qkv), _on_cupy(cu_q), _on_cupy(cu_k),
                                       64, 64, causal=True,
                                       **dict(zip(DESCALES, map(_on_cupy, ds))))
    with jax.default_device(device):
        args = [None if x is None else jnp.asarray(x) for x in qkv + ds]
        cu = jnp.asarray(cu_q), jnp.asarray(cu_k)
        got = jax.jit(lambda q, k, v, qd, kd, vd: cjax.flash_attention_varlen(
            q, k, v, *cu, 64, 64, causal=True, q_descale=qd, k_descale=kd,
            v_descale=vd))(*args)
    _assert_same_bits(got, want, "varlen")


@pytest.mark.gpu
@pytest.mark.parametrize("mapped", ["all", "descales unmapped"])
def test_fp8_vmap_equals_flash_forward(mapped):
    """jax.vmap of an FP8 call: mapped descales fold into the batch with q, k, v (one call,
    the bits of flash_forward over the folded batch); unmapped ones run per element."""
    device = _hopper()
    fold = mapped == "all"
    qkv, ds = _fp8_host(32, (3, 2, 128, 4, 128), (3, 2, 128, 2, 128),
                        (3, 2, 2) if fold else (2, 2))
    if fold:
        flat = [x.reshape((6,) + x.shape[2:]) for x in qkv + ds]
        want = cuattn.flash_forward(*map(_on_cupy, flat[:3]), causal=True,
                                    **dict(zip(DESCALES, map(_on_cupy, flat[3:]))))
        wants = [want[2 * i:2 * i + 2] for i in range(3)]
    else:
        wants = [cuattn.flash_forward(*(_on_cupy(x[i]) for x in qkv), causal=True,
                                      **dict(zip(DESCALES, map(_on_cupy, ds))))
                 for i in range(3)]
    with jax.default_device(device):
        args = [jnp.asarray(x) for x in qkv + ds]
        d_axis = 0 if fold else None
        got = jax.jit(jax.vmap(lambda q, k, v, qd, kd, vd: cjax.flash_attention(
            q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd),
            in_axes=(0, 0, 0) + (d_axis,) * 3))(*args)
    for i in range(3):
        _assert_same_bits(got[i], wants[i], f"element {i}")
