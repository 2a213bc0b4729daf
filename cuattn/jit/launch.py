"""Launching a loaded kernel with its single by-value params struct.

Straight through the driver (``cuLaunchKernel`` from cuda.bindings) with a pointer to the
packed struct: CuPy's generic launch path inspects each argument's type on every call,
which for a structured scalar costs more than the kernel of a small decode step. The
call convention is CuPy's: ``kernel(grid, block, (params,), stream=..., shared_mem=...)``.
"""
from __future__ import annotations

import cupy
import numpy as np


class Kernel:
    """A loaded kernel function taking one ParamsStruct argument."""

    __slots__ = ("name", "function", "ptr", "_handle", "_driver")

    def __init__(self, name: str, function):
        from cuda.bindings import driver
        self.name = name
        self.function = function            # the CuPy Function (keeps its module alive)
        self.ptr = function.ptr             # CUfunction handle, for cuFuncSetAttribute & co
        self._handle = driver.CUfunction(function.ptr)
        self._driver = driver

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, stream=None,
                 shared_mem: int = 0) -> None:
        """``args``: a 1-tuple holding ``ParamsStruct.pack(...)`` (0-d array or np.void)."""
        (params,) = args
        if not isinstance(params, np.ndarray):
            params = np.array(params)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        if stream is None:
            stream = cupy.cuda.get_current_stream()
        argv = np.array([params.__array_interface__["data"][0]], dtype=np.uint64)
        (err,) = self._driver.cuLaunchKernel(
            self._handle, gx, gy, gz, bx, by, bz, shared_mem, stream.ptr,
            argv.__array_interface__["data"][0], 0)   # kernelParams: void*[1] -> the struct
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"launch of {self.name} (grid {grid}, block {block}, "
                               f"{shared_mem} B shared memory) failed: {err}")
