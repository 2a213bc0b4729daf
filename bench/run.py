"""cuattn benchmarks: ``python bench/run.py [--suite merge flash bwd decode prefill host cold
fp8] [--quick] [--json F] [--plot F.png] [--arch sm_XY]``.

Prints one Markdown table per suite (bwd, the backward: one per timing method), each kernel
beside its peers measured in the same run and against the device's own ceilings (copy and
read bandwidth, bf16 matmul rate), also measured in this run; "host" is the host cost per
call beside a bare kernel launch, "cold" the import and first-call times of fresh processes,
"fp8" the FP8 forward (Hopper) beside cuattn's bf16 forward on the same shapes.
Without a GPU it says so and precompiles the shipped kernels for ``--arch`` (default sm_90)
instead, which is all such a machine can do.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SUITES = {"merge": "bench.suite_merge", "flash": "bench.suite_flash", "bwd": "bench.suite_bwd",
          "decode": "bench.suite_decode", "prefill": "bench.suite_prefill",
          "host": "bench.suite_host", "cold": "bench.cold_start", "fp8": "bench.suite_fp8"}


def _has_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _available_suites() -> list[str]:
    here = Path(__file__).resolve().parent
    return [s for s, mod in SUITES.items() if (here / (mod.split(".")[1] + ".py")).exists()]


def _label(row: dict) -> str:
    """A bar's label: the row's leading configuration fields (up to its first measurement)
    and its version, if any."""
    parts = []
    for key, value in row.items():
        if isinstance(value, float):
            break
        parts.append(f"{key}={value}" if isinstance(value, int) else str(value))
    if "version" in row and str(row["version"]) not in parts:
        parts.append(str(row["version"]))
    return " ".join(parts)


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    suites = [s for s in results["suites"] if results["suites"][s]]
    fig, axes = plt.subplots(len(suites), 1, figsize=(10, 3.5 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites):
        rows = results["suites"][suite]
        metric = next((k for k in rows[0] if k.startswith("%")), None)
        if metric is None:
            continue
        rows = [r for r in rows if isinstance(r.get(metric), (int, float))]  # skip refusals
        labels = [_label(r) for r in rows]
        ax.bar(range(len(rows)), [r[metric] for r in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=6)
        ax.set_ylabel(metric)
        ax.set_title(f"{suite} ({results['ceilings']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _precompile_instead(arch: str) -> int:
    """What a machine without a GPU can do: compile the shipped kernels for ``arch`` into
    the cache, then say where they went and what to run next."""
    from cuattn.__main__ import main as cli
    from cuattn.jit import cache, compiler
    print("bench: no CUDA device on this machine, so nothing can be timed.\n"
          f"Precompiling the shipped kernels for {arch} instead "
          f"(python -m cuattn precompile --arch {arch}).", flush=True)
    status = cli(["precompile", "--arch", arch])
    if status == 0:
        nvrtc = ".".join(map(str, compiler.nvrtc_version()))
        print(f"bench: the kernels are in {cache.cache_dir()} (python -m cuattn cache list). "
              "Next, on a machine with a GPU: python bench/run.py (kernels it finds in its "
              "cache, $CUATTN_CACHE_DIR, are not compiled again: copy this folder there to "
              f"reuse them, with the same NVRTC, {nvrtc}).")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", nargs="+", default=None, choices=_available_suites(),
                        metavar="SUITE", help="suites to run, of "
                        f"{', '.join(_available_suites())} (default: all)")
    parser.add_argument("--quick", action="store_true", help="a few configurations per suite")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--plot", help="draw a PNG chart of the results")
    parser.add_argument("--arch", default="sm_90", help="without a GPU: precompile for this")
    args = parser.parse_args(argv)

    if not _has_gpu():
        return _precompile_instead(args.arch)

    from bench.harness import format_table, measure_ceilings
    suites = args.suite or _available_suites()
    ceilings = measure_ceilings(quick=args.quick)
    print(format_table([ceilings.row()], "ceilings (measured now)"), flush=True)
    results = {"ceilings": ceilings.row(), "suites": {}}
    for suite in suites:
        module = importlib.import_module(SUITES[suite])
        rows = module.run(ceilings, args.quick)
        results["suites"][suite] = rows
        # a suite may split its rows into several tables (suite_bwd: one per timing method)
        split = getattr(module, "tables", lambda rows: [("", rows)])
        for title, table in split(rows):
            print(format_table(table, f"{suite}: {title}" if title else suite), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
