"""Run-time compilation: variant keys -> cubins -> loaded CuPy functions.

A variant's cubin comes from the first of: this process's loaded functions, the cubins
bundled in the package (a wheel built after ``python -m cuattn bundle``), the disk cache,
NVRTC (cache.get_cubin).

``get_kernel(key)`` is a dictionary hit on (device, key) once the variant has been loaded in
this process; a public call reaches it only when it builds a launch plan (cuattn._launch).
"""
from __future__ import annotations

import threading

import cupy

from . import cache, compiler
from .compiler import CompileError, CompileResult, Resources, compile_cubin, nvrtc_version
from .device import DeviceError, DeviceInfo, device_info
from .params import ParamsStruct
from .variant import Variant, key_field

__all__ = ["CompileError", "CompileResult", "DeviceError", "DeviceInfo", "ParamsStruct",
           "Resources", "Variant", "arch_of_device", "build", "cache", "compile_variant",
           "compiler", "device_info", "get_kernel", "key_field", "max_dynamic_smem",
           "nvrtc_version", "set_max_dynamic_smem"]

_loaded: dict[tuple[int, Variant], "cupy.cuda.function.Function"] = {}
_modules: list = []          # keep modules alive as long as their functions
_lock = threading.Lock()


def arch_of_device(device_id: int) -> str:
    """``sm_XY`` of a device (a DeviceError for none, or one below sm_80)."""
    return device_info(device_id).arch


def compile_variant(key: Variant, arch: str) -> CompileResult:
    """Compile without the cache for a device of ``arch`` (tests read the ptxas report)."""
    return compile_cubin(key.source(), key.name, key.target_arch(arch))


def build(key: Variant, arch: str) -> bool:
    """Make sure the variant is in the disk cache for a device of ``arch``; True if it was
    compiled now."""
    _, compiled = cache.get_cubin(key.name, key.source(), key.target_arch(arch))
    return compiled


def _load(key: Variant, device_id: int):
    arch = key.target_arch(arch_of_device(device_id))
    cubin, _ = cache.get_cubin(key.name, key.source(), arch)
    with cupy.cuda.Device(device_id):
        module = cupy.cuda.function.Module()
        try:
            module.load(cubin)
        except cupy.cuda.driver.CUDADriverError:
            # A bundled or cached cubin the driver refuses (corrupt but well-formed, or
            # one this driver does not take): compile it here, once.
            cubin, _ = cache.get_cubin(key.name, key.source(), arch, force=True)
            module = cupy.cuda.function.Module()
            module.load(cubin)
        function = module.get_function(key.name)
        # The default cap is 48 KB of dynamic + static shared memory together: raise it for
        # any dynamic size (48 KB of ring + 256 B of static failed to launch otherwise).
        if key.dynamic_smem_bytes > 0:
            set_max_dynamic_smem(function, key.dynamic_smem_bytes)
    _modules.append(module)
    return function


def set_max_dynamic_smem(function, nbytes: int) -> None:
    """Let ``function`` launch with up to ``nbytes`` of dynamic shared memory."""
    driver = cupy.cuda.driver
    driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            nbytes)


def max_dynamic_smem(function, device_id: int) -> int:
    """The most dynamic shared memory ``function`` can be given on ``device_id``: the
    device's opt-in limit per block less the kernel's static shared memory."""
    driver = cupy.cuda.driver
    optin = device_info(device_id).smem_per_block_optin
    return optin - driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                           function.ptr)


def get_kernel(key: Variant, device_id: int):
    """The loaded kernel of ``key`` on ``device_id`` (compiled or read from disk on first use).

    Call it as CuPy's ``kernel(grid, block, (params,), stream=..., shared_mem=...)`` with
    ``params`` a structured scalar of ``key.params`` (cuattn._launch packs it). (A launch through cuda.bindings' cuLaunchKernel
    measured 20 us per call on the H200 host against 4.6 us for CuPy's: bench/NOTES.md.)
    """
    function = _loaded.get((device_id, key))
    if function is None:
        with _lock:
            function = _loaded.get((device_id, key))
            if function is None:
                function = _loaded[(device_id, key)] = _load(key, device_id)
    return function
