"""Command line: ``python -m cuattn info | precompile | cache clear``."""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed


def _device_arch() -> str | None:
    """``sm_XY`` of the current device, or None on a machine without a usable GPU."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        from .jit import arch_of_device
        return arch_of_device(cupy.cuda.Device().id)
    except Exception:
        return None


def cmd_info(_args) -> int:
    import cupy

    from . import __version__
    from .jit import cache, compiler
    print(f"cuattn        {__version__}")
    print(f"cupy          {cupy.__version__}")
    print(f"nvrtc         {'.'.join(map(str, compiler.nvrtc_version()))}")
    print(f"cuda headers  {compiler.cuda_include_dir()}")
    print(f"kernel source {compiler.cuda_src_dir()}")
    arch = _device_arch()
    if arch is None:
        print("device        none (no CUDA device or driver on this machine)")
    else:
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        print(f"device        {dev.id}: {props['name'].decode()}, compute capability "
              f"{arch}, {props['multiProcessorCount']} SMs, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB")
        print(f"cuda runtime  {cupy.cuda.runtime.runtimeGetVersion()}, "
              f"driver {cupy.cuda.runtime.driverGetVersion()}")
    entries = cache.entries()
    size = sum(p.stat().st_size for p in entries)
    print(f"cache         {cache.cache_dir()} ({len(entries)} kernels, {size / 2**20:.1f} MiB)")
    by_arch: dict[str, int] = {}
    for p in entries:
        by_arch[p.parent.name] = by_arch.get(p.parent.name, 0) + 1
    for a, n in sorted(by_arch.items()):
        print(f"  {a}: {n}")
    return 0


def cmd_precompile(args) -> int:
    from tqdm import tqdm

    from . import variants
    from .jit import build
    arch = args.arch or _device_arch()
    if arch is None:
        print("precompile: no CUDA device here; name the target with --arch (e.g. --arch sm_90)",
              file=sys.stderr)
        return 2
    todo = variants.shipped(args.ops)
    compiled = failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:   # NVRTC releases the GIL
        futures = {pool.submit(build, v, arch): v for v in todo}
        for fut in tqdm(as_completed(futures), total=len(futures), desc=f"precompile {arch}",
                        unit="kernel", disable=args.quiet):
            try:
                compiled += fut.result()
            except Exception as exc:   # report every failure, keep building the rest
                failed += 1
                tqdm.write(f"FAILED {futures[fut].name}: {exc}")
    print(f"precompile {arch}: {len(todo)} variants, {compiled} compiled, "
          f"{len(todo) - compiled - failed} already cached, {failed} failed")
    return 1 if failed else 0


def cmd_cache(args) -> int:
    from .jit import cache
    if args.action == "clear":
        print(f"removed {cache.clear()} kernels from {cache.cache_dir()}")
    else:
        for p in cache.entries():
            print(p)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="device, versions, cache").set_defaults(fn=cmd_info)
    p = sub.add_parser("precompile", help="compile the shipped kernel variants ahead of time")
    p.add_argument("--arch", help="target such as sm_90 (default: the current device's)")
    p.add_argument("--ops", nargs="+", help="ops to build (default: all)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_precompile)
    p = sub.add_parser("cache", help="list or clear the kernel cache")
    p.add_argument("action", choices=["clear", "list"])
    p.set_defaults(fn=cmd_cache)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
