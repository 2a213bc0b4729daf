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
    """Exit unless device 0 is one cuattn runs on (cuattn's own check, in plain words)."""
    try:
        from cuattn.jit import DeviceError, device_info
    except ImportError as exc:
        cannot_run(f"cuattn or CuPy cannot be imported ({exc})")
    try:
        device_info(0)
    except DeviceError as exc:
        cannot_run(str(exc).removeprefix("cuattn: "))


def need_module(name: str, install: str):
    """The module ``name``, or exit saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        cannot_run(f"{name} is not installed ({install})")


def need_jax_gpu():
    """jax with a GPU backend (and room left for CuPy), or exit saying what is missing."""
    import os
    # JAX takes 75% of the GPU's memory at start-up by default: leave some to CuPy.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = need_module("jax", 'pip install "jax[cuda12]"')
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        cannot_run(f"this jax {jax.__version__} has no GPU backend ({exc})")
    return jax
