"""What softcap costs a peer (session 17; bench/NOTES.md). From the repository root, on a
GPU with torch and Triton: PYTHONPATH=. python bench/lab/softcap_peer.py

FlexAttention (torch.compile, Triton) with and without a softcap score_mod (torch.tanh, and
tanh.approx.f32 through an inline-PTX op), beside cuattn.flash_forward with and without
softcap=30, on the same inputs (DLPack views), hd128 S4096 B4 H32 full and causal, bf16.
Kernel-only for both (CUDA-graph replays), settled 0.3 s, 3 rounds in turn; median per
call."""
import sys, time, statistics
sys.path.insert(0, ".")
import cupy
import cuattn
from bench.harness import randn, CupyGraph
from bench import torch_peers
tt = torch_peers.load()
torch = tt.torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
flex = torch.compile(flex_attention, dynamic=False)
B, S, H, D = 4, 4096, 32, 128
q, k, v = (randn(B, S, H, D) for _ in range(3))
out = cupy.empty_like(q)
tq, tk, tv = torch_peers.bhsd_views(tt, q, k, v)
CAP = 30.0
def softcap_mod(score, b, h, qi, ki):
    return CAP * torch.tanh(score / CAP)
# The same with tanh.approx.f32 (one MUFU op, as cuattn's hook): an opaque op that Inductor
# lowers to inline PTX (the approach of attention-gym's softcapping mod).
try:
    from functools import partial
    from torch._inductor.lowering import make_pointwise, register_lowering
    from torch._inductor.virtualized import ops
    @torch.library.custom_op("lab::tanh_approx", mutates_args=())
    def tanh_approx(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)
    @tanh_approx.register_fake
    def _(x):
        return torch.empty_like(x)
    register_lowering(torch.ops.lab.tanh_approx)(
        lambda x: make_pointwise(partial(ops.inline_asm_elementwise,
                                         asm="tanh.approx.f32 $0, $1;"))(x))
except Exception as exc:
    print(f"approx tanh op not registered: {exc!r:.300}", flush=True)
    tanh_approx = None
def softcap_approx_mod(score, b, h, qi, ki):
    return CAP * tanh_approx(score / CAP)
causal_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
flops_full = 4 * B * H * S * S * D
for causal in (False, True):
    bm = causal_mask if causal else None
    calls = {
        "cuattn": (lambda: cuattn.flash_forward(q, k, v, causal=causal, out=out), "cupy"),
        "cuattn softcap": (lambda: cuattn.flash_forward(q, k, v, causal=causal, softcap=CAP, out=out), "cupy"),
        "flex": (lambda: flex(tq, tk, tv, block_mask=bm), "torch"),
        "flex softcap": (lambda: flex(tq, tk, tv, score_mod=softcap_mod, block_mask=bm), "torch"),
        "flex softcap approx": (lambda: flex(tq, tk, tv, score_mod=softcap_approx_mod, block_mask=bm), "torch"),
    }
    graphs = {}
    for name, (fn, lib) in calls.items():
        t0 = time.perf_counter()
        try:
            cupy.cuda.Device().synchronize(); fn(); torch.cuda.synchronize(); cupy.cuda.Device().synchronize()
            graphs[name] = (fn, lib) if lib == "torch" else (CupyGraph(fn, 5), lib)
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        print(f"  {name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    times = {n: [] for n in graphs}
    for r in range(3):
        for name, (g, lib) in graphs.items():
            cupy.cuda.Device().synchronize(); torch.cuda.synchronize()
            if lib == "cupy":
                ms = g.median_ms(n_warmup=2, n_repeat=10, settle_s=0.3)
            else:
                ms = torch_peers.graph_ms(tt, g, calls=5, n_repeat=10, settle_s=0.3)
            times[name].append(ms)
    med = {n: statistics.median(t) for n, t in times.items()}
    f = flops_full / (2 if causal else 1)
    print(f"== hd128 S{S} B{B} H{H} {'causal' if causal else 'full'}", flush=True)
    for n, ms in med.items():
        print(f"{n:16s} {ms * 1e3:9.1f} us  {f / ms / 1e9:6.1f} TFLOP/s  rounds {[round(x * 1e3) for x in times[n]]}")
    for base, hooked in (("cuattn", "cuattn softcap"), ("flex", "flex softcap"),
                         ("flex", "flex softcap approx")):
        if base in med and hooked in med:
            print(f"{hooked} cost: {100 * (med[hooked] / med[base] - 1):+.1f}%")
    # agreement of the two softcap outputs (a sanity check)
    if "flex softcap" in graphs and "cuattn softcap" in graphs:
        cupy.cuda.Device().synchronize()
        cuattn.flash_forward(q, k, v, causal=causal, softcap=CAP, out=out)
        cupy.cuda.Device().synchronize()
        mine = torch.from_dlpack(out)
        for mod in (softcap_mod, softcap_approx_mod):
            if mod is softcap_approx_mod and "flex softcap approx" not in graphs:
                continue
            ref = flex(tq, tk, tv, score_mod=mod, block_mask=bm).transpose(1, 2)
            torch.cuda.synchronize()
            print(f"max abs diff cuattn vs flex ({mod.__name__}): "
                  f"{(mine.float() - ref.float()).abs().max().item():.4f}")
