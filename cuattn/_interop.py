"""What the framework adapters (cuattn.jax, cuattn.torch) share: CuPy views of other
libraries' device memory and CuPy streams over their raw stream handles, both cached, so a
repeated call pays a dict lookup instead of building them anew. CuPy only: no framework
is imported here.
"""
from __future__ import annotations

import math

import cupy

_CACHE_MAX = 512
_views: dict = {}
_streams: dict = {}


def device_view(ptr: int, shape: tuple, dtype, device_id: int, strides=None) -> cupy.ndarray:
    """A cupy.ndarray over ``ptr`` (memory it does not own: the caller keeps it alive for
    as long as the view is used), C-contiguous unless ``strides`` (bytes) are given. Views
    are cached by (pointer, shape, strides, dtype, device): they hold no reference to the
    memory's owner, so a cached view never keeps another library's buffer alive."""
    key = (ptr, shape, strides, dtype, device_id)
    view = _views.get(key)
    if view is None:
        if len(_views) >= _CACHE_MAX:
            _views.clear()
        nbytes = _extent(shape, strides, dtype.itemsize)
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, None, device_id)
        view = cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides)
        _views[key] = view
    return view


def _extent(shape: tuple, strides, itemsize: int) -> int:
    """Bytes from the first element to one past the last."""
    if 0 in shape:
        return 0
    if strides is None:
        return math.prod(shape) * itemsize
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


class _Handle:
    """The CUDA stream protocol (``__cuda_stream__``) over a raw cudaStream_t."""
    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def external_stream(handle: int, device_id: int) -> cupy.cuda.Stream:
    """A CuPy stream over another library's stream ``handle`` on ``device_id`` (cached)."""
    key = (handle, device_id)
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= _CACHE_MAX:
            _streams.clear()
        with cupy.cuda.Device(device_id):
            stream = cupy.cuda.Stream.from_external(_Handle(handle))
        _streams[key] = stream
    return stream


def copy_async(dst: cupy.ndarray, src: cupy.ndarray, stream: cupy.cuda.Stream) -> None:
    """dst[...] = src for two C-contiguous arrays of one size: one device-to-device copy
    on ``stream`` (a graph captures it as a memcpy node)."""
    cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes,
                                  cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
