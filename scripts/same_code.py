#!/usr/bin/env python3
"""Whether two cubin caches hold the same machine code: the proof of a no-behaviour-change edit.

    python3 scripts/same_code.py BEFORE_DIR AFTER_DIR

Each DIR is a cache as ``python -m cuattn precompile`` writes it (``CUATTN_CACHE_DIR``):
``<arch>/<symbol>-<digest>.cubin``. Entries pair by (arch folder, symbol): the digest covers
the source text, so an edit that moves code changes it even when the code is the same.
A pair is the same where its bytes are, else where its SASS (``cuobjdump -sass``) and each
kernel's resource usage (``cuobjdump -res-usage``: registers, stack, local memory, i.e.
spills) are. (Left out: the module's "Common" global data. NVRTC emits every static constexpr
member of an instantiated traits type as a data symbol the code never reads, so a renamed or
added constant changes the bytes and that line, not the code.)
Prints one line per arch (pairs, byte-identical, SASS-identical, differing, one side only)
and a line per differing or unpaired entry; exits 1 if any pair differs or any entry has no
pair, 2 if cuobjdump is needed and cannot be found (on PATH, or in the pip package
nvidia-cuda-cuobjdump).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

_ENTRY_RE = re.compile(r"^(?P<symbol>.+)-[0-9a-f]+\.cubin$")
# cuobjdump lines that name the container rather than the code (none appear for a bare cubin
# today; kept out so that a dump of the same code from another file compares equal)
_NOT_CODE_RE = re.compile(r"^\s*(Fatbin |arch = |code version = |host = |compile_size = |"
                          r"identifier = |ptxasOptions = )")


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one the nvidia-cuda-cuobjdump wheel installs."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia   # the namespace package the CUDA wheels share
    except ImportError:
        return None
    for root in nvidia.__path__:
        for path in sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump"))):
            if os.access(path, os.X_OK):
                return path
    return None


def entries(cache: Path) -> dict[tuple[str, str], Path]:
    """{(arch, symbol): cubin} of a cache; two cubins of one symbol in one arch are an error."""
    found: dict[tuple[str, str], Path] = {}
    for path in sorted(cache.glob("*/*.cubin")):
        m = _ENTRY_RE.match(path.name)
        if not m:
            continue
        key = (path.parent.name, m["symbol"])
        if key in found:
            sys.exit(f"same_code: {cache} holds two cubins of {key[0]}/{key[1]} "
                     "(a stale entry: build into an empty folder)")
        found[key] = path
    return found


def dump(cuobjdump: str, option: str, cubin: Path) -> list[str]:
    out = subprocess.run([cuobjdump, option, str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    lines, common = [], False
    for line in out.splitlines():
        if not line.strip() or _NOT_CODE_RE.match(line):
            continue
        if line.strip() == "Common:":    # the module's global data: the next line
            common = True
        elif common:
            common = False
        else:
            lines.append(line.rstrip())
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = entries(Path(argv[0])), entries(Path(argv[1]))
    cuobjdump = None
    counts = defaultdict(lambda: defaultdict(int))
    problems = []
    for key in sorted(before.keys() | after.keys()):
        arch, symbol = key
        if key not in after or key not in before:
            side = "before" if key in before else "after"
            counts[arch]["one side only"] += 1
            problems.append(f"{arch}/{symbol}: only {side}")
            continue
        a, b = before[key], after[key]
        if a.read_bytes() == b.read_bytes():
            counts[arch]["byte-identical"] += 1
            continue
        cuobjdump = cuobjdump or find_cuobjdump()
        if cuobjdump is None:
            print("same_code: cubins differ and cuobjdump is absent: put it on PATH or "
                  "pip install nvidia-cuda-cuobjdump", file=sys.stderr)
            return 2
        differs = [what for what, option in (("SASS", "-sass"), ("resource usage", "-res-usage"))
                   if dump(cuobjdump, option, a) != dump(cuobjdump, option, b)]
        if differs:
            counts[arch]["differing"] += 1
            problems.append(f"{arch}/{symbol}: {' and '.join(differs)} differ")
        else:
            counts[arch]["SASS-identical"] += 1
    for arch in sorted(counts):
        c = counts[arch]
        print(f"{arch}: {sum(c.values())} entries: {c['byte-identical']} byte-identical, "
              f"{c['SASS-identical']} SASS-identical, {c['differing']} differing, "
              f"{c['one side only']} on one side only")
    for line in problems:
        print("  " + line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
