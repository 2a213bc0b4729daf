"""Launching a loaded kernel with its single by-value params struct.

Straight through the driver (``cuLaunchKernel`` from cuda.bindings) with a pointer to the
packed struct: CuPy's generic launch path inspects each argument's type on every call,
which for a structured scalar costs more than the kernel of a small decode step.
"""
from __future__ import annotations

import numpy as np


class Kernel:
    """A loaded kernel function; call it with (grid, block, params, stream, smem)."""

    __slots__ = ("name", "function", "_handle", "_driver")

    def __init__(self, name: str, function):
        from cuda.bindings import driver
        self.name = name
        self.function = function            # the CuPy Function (keeps its module alive)
        self._handle = driver.CUfunction(function.ptr)
        self._driver = driver

    def __call__(self, grid: tuple, block: tuple, params: np.ndarray, stream, smem: int = 0):
        """``params``: a 0-d array of the kernel's ParamsStruct dtype (ParamsStruct.pack)."""
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        address = params.__array_interface__["data"][0]
        argv = np.array([address], dtype=np.uint64)      # void* kernelParams[1]
        (err,) = self._driver.cuLaunchKernel(self._handle, gx, gy, gz, bx, by, bz, smem,
                                             stream.ptr, argv.__array_interface__["data"][0], 0)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"launch of {self.name} (grid {grid}, block {block}, "
                               f"{smem} B shared) failed: {err}")
