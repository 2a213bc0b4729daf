"""cold suite: what a fresh process pays before its first result.

Every number comes from a fresh Python subprocess (the same interpreter, the same cuattn
tree as this process, the same ``CUATTN_CACHE_DIR``), median of ``REPEATS`` of them, after
one discarded priming run that fills the disk cache and the OS file cache:
- ``import cuattn``: wall time around the import statement inside the subprocess (the
  interpreter's own start-up is outside). Three rows: the import alone (cupy, numpy and
  ml_dtypes included, since cuattn imports them), cupy's import alone, and cuattn's import
  after cupy is already imported (cuattn's own cost). Below the table: the modules that
  ``python -X importtime`` charges most to the cuattn import after cupy.
- first call: wall time from before the first call of a variant that is in the disk cache
  to after ``cupy.cuda.Device().synchronize()``; the inputs were made and the device
  synchronised before it (CUDA context, memory pool and CuPy's own kernels are warm), so it
  is the load path alone: finding the cache entry, reading and loading the cubin, building
  the plan, the launch and the kernel. "compiled" says whether the call had to compile (a
  new cubin appeared in the cache: then the variant was not found there). The second call
  of the same process is given for scale.
Targets (issue 10): import <= 100 ms, first call from the disk cache <= 50 ms.

    python -m bench.cold_start
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from bench.harness import format_table, with_path_first

BENCH_ROOT = Path(__file__).resolve().parent.parent
REPEATS = 3
IMPORT_TARGET_MS = 100.0
FIRST_CALL_TARGET_MS = 50.0

_IMPORT = """
import time
t0 = time.perf_counter()
{first}
t1 = time.perf_counter()
{second}
t2 = time.perf_counter()
print("RESULT", (t1 - t0) * 1e3, (t2 - t1) * 1e3)
"""

# Each first-call script defines ``setup()`` (inputs, returns the call) and runs the timing.
_FIRST_CALL = """
import os, time
from pathlib import Path
import cupy, ml_dtypes, numpy as np
import cuattn
from bench.harness import randn
BF16 = np.dtype(ml_dtypes.bfloat16)
def cubins():
    root = Path(os.environ.get("CUATTN_CACHE_DIR") or Path.home() / ".cache" / "cuattn")
    return sum(1 for _ in root.rglob("*.cubin")) if root.is_dir() else 0
{setup}
call = setup()
cupy.cuda.Device().synchronize()
before = cubins()
t0 = time.perf_counter()
call()
cupy.cuda.Device().synchronize()
t1 = time.perf_counter()
call()
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
print("RESULT", (t1 - t0) * 1e3, (t2 - t1) * 1e3, int(cubins() > before))
"""

FIRST_CALLS = {
    "flash_forward causal bf16 (1, 512, 8, 128)": """
def setup():
    q, k, v = (randn(1, 512, 8, 128) for _ in range(3))
    return lambda: cuattn.flash_forward(q, k, v, causal=True)
""",
    "merge_attn_states bf16 (512, 8, 128)": """
def setup():
    a, b = randn(512, 8, 128), randn(512, 8, 128)
    la, lb = randn(8, 512, dtype=np.float32), randn(8, 512, dtype=np.float32)
    return lambda: cuattn.merge_attn_states(a, la, b, lb)
""",
    "paged_attention auto bf16 (1 x 2048, 32/8 heads, head 128)": """
def setup():
    kshape, vshape = cuattn.paged_kv_cache_shapes(128, 8, 128, 16, BF16)
    k_cache, v_cache = randn(*kshape), randn(*vshape)
    q = randn(1, 32, 128)
    tables = cupy.arange(128, dtype=np.int32).reshape(1, 128)
    lens = cupy.asarray([2048], dtype=np.int32)
    return lambda: cuattn.paged_attention(q, k_cache, v_cache, tables, lens)
""",
}


def _env() -> dict:
    """This process's environment, with this process's cuattn tree and bench/ first on the
    path."""
    import cuattn
    first = [str(Path(cuattn.__file__).resolve().parent.parent), str(BENCH_ROOT)]
    return with_path_first(first)


def _subprocess(code: str, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *flags, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"cold-start subprocess failed:\n{proc.stderr[-2000:]}")
    return proc


def _result(code: str) -> list[float]:
    line = next(ln for ln in _subprocess(code).stdout.splitlines() if ln.startswith("RESULT"))
    return [float(x) for x in line.split()[1:]]


def _medians(code: str) -> list[float]:
    """Median of each RESULT field over REPEATS fresh processes, after one priming run."""
    _result(code)
    runs = [_result(code) for _ in range(REPEATS)]
    return [statistics.median(col) for col in zip(*runs)]


def _met(ms: float, target: float) -> str:
    return "yes" if ms <= target else "NO"


def import_rows() -> list[dict]:
    alone = _medians(_IMPORT.format(first="import cuattn", second=""))[0]
    cupy_ms, after_cupy = _medians(_IMPORT.format(first="import cupy", second="import cuattn"))
    return [{"what": "import cuattn (fresh process: cupy, numpy, ml_dtypes included)",
             "ms": alone, "target ms": IMPORT_TARGET_MS, "met": _met(alone, IMPORT_TARGET_MS)},
            {"what": "import cupy alone", "ms": cupy_ms},
            {"what": "import cuattn after cupy (cuattn's own)", "ms": after_cupy,
             "target ms": IMPORT_TARGET_MS, "met": _met(after_cupy, IMPORT_TARGET_MS)}]


def first_call_rows() -> list[dict]:
    rows = []
    for name, setup in FIRST_CALLS.items():
        first, second, compiled = _medians(_FIRST_CALL.format(setup=setup))
        rows.append({"what": f"first call: {name}", "ms": first,
                     "target ms": FIRST_CALL_TARGET_MS, "met": _met(first, FIRST_CALL_TARGET_MS),
                     "compiled": "yes" if compiled else "no", "second call ms": second})
    return rows


def importtime_top(n: int = 8) -> str:
    """The modules ``-X importtime`` charges most (own time) to ``import cuattn`` once cupy
    is imported, from one fresh process."""
    lines = _subprocess("import cupy; import cuattn", "-X", "importtime").stderr.splitlines()
    entries = []
    after_cupy = False
    for line in lines:
        if not line.startswith("import time:") or "|" not in line:
            continue
        fields = [f.strip() for f in line[len("import time:"):].split("|")]
        if not fields[0].isdigit():
            continue                       # the header line
        name = line.rsplit("|", 1)[1]
        if after_cupy:
            entries.append((int(fields[0]), int(fields[1]), name.strip()))
        if name.strip() == "cupy" and not name.startswith("  "):
            after_cupy = True              # top-level cupy done: what follows is cuattn's
    entries.sort(reverse=True)
    out = [f"### -X importtime, import cuattn after cupy: top {n} modules by own time",
           "| self ms | cumulative ms | module |", "|---|---|---|"]
    out += [f"| {s / 1e3:.1f} | {c / 1e3:.1f} | `{m}` |" for s, c, m in entries[:n]]
    return "\n".join(out) + "\n"


def run(ceilings=None, quick: bool = False) -> list[dict]:
    rows = import_rows() + first_call_rows()
    try:
        print(importtime_top(), flush=True)
    except Exception as exc:               # the breakdown is a help, not a result
        print(f"cold: -X importtime breakdown unavailable: {exc!r:.200}")
    return rows


if __name__ == "__main__":
    print(format_table(run(), "cold start (fresh processes)"))
