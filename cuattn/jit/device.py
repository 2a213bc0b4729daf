"""What cuattn asks of a device, asked once per device and process: its architecture
(checked against cuattn's minimum before anything is compiled), multiprocessors and shared
memory. A machine without a usable device, or a GPU below sm_80, gets one clear error."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import cupy

from .compiler import MIN_COMPUTE_CAPABILITY


class DeviceError(RuntimeError):
    """No usable CUDA device, or one cuattn's kernels cannot run on."""


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    name: str
    arch: str                    # sm_XY
    sm_count: int
    smem_per_sm: int             # bytes of shared memory per multiprocessor
    smem_per_block_optin: int    # the most one block may be given (after opting in)
    l2_bytes: int                # the L2 cache


def _why_not(exc) -> str:
    """Plain words for a CUDA runtime error at the first touch of a device. Without any
    driver CUDA says "driver version is insufficient", which misleads: say what it is."""
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
    except Exception:   # noqa: BLE001 - the runtime itself cannot run here
        driver = 0
    if driver == 0:
        return "no NVIDIA driver on this machine (no GPU, or its driver is not installed)"
    return f"{exc} (driver {driver // 1000}.{driver % 1000 // 10})"


@functools.cache
def device_info(device_id: int) -> DeviceInfo:
    try:
        dev = cupy.cuda.Device(device_id)
        cc = dev.compute_capability
        attrs = dev.attributes
        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise DeviceError(f"cuattn: no usable CUDA device {device_id}: {_why_not(exc)}; "
                          "`python -m cuattn info` shows what this machine has") from None
    if int(cc) < MIN_COMPUTE_CAPABILITY:
        raise DeviceError(
            f"cuattn: device {device_id} ({name}) has compute capability {cc[:-1]}.{cc[-1]}; "
            f"cuattn's kernels need {MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10} "
            "or newer (sm_80+: cp.async, bf16 mma.sync)")
    return DeviceInfo(device_id, name, "sm_" + cc, attrs["MultiProcessorCount"],
                      attrs.get("MaxSharedMemoryPerMultiprocessor", 100 * 1024),
                      attrs["MaxSharedMemoryPerBlockOptin"], attrs["L2CacheSize"])
