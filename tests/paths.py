"""The two flash forward kernels, for tests that run on each: "mma" (mma.sync, every GPU)
and "wgmma" (the Hopper kernel, sm_90 devices only: skipped elsewhere)."""
from __future__ import annotations

import contextlib

import pytest

from cuattn import tuning
from cuattn.constants import SM90_ARCH

FLASH_PATHS = ("mma", "wgmma")


@contextlib.contextmanager
def forced_flash_path(path: str):
    """Run the block on flash kernel ``path``, skipping the test where it cannot run."""
    if path == "wgmma":
        import cupy

        from cuattn.jit import arch_of_device
        if arch_of_device(cupy.cuda.Device().id) != SM90_ARCH:
            pytest.skip("the wgmma kernel runs on sm_90 devices only")
    with tuning.override(flash_path=path):
        yield
