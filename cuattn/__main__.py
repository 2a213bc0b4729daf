"""Command line: ``cuattn`` (or ``python -m cuattn``) info | precompile | bundle | cache."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial


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
    bundled = cache.bundle_entries()
    if not bundled:
        print("bundle        none (a checkout, or a wheel built without 'python -m cuattn "
              "bundle')")
    else:
        print(f"bundle        {cache.bundle_dir()} ({_sizes(bundled)})")
        for a in sorted({p.parent.name for p in bundled}):
            print(f"  {a}: {sum(p.parent.name == a for p in bundled)}")
    return 0


def _compile_all(jobs: list[tuple[str, Callable[[], bool]]], desc: str, args) -> tuple[int, int]:
    """Run (variant name, compile it unless stored: True if compiled now) jobs on
    ``args.jobs`` threads, with a progress bar unless ``args.quiet``. -> (compiled, failed)"""
    from tqdm import tqdm
    compiled = failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:   # NVRTC releases the GIL
        futures = {pool.submit(job): name for name, job in jobs}
        for fut in tqdm(as_completed(futures), total=len(futures), desc=desc,
                        unit="kernel", disable=args.quiet):
            try:
                compiled += fut.result()
            except Exception as exc:   # report every failure, keep building the rest
                failed += 1
                tqdm.write(f"FAILED {futures[fut]}: {exc}")
    return compiled, failed


def cmd_precompile(args) -> int:
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
    compiled, failed = _compile_all([(v.name, partial(build, v, arch)) for v in todo],
                                    f"precompile {arch}", args)
    print(f"precompile {arch}: {len(todo)} variants, {compiled} compiled, "
          f"{len(todo) - compiled - failed} already cached or bundled, {failed} failed")
    return 1 if failed else 0


# What a wheel carries: A100 (sm_80), A10/L4-class (sm_86), L40/4090-class (sm_89) and
# H100/H200 (sm_90, with the sm_90a forms of the Hopper kernels).
BUNDLE_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def _sizes(paths) -> str:
    return f"{len(paths)} kernels, {sum(p.stat().st_size for p in paths) / 2**20:.1f} MiB"


def cmd_bundle(args) -> int:
    from . import shipped
    from .jit import cache, compiler
    try:
        for arch in args.arch:
            compiler.check_arch(arch)
            if arch.endswith("a"):
                raise ValueError(f"{arch!r}: name the device's architecture ("
                                 f"{arch.removesuffix('a')} bundles the {arch} forms)")
    except ValueError as exc:
        print(f"bundle: --arch {exc}", file=sys.stderr)
        return 2
    # (variant, the arch it compiles for: sm_90a for the Hopper kernels on sm_90)
    todo = list(dict.fromkeys((v, v.target_arch(arch)) for arch in args.arch
                              for v in shipped.shipped(args.ops, arch)))
    # The bundle is exactly this set: a cubin of an older source or of another set would
    # only make the wheel bigger.
    keep = {cache.bundle_path(v.name, v.source(), target) for v, target in todo}
    stale = [p for p in cache.bundle_entries() if p not in keep]
    for path in stale:
        path.unlink()
    compiled, failed = _compile_all(
        [(v.name, partial(cache.add_to_bundle, v.name, v.source(), target))
         for v, target in todo], "bundle", args)
    entries = cache.bundle_entries()
    print(f"bundle {' '.join(args.arch)}: {len(todo)} variants, {compiled} compiled, "
          f"{len(todo) - compiled - failed} already bundled, {failed} failed, "
          f"{len(stale)} stale removed")
    print(f"bundle        {cache.bundle_dir()} ({_sizes(entries)})")
    for arch in sorted({p.parent.name for p in entries}):
        print(f"  {arch}: {_sizes([p for p in entries if p.parent.name == arch])}")
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


def _compile_options(parser: argparse.ArgumentParser, ops: list[str]) -> None:
    """--ops, -j and -q: precompile's and bundle's."""
    parser.add_argument("--ops", nargs="+", choices=ops, metavar="OP",
                        help=f"build only these ops: {', '.join(ops)} (default: all)")
    parser.add_argument("-j", "--jobs", type=_positive_int, default=os.cpu_count() or 1,
                        metavar="N",
                        help="compiler threads (default: the number of CPUs, %(default)s here)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


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
    _compile_options(p, ops)
    p.set_defaults(fn=cmd_precompile)
    p = sub.add_parser(
        "bundle", help="compile the shipped variants into the package, for a wheel",
        description="Compile every kernel variant cuattn ships (or those of --ops) for each "
                    "--arch into cuattn/cubins/, which 'python -m build' then puts in the "
                    "wheel: an installed wheel loads them without compiling. Cubins of "
                    "variants outside this set are removed from the folder.")
    p.add_argument("--arch", nargs="+", default=list(BUNDLE_ARCHS), metavar="ARCH",
                   help=f"target architectures (default: {' '.join(BUNDLE_ARCHS)}; sm_90 "
                        "also bundles the sm_90a forms)")
    _compile_options(p, ops)
    p.set_defaults(fn=cmd_bundle)
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
