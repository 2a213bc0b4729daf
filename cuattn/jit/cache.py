"""The on-disk cubin cache: ``$CUATTN_CACHE_DIR`` (default ``~/.cache/cuattn``).

An entry is ``<arch>/<variant name>-<digest>.cubin``; the digest covers every byte that
reaches the compiler (the generated entry point and every cuda_src/ header it
includes, transitively), the options, the architecture and the NVRTC version, so an
edited header can never reuse a stale binary. Entries are written to a temporary file
and renamed into place, under a per-entry file lock: two processes asking for the same
variant compile it once and no reader ever sees half a file. A corrupt entry is
recompiled; an unwritable directory degrades to compiling in memory, with one warning.
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

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_SYSTEM_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*<([^>]+)>', re.MULTILINE)


def cache_dir() -> Path:
    return Path(os.environ.get("CUATTN_CACHE_DIR") or Path.home() / ".cache" / "cuattn")


@functools.cache
def _file(path: Path, mtime_ns: int, size: int) -> tuple[str, bytes]:
    """(text, sha256) of a file as of (mtime, size): each header is read once per process."""
    data = path.read_bytes()
    return data.decode(errors="replace"), hashlib.sha256(data).digest()


def _read(path: Path) -> tuple[str, bytes]:
    st = path.stat()
    return _file(path, st.st_mtime_ns, st.st_size)


def included_files(source: str) -> list[Path]:
    """Every cuda_src/ file a source includes with "quotes", transitively, in a stable order."""
    root = compiler.cuda_src_dir()
    seen: dict[Path, None] = {}
    pending = [source]
    while pending:
        for rel in _INCLUDE_RE.findall(pending.pop()):
            path = (root / rel).resolve()
            if path not in seen and path.is_file():
                seen[path] = None
                pending.append(_read(path)[0])
    return sorted(seen)


def digest(source: str, arch: str) -> str:
    """Hash of everything that determines the cubin."""
    h = hashlib.sha256()
    root = compiler.cuda_src_dir()
    for part in (source, arch, repr(compiler.nvrtc_version()),
                 repr([o for o in compiler.compile_options(arch) if not o.startswith("-I")])):
        h.update(part.encode() + b"\0")
    ours = included_files(source)
    for path in ours:
        h.update(str(path.relative_to(root)).encode() + b"\0" + _read(path)[1])
    # The CUDA headers we include (cuda_bf16.h, ...) may come from another package
    # version than NVRTC itself: hash the ones named directly.
    cuda_inc = Path(compiler.cuda_include_dir())
    for text in [source] + [_read(p)[0] for p in ours]:
        for rel in _SYSTEM_INCLUDE_RE.findall(text):
            if (path := cuda_inc / rel).is_file():
                h.update(rel.encode() + b"\0" + _read(path)[1])
    return h.hexdigest()[:20]


def entry_path(name: str, source: str, arch: str) -> Path:
    return cache_dir() / arch / f"{name}-{digest(source, arch)}.cubin"


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
    """The cubin of one variant: from the cache, or compiled (and stored). -> (cubin, compiled)

    ``force`` recompiles even over a readable entry (used when the driver rejected it).
    """
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
