"""Lab (bench/NOTES.md, "Eager at S 2048"): why eager at S 2048 read below kernel-only for
cuattn and above it for cuDNN.
Per config: graph replays of N calls and eager loops of N calls for N in (5, 20, 80), cuattn
and cuDNN, in two orders; SM clock / power logged by nvidia-smi in the background.
  PYTHONPATH=. python3 bench/lab/eager_diag.py OUTDIR   (writes OUTDIR/smi.csv)"""
import subprocess, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import cupy
import cuattn
from bench import torch_peers
from bench.harness import CupyGraph, eager_ms
from bench.suite_flash import standard_inputs

out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader", "-lms", "50"],
                       stdout=open(out_dir / "smi.csv", "w"), stderr=subprocess.DEVNULL)
tt = torch_peers.load()
torch = tt.torch


def cuattn_times(q, k, v, out, causal, n):
    def call():
        cuattn.flash_forward(q, k, v, causal=causal, out=out)
    g = CupyGraph(call, n).median_ms(n_warmup=3, n_repeat=20)
    e = eager_ms(call, calls=n, n_repeat=5)
    return g, e


def cudnn_times(views, causal, n):
    g, e = torch_peers.sdpa_times(tt, *views, causal=causal, backend_name="CUDNN_ATTENTION",
                                  graph_calls=n, eager_calls=n, graph_reps=20, eager_reps=5)
    return g, e


for d, s, causal in ((128, 2048, False), (256, 2048, False), (64, 2048, True)):
    q, k, v = standard_inputs(d, s)
    out = cupy.empty_like(q)
    views = torch_peers.bhsd_views(tt, q, k, v)
    b, h = q.shape[0], q.shape[2]
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    tf = lambda ms: flops / ms / 1e9
    for order in ("cuattn first", "cudnn first"):
        for n in (5, 20, 80):
            t0 = time.time()
            if order == "cuattn first":
                a = cuattn_times(q, k, v, out, causal, n); c = cudnn_times(views, causal, n)
            else:
                c = cudnn_times(views, causal, n); a = cuattn_times(q, k, v, out, causal, n)
            print(f"hd{d} S{s} {'causal' if causal else 'full'} {order} calls {n:3d}: "
                  f"cuattn graph {tf(a[0]):5.0f} eager {tf(a[1]):5.0f} | cuDNN graph "
                  f"{tf(c[0]):5.0f} eager {tf(c[1]):5.0f}  (t={time.time():.1f})", flush=True)
smi.terminate()
