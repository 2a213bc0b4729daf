"""Argument checks shared by every public function.

Every check raises ``TypeError`` or ``ValueError`` whose message starts with the
argument's name, before anything is launched.
"""
from __future__ import annotations

import math

import cupy
import numpy as np


def as_device_array(x, name: str) -> cupy.ndarray:
    """A CuPy view of a device array (CuPy, ``__cuda_array_interface__`` or DLPack), no copy.

    Host arrays are refused rather than silently copied to the device.
    """
    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray) or np.isscalar(x):
        raise TypeError(f"{name}: expected a device array (cupy.ndarray or any CUDA array "
                        f"with __cuda_array_interface__/__dlpack__), got host {type(x).__name__}; "
                        "copy it with cupy.asarray() first")
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type, _ = x.__dlpack_device__()
        if int(device_type) in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return cupy.from_dlpack(x)
        raise TypeError(f"{name}: DLPack array lives on device type {int(device_type)}, "
                        "not a CUDA device")
    raise TypeError(f"{name}: expected a device array, got {type(x).__name__}")


def check_ndim(x: cupy.ndarray, ndim: int, name: str, shape_doc: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {shape_doc}, "
                         f"got shape {tuple(x.shape)}")


def check_shape(x: cupy.ndarray, shape: tuple, name: str, shape_doc: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} {shape_doc}, "
                         f"got {tuple(x.shape)}")


def check_dtype(x: cupy.ndarray, dtype, name: str) -> None:
    if x.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {x.dtype}")


def check_last_dim_contiguous(x: cupy.ndarray, name: str) -> None:
    """The last dimension must have unit stride; the others are free."""
    # (an empty array has no layout to speak of: CuPy gives it all-zero strides)
    if x.size and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(f"{name}: the last dimension must be contiguous "
                         f"(stride {x.itemsize} bytes), got strides {x.strides}")


def check_aligned(x: cupy.ndarray, alignment: int, name: str) -> None:
    """Base pointer and every outer stride are multiples of ``alignment`` bytes (vector loads)."""
    bad_stride = any(s % alignment for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)
    if x.data.ptr % alignment or bad_stride:
        raise ValueError(f"{name}: the kernel loads {alignment}-byte vectors, so the base "
                         f"address and outer strides must be multiples of {alignment} bytes; "
                         f"got address {x.data.ptr:#x}, strides {x.strides}")


LOG2E = 1.4426950408889634
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_softmax_scale(value, head_dim: int, factor: float = 1.0) -> float:
    """softmax_scale as a float (None: 1 / sqrt(head_dim)). Kernels multiply it by log2(e)
    (and ``factor``, e.g. an fp8 k_scale) in float32, so that product must be finite too."""
    if value is None:
        value = 1.0 / math.sqrt(head_dim)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale: expected a float or None, got "
                        f"{type(value).__name__}") from None
    if not (math.isfinite(value) and 0 < value * factor * LOG2E <= _FLOAT32_MAX):
        raise ValueError(f"softmax_scale: expected a finite positive number, got {value}")
    return value


def check_window(window_size) -> tuple[int, int]:
    """window_size = (left, right): two ints, each -1 (unbounded) or >= 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        left = right = None
    if not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in (left, right)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got "
                        f"{window_size!r}")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each side is -1 (unbounded) or >= 0, got {window_size}")
    return left, right


def check_output(x: cupy.ndarray, shape: tuple, dtype, name: str, shape_doc: str,
                 device_id: int, *, align: int = 0, last_dim_contiguous: bool = True) -> None:
    """An out= style argument: the shape and dtype the call writes, on the call's device,
    with a contiguous last dimension and ``align``-byte vectors where the kernel needs them."""
    check_shape(x, shape, name, shape_doc)
    check_dtype(x, dtype, name)
    if last_dim_contiguous:
        check_last_dim_contiguous(x, name)
    if align:
        check_aligned(x, align, name)
    check_same_device({name: x}, device_id)


def check_same_device(arrays: dict, device_id: int) -> None:
    for name, x in arrays.items():
        if x is not None and x.device.id != device_id:
            raise ValueError(f"{name}: on device {x.device.id}, but the other inputs are on "
                             f"device {device_id}")


def element_strides(x: cupy.ndarray) -> tuple:
    """Strides in elements (what kernels index with)."""
    return tuple(s // x.itemsize for s in x.strides)


def element_strides_or_contiguous(x, shape: tuple) -> tuple:
    """Element strides of ``x``, or, when it is None (the call allocates it), those of a
    C-contiguous array of ``shape``."""
    if x is not None:
        return element_strides(x)
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def resolve_stream(stream):
    """CuPy's current stream when ``stream`` is None; an int is taken as a raw handle."""
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, int):
        return cupy.cuda.ExternalStream(stream)
    if isinstance(stream, cupy.cuda.Stream) or isinstance(stream, cupy.cuda.ExternalStream):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        _, handle = stream.__cuda_stream__()
        return cupy.cuda.ExternalStream(handle)
    raise TypeError(f"stream: expected a cupy.cuda.Stream, a raw handle (int) or None, "
                    f"got {type(stream).__name__}")


# Scratch buffers of calls captured into CUDA graphs: a graph replays into the same addresses,
# so the memory pool must never hand them out again (kept for the life of the process).
_graph_scratch: list = []


def keep_if_capturing(stream, *buffers) -> None:
    """Keep ``buffers`` alive forever when ``stream`` is capturing a graph."""
    if stream.is_capturing():
        _graph_scratch.extend(buffers)
