"""merge_attn_states / merge_states against the float64 NumPy reference."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

import cuattn
from tests.reference import merge_reference, tolerance

DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
INF = np.inf


# -- CPU: the reference and the checks that need no device ---------------------------------

def test_reference_formula():
    o = np.stack([np.full((1, 1, 8), 1.0), np.full((1, 1, 8), 3.0)])
    lse = np.array([[[0.0]], [[0.0]]])
    out, l = merge_reference(o, lse)
    assert np.allclose(out, 2.0) and np.isclose(l[0, 0], np.log(2.0))
    out, l = merge_reference(o, np.array([[[-INF]], [[INF]]]))      # both empty
    assert np.all(out == 0) and l[0, 0] == -INF
    out, l = merge_reference(o, np.array([[[5.0]], [[-INF]]]))      # one side empty
    assert np.allclose(out, 1.0) and l[0, 0] == 5.0


# -- GPU ------------------------------------------------------------------------------------

def _inputs(rng, k, t, h, d, dtype, lse_choices=None):
    cp = pytest.importorskip("cupy")
    outs = rng.standard_normal((k, t, h, d)).astype(DTYPES[dtype])
    lses = (rng.standard_normal((k, h, t)) * 3).astype(np.float32)
    if lse_choices is not None:
        for i, choice in enumerate(lse_choices):
            if choice is not None:
                lses[i] = choice
    return outs, lses, cp.asarray(outs), cp.asarray(lses)


def _check(out, out_lse, outs, lses, dtype):
    """FlashAttention's tolerance: 2x the error of the same math rounded to ``dtype``."""
    ref, ref_lse = merge_reference(outs, lses)
    lowp = ref.astype(DTYPES[dtype]).astype(np.float64)    # the best a 16-bit output can do
    got = out.get().astype(np.float64)
    got_lse = out_lse.get().astype(np.float64)
    assert np.isfinite(got).all(), "NaN/inf in out (unwritten or empty-state leak)"
    err = np.abs(got - ref).max(initial=0)
    assert err <= tolerance(np.abs(lowp - ref).max(initial=0), 1e-3), err
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.allclose(got_lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert not np.isnan(got_lse).any()


def _poisoned(cp, shape, dtype):
    return cp.full(shape, np.nan, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("head_size", [8, 64, 80, 128, 256, 512])
def test_merge_pair(rng, dtype, head_size):
    import cupy as cp
    t, h = 37, 5
    outs, lses, d_outs, d_lses = _inputs(rng, 2, t, h, head_size, dtype)
    out = _poisoned(cp, (t, h, head_size), DTYPES[dtype])
    out_lse = _poisoned(cp, (h, t), np.float32)
    res = cuattn.merge_attn_states(d_outs[0], d_lses[0], d_outs[1], d_lses[1],
                                   out=out, out_lse=out_lse)
    assert res[0] is out and res[1] is out_lse
    _check(out, out_lse, outs, lses, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("a,b", list(itertools.product([-INF, INF, 0.0, 50.0], repeat=2)))
def test_merge_pair_every_inf_combination(rng, a, b):
    """+/-inf marks an empty side; empty sides hold NaN outputs to prove they are not read."""
    import cupy as cp
    t, h, d = 9, 3, 64
    outs, lses, _, _ = _inputs(rng, 2, t, h, d, "bf16")
    lses[0, :, ::2] = a          # every other token takes the combination under test
    lses[1, :, ::2] = b
    for i, v in ((0, a), (1, b)):
        if np.isinf(v):
            outs[i, ::2] = np.nan
    d_outs, d_lses = cp.asarray(outs), cp.asarray(lses)
    out, out_lse = cuattn.merge_attn_states(d_outs[0], d_lses[0], d_outs[1], d_lses[1])
    _check(out, out_lse, np.where(np.isnan(outs), 0, outs), lses, "bf16")


@pytest.mark.gpu
def test_merge_pair_strided_views(rng):
    """Outputs as (T, H, D) views of (B, H, S, D)-style storage, lse as transposed views."""
    import cupy as cp
    t, h, d = 50, 4, 128
    big = cp.asarray(rng.standard_normal((2, h * 2, t, d)).astype(ml_dtypes.bfloat16))
    a = big[0, ::2].transpose(1, 0, 2)             # (t, h, d), strides (d, 2*t*d, 1)
    b = big[1, 1::2].transpose(1, 0, 2)
    la = cp.asarray(rng.standard_normal((t, h)).astype(np.float32)).T     # (h, t) transposed
    lb = cp.asarray(rng.standard_normal((h, t * 3)).astype(np.float32))[:, ::3]
    out_store = _poisoned(cp, (h, t, d), ml_dtypes.bfloat16)
    out = out_store.transpose(1, 0, 2)
    lse_store = _poisoned(cp, (t, h), np.float32)
    out, out_lse = cuattn.merge_attn_states(a, la, b, lb, out=out, out_lse=lse_store.T)
    outs = np.stack([a.get(), b.get()])
    lses = np.stack([la.get(), lb.get()])
    _check(out, out_lse, outs, lses, "bf16")
    assert not cp.isnan(out_store.astype(np.float32)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_merge_states_stacked(rng, k, dtype):
    import cupy as cp
    t, h, d = 129, 3, 128
    outs, lses, _, _ = _inputs(rng, k, t, h, d, dtype)
    if k > 2:
        lses[1, :, ::3] = INF       # some empty states in the middle of the stack
        lses[2, :, 1::3] = -INF
        outs[1, ::3] = np.nan
        outs[2, 1::3] = np.nan
    lses[:, 0, 5] = -INF            # one row where every state is empty
    outs[:, 5, 0] = np.nan
    d_outs, d_lses = cp.asarray(outs), cp.asarray(lses)
    out = _poisoned(cp, (t, h, d), DTYPES[dtype])
    out, out_lse = cuattn.merge_states(d_outs, d_lses, out=out)
    _check(out, out_lse, np.where(np.isnan(outs), 0, outs), lses, dtype)
    assert np.all(out.get()[5, 0].astype(np.float32) == 0) and out_lse.get()[0, 5] == -INF


@pytest.mark.gpu
def test_merge_is_deterministic_and_empty_inputs_are_fine(rng):
    import cupy as cp
    _, _, d_outs, d_lses = _inputs(rng, 3, 64, 8, 128, "bf16")
    a = cuattn.merge_states(d_outs, d_lses)
    b = cuattn.merge_states(d_outs, d_lses)
    assert cp.array_equal(a[0].view(np.uint16), b[0].view(np.uint16))
    assert cp.array_equal(a[1], b[1])
    out, lse = cuattn.merge_states(d_outs[:, :0], d_lses[:, :, :0])
    assert out.shape == (0, 8, 128) and lse.shape == (8, 0)


@pytest.mark.gpu
def test_merge_runs_on_the_given_stream(rng):
    import cupy as cp
    _, _, d_outs, d_lses = _inputs(rng, 2, 64, 8, 128, "f16")
    stream = cp.cuda.Stream(non_blocking=True)
    expected = cuattn.merge_attn_states(d_outs[0], d_lses[0], d_outs[1], d_lses[1])
    cp.cuda.Device().synchronize()   # (the inputs' copies: stream does not wait for them)
    got = cuattn.merge_attn_states(d_outs[0], d_lses[0], d_outs[1], d_lses[1], stream=stream)
    stream.synchronize()
    assert cp.array_equal(expected[0].view(np.uint16), got[0].view(np.uint16))


@pytest.mark.gpu
def test_merge_captured_in_a_cuda_graph_replays_with_new_data(rng):
    import cupy as cp
    outs, lses, d_outs, d_lses = _inputs(rng, 2, 33, 4, 128, "bf16")
    out = cp.empty((33, 4, 128), dtype=ml_dtypes.bfloat16)
    out_lse = cp.empty((4, 33), dtype=np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.merge_attn_states(d_outs[0], d_lses[0], d_outs[1], d_lses[1], out=out,
                                 out_lse=out_lse)      # load outside the capture
        stream.begin_capture()
        cuattn.merge_attn_states(d_outs[0], d_lses[0], d_outs[1], d_lses[1], out=out,
                                 out_lse=out_lse)
        graph = stream.end_capture()
    new_outs, new_lses, _, _ = _inputs(rng, 2, 33, 4, 128, "bf16")
    d_outs.set(new_outs)
    d_lses.set(new_lses)
    out.fill(np.nan)
    cp.cuda.Device().synchronize()   # (the replay's stream does not wait for the legacy one)
    graph.launch(stream)
    stream.synchronize()
    _check(out, out_lse, new_outs, new_lses, "bf16")
