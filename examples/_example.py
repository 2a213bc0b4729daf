"""What the examples check before they start. An example that cannot run here (no usable
CUDA GPU, or an optional library missing) says why in one line on stderr and exits with
status 2; 1 means it ran and its result was wrong; 0 that it ran and checked its result.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

CANNOT_RUN = 2


def cannot_run(why: str):
    print(f"{Path(sys.argv[0]).name}: cannot run here: {why}", file=sys.stderr)
    sys.exit(CANNOT_RUN)


def need_gpu() -> None:
    """Exit unless CuPy sees a CUDA device."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # noqa: BLE001 - no driver, no device, no CuPy: all "no GPU"
        cannot_run(f"no usable CUDA GPU ({type(exc).__name__}: {exc}); "
                   "`python -m cuattn info` shows what cuattn sees")
    if count == 0:
        cannot_run("no CUDA GPU")


def need_module(name: str, install: str):
    """The module ``name``, or exit saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        cannot_run(f"{name} is not installed ({install})")
