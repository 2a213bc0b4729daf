"""cuattn.torch: flash_attn_func / flash_attn_varlen_func eagerly, under torch.compile and in
CUDA-graph capture. Skips without torch.

- CPU (plumbing): the custom ops' schemas, fake implementations and autograd formula
  (torch.library.opcheck, eager backward, torch.compile), with CPU kernels registered
  for the ops here: plain torch math standing in for cuattn's kernels. FP8: the op's
  bfloat16 output and descales, the backward that refuses, bad FP8 inputs.
- GPU: the real kernels on torch's current stream against SDPA's math backend in float32,
  by the project's tolerance rule (tests/reference.py). FP8 (sm_90 only): the same bits
  as cuattn.flash_forward / flash_varlen_forward on the same tensors, eagerly, compiled
  and in CUDA-graph capture.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuattn._checks import DESCALES
from tests.reference import grad_tolerance, tolerance

torch = pytest.importorskip("torch", exc_type=ImportError)
ct = pytest.importorskip("cuattn.torch", exc_type=ImportError)
F = torch.nn.functional
FP8 = torch.float8_e4m3fn


def _attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """Attention as plain torch math (float32 in, float32 out): q (B, sq, H, D), k / v
    (B, sk, Hkv, D); the bottom-right aligned causal mask and window of cuattn."""
    sq, sk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window
    right = 0 if causal else right
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        seen &= j <= pos + right
    if left >= 0:
        seen &= j >= pos - left
    s = s.masked_fill(~seen.to(s.device), -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


# ---- CPU: the ops' plumbing with stand-in kernels -------------------------------------------

def _cpu_scores(q, k, scale, causal):
    """Softmax probabilities (B, H, sq, sk) in float32, GQA's kv heads repeated."""
    k = k.float().repeat_interleave(q.shape[2] // k.shape[2], 2)
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    if causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1),
                                    -math.inf)
    return logits


def _dequantized(x, descale):
    """An FP8 x (B, s, H, D) in float32 times its KV head's descale (B, Hkv) (None: 1)."""
    x = x.float()
    if descale is None:
        return x
    return x * descale.repeat_interleave(x.shape[2] // descale.shape[1], 1)[:, None, :, None]


def _cpu_forward(q, k, v, alibi_slopes, scale, causal, left, right, softcap, deterministic,
                 q_descale=None, k_descale=None, v_descale=None):
    """Stand-in for cuattn's forward (plain or causal attention, the ops' outputs; FP8:
    of the dequantized inputs, out bfloat16)."""
    out = torch.empty_like(q, dtype=torch.bfloat16 if q.dtype == FP8 else q.dtype)
    if q.dtype == FP8:
        q, k, v = (_dequantized(x, d) for x, d in ((q, q_descale), (k, k_descale),
                                                     (v, v_descale)))
    logits = _cpu_scores(q, k, scale, causal)
    vv = v.float().repeat_interleave(q.shape[2] // k.shape[2], 2)
    out.copy_(torch.einsum("bhqk,bkhd->bqhd", torch.softmax(logits, -1), vv))
    return out, torch.logsumexp(logits, -1).contiguous()


def _cpu_backward(dout, q, k, v, out, lse, alibi_slopes, scale, causal, left, right, softcap,
                  deterministic):
    """Stand-in for cuattn's backward: FlashAttention-2's formulas, GQA summed."""
    group = q.shape[2] // k.shape[2]
    p = torch.softmax(_cpu_scores(q, k, scale, causal), -1)
    kk, vv = (x.float().repeat_interleave(group, 2) for x in (k, v))
    do = dout.float()
    d = (do * out.float()).sum(-1).transpose(1, 2)[..., None]               # (B, H, sq, 1)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vv) - d)
    grads = (torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale,
             torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale,
             torch.einsum("bhqk,bqhd->bkhd", p, do))
    results = tuple(torch.empty_like(x) for x in (q, k, v))
    for r, g in zip(results, grads):
        r.copy_(g if r.shape == g.shape else g.unflatten(2, (k.shape[2], group)).sum(3))
    return results


@pytest.fixture(scope="module")
def cpu_kernels():
    torch.library.register_kernel("cuattn::flash_fwd", "cpu", _cpu_forward)
    torch.library.register_kernel("cuattn::flash_bwd", "cpu", _cpu_backward)


CU = torch.tensor([0, 3, 6], dtype=torch.int32)       # two sequences of _qkv's six rows


def _qkv(device, dtype=torch.bfloat16, shape_q=(2, 6, 4, 16), shape_kv=(2, 6, 2, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
            for s in (shape_q, shape_kv, shape_kv)]


def test_ops_pass_opcheck(cpu_kernels):
    """Schema, fake implementation (shapes and strides), autograd registration and
    AOT dispatch of cuattn::flash_fwd and cuattn::flash_bwd."""
    q, k, v = (x.detach() for x in _qkv("cpu"))
    options = (0.25, True, -1, 0, 0.0, False)
    torch.library.opcheck(torch.ops.cuattn.flash_fwd.default, (q, k, v, None) + options)
    out, lse = torch.ops.cuattn.flash_fwd(q, k, v, None, *options)
    torch.library.opcheck(torch.ops.cuattn.flash_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, None) + options)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_op_gradients_flow(cpu_kernels, compiled):
    """The autograd formula of cuattn::flash_fwd: q, k, v get the backward op's gradients
    (eagerly and through torch.compile's AOT autograd); lse gets none."""
    q, k, v = _qkv("cpu")

    def f(q, k, v):
        return torch.ops.cuattn.flash_fwd(q, k, v, None, 0.25, True, -1, 0, 0.0, False)

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    out, lse = fn(q, k, v)
    assert not lse.requires_grad
    out.float().square().sum().backward()
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    _attention(qf, kf, vf, 0.25, causal=True).square().sum().backward()
    for name, a, b in zip("qkv", (q, k, v), (qf, kf, vf)):
        assert torch.allclose(a.grad.float(), b.grad, atol=5e-2, rtol=2e-2), name


# ---- CPU: FP8 plumbing ----------------------------------------------------------------------

def _fp8_qkv(device, shape_q=(2, 6, 4, 16), shape_kv=(2, 6, 2, 16), descales=True, seed=0):
    """q, k, v float8_e4m3fn and three float32 descales (batch, nheads_kv) (or None), each
    in its own range, so that a swapped v_descale shows."""
    g = torch.Generator().manual_seed(seed)
    qkv = [(torch.randn(s, generator=g) * 3).to(FP8).to(device)
           for s in (shape_q, shape_kv, shape_kv)]
    shape_d = (shape_kv[0], shape_kv[2]) if len(shape_kv) == 4 else None
    ds = [None if not descales else
          (torch.rand(shape_d, generator=g) * 0.5 + lo).to(device) for lo in (0.1, 0.7, 1.5)]
    return qkv, ds


@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
def test_fp8_op_passes_opcheck(cpu_kernels, descales):
    """cuattn::flash_fwd with float8_e4m3fn inputs and the descales: schema, the fake's
    bfloat16 output, AOT dispatch; the stand-in's result is the dequantized attention."""
    qkv, ds = _fp8_qkv("cpu", descales=descales)
    options = (0.25, True, -1, 0, 0.0, False)
    # (not test_schema: it compares the inputs before and after the call by arithmetic
    # that torch's CPU kernels lack for float8)
    torch.library.opcheck(torch.ops.cuattn.flash_fwd.default, (*qkv, None, *options, *ds),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    out, lse = torch.ops.cuattn.flash_fwd(*qkv, None, *options, *ds)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = _attention(*(_dequantized(x, d) for x, d in zip(qkv, ds)), 0.25, causal=True)
    assert torch.allclose(out.float(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_backward_raises_when_it_runs(cpu_kernels, compiled):
    """FP8 is forward-only (FlashAttention-3's is): a forward on inputs that require grad
    runs (under torch.compile too, its backward traced through the refusing op's fake),
    and the backward raises RuntimeError naming float8_e4m3fn."""
    qkv, ds = _fp8_qkv("cpu")
    q, k, v = (x.requires_grad_() for x in qkv)

    def f(q, k, v):
        return torch.ops.cuattn.flash_fwd(q, k, v, None, 0.25, False, -1, -1, 0.0, False, *ds)

    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    out, lse = fn(q, k, v)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        out.float().sum().backward()


def _fp8(*xs):
    return [x.to(FP8) for x in xs]


@pytest.mark.parametrize("call,error,name", [
    (lambda q, k, v: ct.flash_attn_func(q, k, v, dropout_p=0.1), ValueError, "dropout_p"),
    (lambda q, k, v: ct.flash_attn_func(q, k, v, causal=1), TypeError, "causal"),
    (lambda q, k, v: ct.flash_attn_func(q, k, v, window_size=(-2, 0)), ValueError, "window_size"),
    (lambda q, k, v: ct.flash_attn_func(q, k, v, softcap=-1.0), ValueError, "softcap"),
    (lambda q, k, v: ct.flash_attn_func(q, k, v, softmax_scale=0.0), ValueError, "softmax_scale"),
    (lambda q, k, v: ct.flash_attn_func(q[0], k, v), ValueError, "q"),
    (lambda q, k, v: ct.flash_attn_func(q.float().numpy(), k, v), TypeError, "q"),
    (lambda q, k, v: ct.flash_attn_func(q, k, v), ValueError, "q"),             # on the CPU
    (lambda q, k, v: ct.flash_attn_varlen_func(q[0], k[0], v[0], CU, CU, 4, 4),
     ValueError, "q"),                                                         # on the CPU
    (lambda q, k, v: ct.flash_attn_varlen_func(q[0], k[0], v[0], None, None, 4, 4),
     TypeError, "cu_seqlens_q"),
    # FP8: checked before the device is
    (lambda q, k, v: ct.flash_attn_func(q.to(FP8), k, v), TypeError, "k"),      # mixed
    (lambda q, k, v: ct.flash_attn_func(*_fp8(q, k), v), TypeError, "v"),
    (lambda q, k, v: ct.flash_attn_func(*(x.to(torch.float8_e5m2) for x in (q, k, v))),
     TypeError, "q"),
    (lambda q, k, v: ct.flash_attn_func(q, k, v, q_descale=torch.ones(2, 2)),   # 16-bit
     ValueError, "q_descale"),
    (lambda q, k, v: ct.flash_attn_func(*_fp8(q, k, v), k_descale=torch.ones(2, 2).half()),
     TypeError, "k_descale"),
    (lambda q, k, v: ct.flash_attn_func(*_fp8(q, k, v), v_descale=[[1.0, 1.0]] * 2),
     TypeError, "v_descale"),
    (lambda q, k, v: ct.flash_attn_func(*_fp8(q, k, v), q_descale=torch.ones(2, 4)),
     ValueError, "q_descale"),                         # (batch, nheads_kv), not nheads
    (lambda q, k, v: ct.flash_attn_func(*_fp8(q, k, v), v_descale=torch.ones(2)),
     ValueError, "v_descale"),
    (lambda q, k, v: ct.flash_attn_varlen_func(*_fp8(q[0], k[0], v[0]), CU, CU, 3, 3,
                                               k_descale=torch.ones(1, 2)),
     ValueError, "k_descale"),                         # batch: len(cu_seqlens_q) - 1
    (lambda q, k, v: ct.flash_attn_func(*_fp8(q, k, v), q_descale=torch.ones(2, 2)),
     ValueError, "q"),                                 # all good but on the CPU
])
def test_bad_inputs_name_the_argument(call, error, name):
    q, k, v = (x.detach() for x in _qkv("cpu"))
    with pytest.raises(error, match=rf"^{name}: "):
        call(q, k, v)


# ---- GPU: the real kernels ------------------------------------------------------------------

def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")


def _check(got, want, lowp, what, floor=1e-3, grad=True):
    """The project's rule: the output by tolerance (2x), a gradient by grad_tolerance (3x)."""
    got, want, lowp = (x.detach().double().cpu() for x in (got, want, lowp))
    if got.numel() == 0:          # an empty sequence: nothing to compare
        return
    assert torch.isfinite(got).all(), f"{what}: NaN/inf"
    err = (got - want).abs().max().item()
    rule = grad_tolerance if grad else tolerance
    tol = rule((lowp - want).abs().max().item(), floor)
    assert err <= tol, f"{what}: max error {err} > {tol}"


def _outputs_and_grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout.to(out.dtype))
    return out, q.grad, k.grad, v.grad


GPU_CASES = [
    dict(name="plain", q=(2, 128, 4, 64), kv=(2, 128, 4, 64)),
    dict(name="causal", q=(2, 128, 4, 64), kv=(2, 128, 4, 64), causal=True),
    dict(name="causal GQA hd128", q=(1, 200, 8, 128), kv=(1, 200, 2, 128), causal=True),
    dict(name="window", q=(2, 96, 4, 64), kv=(2, 160, 4, 64), window=(32, 8)),
    dict(name="softcap", q=(2, 128, 4, 64), kv=(2, 128, 2, 64), causal=True, softcap=20.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c["name"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_gradients_against_sdpa_math(case, dtype):
    """out, dq, dk, dv of flash_attn_func against SDPA's math backend in float32 (the same
    attention in the input dtype sets the tolerance); softcap and windows, which SDPA does
    not take, against the same math written out in torch."""
    _cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = _qkv("cuda", dtype, case["q"], case["kv"], seed=1)
    dout = torch.randn_like(q)
    causal, window = case.get("causal", False), case.get("window", (-1, -1))
    softcap = case.get("softcap", 0.0)
    scale = 1 / math.sqrt(case["q"][-1])

    def ours(q, k, v):
        return ct.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)

    def theirs(q, k, v):
        if window != (-1, -1) or softcap:
            return _attention(q, k, v, scale, causal, window, softcap).to(q.dtype)
        group = q.shape[2] // k.shape[2]
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2),
                v.repeat_interleave(group, 2).transpose(1, 2), is_causal=causal,
                scale=scale).transpose(1, 2)

    got = _outputs_and_grads(ours, q, k, v, dout)
    want = _outputs_and_grads(theirs, *(x.float() for x in (q, k, v)), dout.float())
    lowp = _outputs_and_grads(theirs, q, k, v, dout)
    for name, g, w, lo in zip(("out", "dq", "dk", "dv"), got, want, lowp):
        _check(g, w, lo, f"{case['name']} {name}", grad=name != "out")


@pytest.mark.gpu
def test_return_attn_probs_and_lse():
    _cuda()
    q, k, v = _qkv("cuda", torch.bfloat16, (2, 64, 4, 64), (2, 64, 4, 64), seed=2)
    out, lse, probs = ct.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and lse.dtype == torch.float32 and lse.shape == (2, 4, 64)
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / 8
    logits = logits.masked_fill(torch.ones(64, 64, dtype=torch.bool, device="cuda").triu(1),
                                -math.inf)
    assert torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-3, rtol=1e-4)
    assert not lse.requires_grad and out.requires_grad


@pytest.mark.gpu
def test_varlen_gradients_equal_the_dense_calls():
    _cuda()
    lengths_q, lengths_k = [37, 0, 64], [50, 16, 64]
    cu_q = torch.tensor(np.cumsum([0] + lengths_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lengths_k), dtype=torch.int32, device="cuda")
    q, k, v = _qkv("cuda", torch.bfloat16, (sum(lengths_q), 4, 64), (sum(lengths_k), 2, 64), 3)
    dout = torch.randn_like(q)
    got = _outputs_and_grads(lambda q, k, v: ct.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 64, 64, causal=True), q, k, v, dout)
    for b in range(3):
        sq, sk = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        args = [x[None, s] for x, s in ((q, sq), (k, sk), (v, sk))]
        want = _outputs_and_grads(lambda q, k, v: _attention(q, k, v, 0.125, True),
                                  *(x.float() for x in args), dout[None, sq].float())
        lowp = _outputs_and_grads(lambda q, k, v: _attention(q, k, v, 0.125, True).to(q.dtype),
                                  *args, dout[None, sq])
        for name, g, w, lo, s in zip(("out", "dq", "dk", "dv"), got, want, lowp,
                                     (sq, sq, sk, sk)):
            _check(g[s], w[0], lo[0], f"{name} of sequence {b}", floor=2e-3, grad=name != "out")


@pytest.mark.gpu
def test_torch_compile_gives_the_eager_results():
    _cuda()
    q, k, v = _qkv("cuda", torch.bfloat16, (2, 128, 8, 64), (2, 128, 2, 64), seed=4)
    dout = torch.randn_like(q)

    def f(q, k, v):
        return ct.flash_attn_func(q, k, v, causal=True, deterministic=True) * 2

    eager = _outputs_and_grads(f, q, k, v, dout)
    compiled = _outputs_and_grads(torch.compile(f, fullgraph=True), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), name


def _captured(step):
    """(graph, its output): ``step`` run twice on a side stream (warm-up), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """A training step (forward and backward) captured in a torch.cuda.CUDAGraph after a
    warm-up on a side stream, replayed on new inputs copied into the same tensors: the
    same bits as the eager step. cuattn's own allocations (lse before its copy, scratch)
    come from the graph's private pool through torch's allocator."""
    _cuda()
    q, k, v = _qkv("cuda", torch.bfloat16, (2, 256, 8, 128), (2, 256, 2, 128), seed=5)
    dout = torch.randn_like(q)
    static = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def step():
        for x in static:
            x.grad = None
        out = ct.flash_attn_func(*static, causal=True, deterministic=True)
        out.backward(dout)
        return out

    graph, static_out = _captured(step)
    fresh = _qkv("cuda", torch.bfloat16, (2, 256, 8, 128), (2, 256, 2, 128), seed=6)
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
    graph.replay()
    eager = _outputs_and_grads(lambda q, k, v: ct.flash_attn_func(q, k, v, causal=True,
                                                                  deterministic=True),
                               *fresh, dout)
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager[0])
    for name, s, e in zip("qkv", static, eager[1:]):
        assert torch.equal(s.grad, e), f"d{name}"


@pytest.mark.gpu
def test_runs_on_torch_current_stream():
    """On a side stream: every launch goes to it (the null stream never waits on it), and
    the result equals the default stream's."""
    _cuda()
    q, k, v = (x.detach() for x in _qkv("cuda", torch.bfloat16, (1, 512, 8, 64),
                                        (1, 512, 8, 64), seed=7))
    want = ct.flash_attn_func(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = ct.flash_attn_func(q, k, v, causal=True)
    side.synchronize()
    assert torch.equal(got, want)


# ---- GPU: FP8, the same bits as cuattn's own forward ----------------------------------------

def _hopper():
    _cuda()
    from cuattn import tuning
    from cuattn.jit import device_info
    if device_info(torch.cuda.current_device()).arch != tuning.SM90_ARCH:
        pytest.skip("the FP8 forward runs on sm_90 devices")


def _cuattn_fp8(q, k, v, descales, *lengths, **options):
    """(out, lse) of cuattn.flash_forward (flash_varlen_forward with ``lengths``: cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) on CuPy views of the same tensors."""
    import cupy
    import cuattn
    views = [ct._view(x) if isinstance(x, torch.Tensor) else x for x in lengths]
    call = cuattn.flash_varlen_forward if lengths else cuattn.flash_forward
    torch.cuda.synchronize()
    with cupy.cuda.Device(q.device.index):
        out, lse = call(ct._view(q), ct._view(k), ct._view(v), *views, return_lse=True,
                        **dict(zip(DESCALES, map(ct._view, descales))), **options)
        cupy.cuda.get_current_stream().synchronize()
    return out, lse


def _assert_same_bits(got, want, what):
    """A torch bfloat16 (or float32) tensor and a CuPy array: the same bits."""
    import cupy
    want = cupy.asnumpy(want)
    assert got.shape == want.shape, what
    if got.dtype == torch.bfloat16:
        got, want = got.view(torch.int16).cpu().numpy(), want.view(np.int16)
    else:
        got, want = got.cpu().numpy().view(np.int32), want.view(np.int32)
    np.testing.assert_array_equal(got, want, err_msg=what)


FP8_CASES = [
    dict(name="plain", q=(2, 128, 4, 128), kv=(2, 128, 4, 128)),
    dict(name="causal", q=(2, 128, 4, 128), kv=(2, 160, 4, 128), causal=True),
    dict(name="causal GQA", q=(1, 200, 8, 128), kv=(1, 200, 2, 128), causal=True),
    dict(name="GQA window hd64", q=(2, 96, 8, 64), kv=(2, 160, 2, 64), window=(32, 8)),
    dict(name="GQA softcap alibi hd256", q=(1, 64, 4, 256), kv=(1, 64, 2, 256), causal=True,
         softcap=20.0, alibi=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c["name"])
def test_fp8_equals_flash_forward(case, descales):
    """flash_attn_func on float8_e4m3fn tensors: out bfloat16 and lse, the same bits as
    cuattn.flash_forward on the same tensors."""
    _hopper()
    (q, k, v), ds = _fp8_qkv("cuda", case["q"], case["kv"], descales, seed=40)
    alibi = (torch.linspace(0.05, 0.4, case["q"][2], device="cuda")
             if case.get("alibi") else None)
    options = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
                   softcap=case.get("softcap", 0.0))
    out, lse, _ = ct.flash_attn_func(q, k, v, **options, alibi_slopes=alibi,
                                     return_attn_probs=True,
                                     **dict(zip(DESCALES, ds)))
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    want_out, want_lse = _cuattn_fp8(q, k, v, ds, **options, alibi_slopes=ct._view(alibi))
    _assert_same_bits(out, want_out, f"{case['name']} out")
    _assert_same_bits(lse, want_lse, f"{case['name']} lse")


@pytest.mark.gpu
@pytest.mark.parametrize("descales", [True, False], ids=["descales", "no-descales"])
def test_fp8_varlen_equals_flash_varlen_forward(descales):
    """flash_attn_varlen_func in FP8 (three sequences, one empty, GQA, causal): the bits of
    cuattn.flash_varlen_forward."""
    _hopper()
    lengths_q, lengths_k = [37, 0, 64], [50, 16, 64]
    cu_q = torch.tensor(np.cumsum([0] + lengths_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lengths_k), dtype=torch.int32, device="cuda")
    (q, k, v), _ = _fp8_qkv("cuda", (sum(lengths_q), 8, 128), (sum(lengths_k), 2, 128),
                            descales=False, seed=41)
    ds = [torch.rand(3, 2, device="cuda") + 0.5 if descales else None for _ in range(3)]
    out, lse, _ = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True,
                                            return_attn_probs=True,
                                            **dict(zip(DESCALES, ds)))
    want_out, want_lse = _cuattn_fp8(q, k, v, ds, cu_q, cu_k, 64, 64, causal=True)
    _assert_same_bits(out, want_out, "varlen out")
    _assert_same_bits(lse, want_lse, "varlen lse")


@pytest.mark.gpu
def test_fp8_torch_compile_gives_the_eager_results():
    _hopper()
    (q, k, v), ds = _fp8_qkv("cuda", (2, 128, 8, 128), (2, 128, 2, 128), seed=42)

    def f(q, k, v, qd, kd, vd):
        return ct.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                  v_descale=vd)

    eager = f(q, k, v, *ds)
    compiled = torch.compile(f, fullgraph=True)(q, k, v, *ds)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)


@pytest.mark.gpu
def test_fp8_cuda_graph_capture_and_replay():
    """An FP8 forward captured in a torch.cuda.CUDAGraph (after a warm-up on a side
    stream), replayed on new inputs and descales copied into the same tensors: the bits
    of cuattn.flash_forward on those inputs."""
    _hopper()
    (q, k, v), ds = _fp8_qkv("cuda", (2, 256, 8, 128), (2, 256, 2, 128), seed=43)
    static = [x.clone() for x in (q, k, v, *ds)]

    def step():
        return ct.flash_attn_func(*static[:3], causal=True,
                                  **dict(zip(DESCALES, static[3:])))

    graph, static_out = _captured(step)
    (q2, k2, v2), ds2 = _fp8_qkv("cuda", (2, 256, 8, 128), (2, 256, 2, 128), seed=44)
    for s, f in zip(static, (q2, k2, v2, *ds2)):
        s.copy_(f)
    graph.replay()
    want, _ = _cuattn_fp8(q2, k2, v2, ds2, causal=True)
    _assert_same_bits(static_out, want, "replayed out")


@pytest.mark.gpu
def test_fp8_backward_is_refused():
    """FP8 inputs that require grad: the forward runs, its backward raises RuntimeError
    (FlashAttention-3's FP8 has no backward); under torch.no_grad() nothing is recorded."""
    _hopper()
    (q, k, v), ds = _fp8_qkv("cuda", (1, 64, 4, 128), (1, 64, 2, 128), seed=45)
    q.requires_grad_()
    out = ct.flash_attn_func(q, k, v, **dict(zip(DESCALES, ds)))
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not ct.flash_attn_func(q, k, v).requires_grad


@pytest.mark.gpu
def test_fp8_descales_on_the_host_are_refused():
    """Where the tensors are is checked before any launch (any CUDA GPU)."""
    _cuda()
    (q, k, v), ds = _fp8_qkv("cuda", (1, 64, 4, 128), (1, 64, 2, 128), seed=46)
    with pytest.raises(ValueError, match="^k_descale: "):
        ct.flash_attn_func(q, k, v, k_descale=ds[1].cpu())
