"""Command line: ``cuattn`` (or ``python -m cuattn``) info | precompile | cache list/clear."""
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
    from cuda import bindings

    from . import __version__, shipped
    from .jit import cache, compiler
    print(f"cuattn        {__version__}")
    print(f"cupy          {cupy.__version__}")
    print(f"cuda-bindings {bindings.__version__}")
    archs = compiler.supported_archs()
    print(f"nvrtc         {'.'.join(map(str, compiler.nvrtc_version()))}, targets "
          f"{' '.join(archs)}")
    # The kernels that need an arch-specific target (the Hopper ones: sm_90a) compile for it
    # on a device of the base architecture; precompile for sm_90 writes them there.
    specific = {(v.target_arch(a), a) for a in archs for v in shipped.shipped(arch=a)
                if v.target_arch(a) != a}
    for target, base in sorted(specific):
        print(f"              {target} (arch-specific: the kernels that need it, built by "
              f"precompile for {base})")
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

    from . import shipped
    from .jit import build, cache, compiler
    if args.arch is not None:
        arch, source = args.arch, "--arch"
    else:
        arch, source = _device_arch(), "this GPU's architecture"
    if arch is None:
        print("precompile: no CUDA device here; name the target with --arch (e.g. --arch sm_90)",
              file=sys.stderr)
        return 2
    try:
        compiler.check_arch(arch)
        cache.check_writable(arch)
    except ValueError as exc:
        print(f"precompile: {source} {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"precompile: cannot store kernels in {cache.cache_dir()} ({exc}); "
              "set CUATTN_CACHE_DIR to a writable directory", file=sys.stderr)
        return 1
    todo = shipped.shipped(args.ops, arch.removesuffix("a"))
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
        return 0
    entries = cache.entries()
    for p in entries:
        print(p)
    if not entries:
        print(f"no kernels in {cache.cache_dir()}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (``--help`` shows the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    from .shipped import SHIPPED

    ops = sorted(SHIPPED)
    prog = "python -m cuattn" if sys.argv[0].endswith("__main__.py") else "cuattn"
    parser = _Parser(
        prog=prog,
        description="Ahead-of-time compilation and the on-disk kernel cache of cuattn. "
                    "The cache is $CUATTN_CACHE_DIR (default ~/.cache/cuattn).",
        epilog=f"'{prog} COMMAND --help' shows the options of a command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="versions (cuattn, CuPy, cuda-bindings, NVRTC), the device, "
                   "the cache directory and what is in it").set_defaults(fn=cmd_info)
    p = sub.add_parser(
        "precompile", help="compile the shipped kernel variants ahead of time",
        description="Compile every kernel variant cuattn ships (or those of --ops) into the "
                    "cache, in parallel. Variants outside that set compile on first use.")
    p.add_argument("--arch", help="target architecture, sm_80 or newer, e.g. sm_80, sm_86, "
                   "sm_89, sm_90 (default: this GPU's; required on a machine without one)")
    p.add_argument("--ops", nargs="+", choices=ops, metavar="OP",
                   help=f"build only these ops: {', '.join(ops)} (default: all)")
    p.add_argument("-j", "--jobs", type=_positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="compiler threads (default: the number of CPUs, %(default)s here)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_precompile)
    p = sub.add_parser("cache", help="list or clear the kernel cache",
                       description="list (the default): print every cached kernel; clear: "
                                   "remove them all.")
    p.add_argument("action", nargs="?", default="list", choices=["list", "clear"],
                   help="list (the default) or clear")
    p.set_defaults(fn=cmd_cache)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
