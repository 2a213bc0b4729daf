"""The on-disk cubin cache: ``$CUATTN_CACHE_DIR`` (default ``~/.cache/cuattn``).

An entry is ``<arch>/<variant name>-<digest>.cubin``; the digest covers every byte that
reaches the compiler (the generated entry point and every header NVRTC opens for it,
found as NVRTC finds them: ``included_files``), the options, the architecture and the
NVRTC version, so an edited header can never reuse a stale binary. Entries are written to
a temporary file and renamed into place, under a per-entry file lock: two processes asking
for the same variant compile it once and no reader ever sees half a file. A corrupt entry
is recompiled; an unwritable directory degrades to compiling in memory, with one warning.

A wheel built after ``python -m cuattn bundle`` also carries cubins inside the package
(``cuattn/cubins/<arch>/<variant name>-<bundle digest>.cubin``), looked up before the cache;
their digest leaves out the NVRTC version and the CUDA headers (``digest(toolchain=False)``).
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import struct
import tempfile
import warnings
from pathlib import Path

from . import compiler

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.MULTILINE)


def cache_dir() -> Path:
    return Path(os.environ.get("CUATTN_CACHE_DIR") or Path.home() / ".cache" / "cuattn")


@functools.cache
def _file(path: str, mtime_ns: int, size: int) -> tuple[tuple, bytes]:
    """(its include directives, sha256) of a file as of (mtime, size): each file is read and
    scanned once per process."""
    data = Path(path).read_bytes()
    return tuple(_INCLUDE_RE.findall(data.decode(errors="replace"))), hashlib.sha256(data).digest()


def _read(path: str) -> tuple[tuple, bytes]:
    st = os.stat(path)
    return _file(path, st.st_mtime_ns, st.st_size)


def _resolve(name: str, folders: tuple[str, ...]) -> str | None:
    """The first folder's ``name`` that is a file, as NVRTC looks for an include."""
    paths = (os.path.normpath(os.path.join(folder, name)) for folder in folders)
    return next((p for p in paths if os.path.isfile(p)), None)


def included_files(source: str) -> list[Path]:
    """Every file NVRTC opens for ``source`` (a generated entry point), transitively, in a
    stable order: cuda_src/ headers and the CUDA headers they reach.

    Resolved as NVRTC resolves them: ``#include "x"`` in the including file's folder first
    (the program's is cuda_src/: compiler.program_name), then along the include path;
    ``#include <x>`` along the include path only. A name found nowhere is one of NVRTC's
    built-in headers, covered by its version. Every directive counts, also one that an
    ``#if`` leaves out: a file too many in the digest costs a recompile, one too few a
    stale cubin.
    """
    search = tuple(str(d) for d in compiler.include_dirs())
    seen: dict[str, None] = {}
    pending = [(tuple(_INCLUDE_RE.findall(source)), str(compiler.cuda_src_dir()))]
    while pending:
        includes, folder = pending.pop()
        for bracket, name in includes:
            path = _resolve(name, ((folder,) if bracket == '"' else ()) + search)
            if path is not None and path not in seen:
                seen[path] = None
                pending.append((_read(path)[0], os.path.dirname(path)))
    return [Path(p) for p in sorted(seen)]


def digest(source: str, arch: str, *, toolchain: bool = True) -> str:
    """Hash of everything that determines the cubin: the source, every file it includes
    (by its name under its include directory, and its bytes), the architecture, the NVRTC
    version and the options (less the ``-I`` paths, which name this machine's folders).

    ``toolchain=False`` (the bundle's key) leaves out the NVRTC version and the files under
    the CUDA include directory: a bundled cubin is machine code for its architecture, valid
    whatever compiler the user has, so only cuattn's own inputs may change its key."""
    h = hashlib.sha256()
    version = [repr(compiler.nvrtc_version())] if toolchain else []
    for part in [source, arch, *version,
                 repr([o for o in compiler.compile_options(arch) if not o.startswith("-I")])]:
        h.update(part.encode() + b"\0")
    roots = [Path(os.path.normpath(r)) for r in compiler.include_dirs()]
    named = {}
    for path in included_files(source):
        i = next((i for i, r in enumerate(roots) if path.is_relative_to(r)), None)
        if not toolchain and i != 0:   # roots[0] is cuda_src/ (compiler.include_dirs)
            continue
        named[str(path) if i is None else f"{i}:{path.relative_to(roots[i]).as_posix()}"] = path
    # in the order of these names, not of the absolute paths: where cuda_src/ lies beside
    # the CUDA headers must not reorder them
    for name in sorted(named):
        h.update(name.encode() + b"\0" + _read(str(named[name]))[1])
    return h.hexdigest()[:20]


def entry_path(name: str, source: str, arch: str) -> Path:
    return cache_dir() / arch / f"{name}-{digest(source, arch)}.cubin"


def bundle_dir() -> Path:
    """The cubins a wheel carries (written by ``python -m cuattn bundle``; none in a
    checkout until that runs)."""
    return Path(__file__).resolve().parent.parent / "cubins"


def bundle_path(name: str, source: str, arch: str) -> Path:
    return bundle_dir() / arch / f"{name}-{digest(source, arch, toolchain=False)}.cubin"


def bundled(name: str, source: str, arch: str) -> bytes | None:
    """The bundle's cubin of one variant, or None (no bundle for ``arch``, or not in it)."""
    if not (bundle_dir() / arch).is_dir():   # spares the digest where there is no bundle
        return None
    return _read_entry(bundle_path(name, source, arch))


def bundle_entries() -> list[Path]:
    root = bundle_dir()
    return sorted(root.glob("*/*.cubin")) if root.is_dir() else []


def add_to_bundle(name: str, source: str, arch: str) -> bool:
    """Compile one variant into the bundle unless it holds it already; True if compiled now."""
    path = bundle_path(name, source, arch)
    if _read_entry(path) is not None:
        return False
    cubin = compiler.compile_cubin(source, name, arch).cubin
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, cubin)
    return True


def looks_complete(cubin: bytes) -> bool:
    """Whether a cubin is a whole ELF64 file: every header and section lies inside it."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return False
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if end > len(cubin):
        return False
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", cubin, shoff + i * shentsize + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", cubin, shoff + i * shentsize + 0x18)
        if sh_type != 8 and sh_offset + sh_size > len(cubin):   # 8 = SHT_NOBITS
            return False
    return True


def _read_entry(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if looks_complete(data) else None


_warned: set[str] = set()


def _warn_unwritable(directory: str, reason: str) -> None:
    """One warning per directory and process."""
    if directory in _warned:
        return
    _warned.add(directory)
    warnings.warn(f"cuattn: kernel cache {directory} is not writable ({reason}); "
                  "compiled kernels are kept in memory for this process only. "
                  "Set CUATTN_CACHE_DIR to a writable directory.", RuntimeWarning, stacklevel=3)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def get_cubin(name: str, source: str, arch: str, *, force: bool = False) -> tuple[bytes, bool]:
    """The cubin of one variant: from the bundle, the cache, or compiled (and stored in the
    cache). -> (cubin, compiled)

    ``force`` recompiles even over a readable bundled or cached cubin (used when the driver
    rejected it).
    """
    if not force and (cubin := bundled(name, source, arch)) is not None:
        return cubin, False
    path = entry_path(name, source, arch)
    if not force and (cubin := _read_entry(path)) is not None:
        return cubin, False
    from filelock import FileLock, Timeout   # only a compile needs it (~150 ms to import)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock", timeout=600)
        lock.acquire()
    except (OSError, Timeout) as exc:
        _warn_unwritable(str(cache_dir()), str(exc))
        return compiler.compile_cubin(source, name, arch).cubin, True
    try:
        # Another process may have finished this entry while we waited for the lock.
        if not force and (cubin := _read_entry(path)) is not None:
            return cubin, False
        cubin = compiler.compile_cubin(source, name, arch).cubin
        try:
            _write_atomically(path, cubin)
        except OSError as exc:
            _warn_unwritable(str(cache_dir()), str(exc))
        return cubin, True
    finally:
        lock.release()


def entries() -> list[Path]:
    root = cache_dir()
    return sorted(root.glob("*/*.cubin")) if root.is_dir() else []


def clear() -> int:
    """Remove every cache entry (and lock file); returns how many cubins were removed."""
    removed = 0
    root = cache_dir()
    if not root.is_dir():
        return 0
    for path in root.glob("*/*"):
        if path.suffix in (".cubin", ".lock", ".tmp") or path.name.endswith(".tmp"):
            removed += path.suffix == ".cubin"
            path.unlink(missing_ok=True)
    for sub in root.iterdir():
        if sub.is_dir() and not any(sub.iterdir()):
            sub.rmdir()
    return removed


def check_writable(arch: str) -> None:
    """Raise OSError unless entries for ``arch`` can be stored (precompile asks first:
    get_cubin itself degrades to memory, which would leave nothing behind)."""
    directory = cache_dir() / arch
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass
