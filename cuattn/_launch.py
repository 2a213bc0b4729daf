"""The one launch path of every op: a plan per call signature, then pointers and launches.

Everything an op validates about a call depends only on its *signature*: the shape, strides,
dtype and device of each array argument, and the scalar options. The first call of a
signature runs every check and builds a Plan (the kernels, grids, the static bytes of each
params struct, the outputs to allocate); a later call with the same signature looks the
plan up, reads the data pointers, checks their alignment (the one property of an array
that the signature does not fix), allocates the outputs and scratch on the launch stream
and device, packs the pointers in front of each launch's static bytes and launches. No
value inside an array is ever read on the host.

An op calls ``plan_for(cache, arrays, names, scalars, build, stream, required)``, whose
``build`` runs the op's checks (raising the argument errors) on a miss and touches the device
only after them, through ``on_device`` (so a machine without a usable GPU gets cuattn's
one-line DeviceError), then ``execute(plan, arrays, stream, pointers)`` with what plan_for
returned.
"""
from __future__ import annotations

import operator
import struct
from dataclasses import dataclass, field

import cupy
import numpy as np

from . import _arrays as A
from .jit import device_info

_PLAN_CACHE_MAX = 512
_caches: list[dict] = []   # every op's plan cache, so that tuning overrides can drop them


def plan_cache() -> dict:
    """A new plan cache for one op (a dict from signature to Plan)."""
    cache: dict = {}
    _caches.append(cache)
    return cache


def clear_plans() -> None:
    for cache in _caches:
        cache.clear()


_nd = cupy.ndarray


def signature(arrays: tuple, scalars: tuple):
    """Hashable description of a call, or None when an argument is not a cupy.ndarray
    (the op then views its arguments as cupy arrays and asks again)."""
    sig = _sign(arrays, scalars)
    return None if sig is None else sig[0]


def _sign(arrays: tuple, scalars: tuple):
    """(signature, pointers) in one pass over the arrays, or None (not all cupy arrays).
    pointers[0] is null and pointers[1 + i] that of argument i (0 for None)."""
    sig = []
    ptrs = [0]
    for a in arrays:
        if a is None:
            sig.append(None)
            ptrs.append(0)
        elif type(a) is _nd:
            mem = a.data
            sig.append((a.shape, a.strides, a.dtype.num, mem.device_id))
            ptrs.append(mem.ptr)
        else:
            return None
    sig.append(scalars)
    # and their types: 9.0 == 9 and True == 1 hash alike, but only the int passes the checks
    types = tuple(map(type, scalars))
    if tuple in types:
        types = tuple([t if t is not tuple else tuple(map(type, s))
                       for t, s in zip(types, scalars)])
    sig.append(types)
    return tuple(sig), ptrs


NULL = 0   # the pointer slot that holds a null pointer (Slots)


def on_device(device_id: int) -> cupy.cuda.Device:
    """The device to enter (``with on_device(id):``) where a plan builder first touches it,
    after every check: loading kernels, reading its limits. A machine without a usable
    device (no GPU, no driver, below sm_80) gets cuattn.jit.DeviceError here, one line,
    rather than CUDA's own error from whatever touched it first."""
    device_info(device_id)
    return cupy.cuda.Device(device_id)


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a plan: ``kernel(grid, block, (params,) + extra(ptrs))`` where
    params is the struct whose leading pointers are the plan's slots ``slots`` and whose rest
    is ``tail``, and ``extra`` (None: nothing) gives the further arguments of a kernel with
    extra_params (cuattn.jit.Variant) from the call's pointers."""
    kernel: object
    grid: tuple
    block: tuple
    smem: int
    dtype: np.dtype                   # the params struct
    slots: tuple[int, ...]            # one per leading pointer field
    tail: bytes
    extra: object = None
    _pick: object = field(init=False, repr=False, compare=False)
    _pack: object = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        pick = operator.itemgetter(*self.slots)
        if len(self.slots) == 1:
            object.__setattr__(self, "_pick", lambda ptrs: (pick(ptrs),))
        else:
            object.__setattr__(self, "_pick", pick)
        object.__setattr__(self, "_pack", struct.Struct(f"<{len(self.slots)}Q").pack)

    def params(self, ptrs: list) -> np.void:
        return np.frombuffer(self._pack(*self._pick(ptrs)) + self.tail, self.dtype)[0]


@dataclass(frozen=True)
class Plan:
    """What a call of one signature does, with every check already passed."""
    device_id: int
    align: tuple[tuple[int, int], ...]          # (argument index, bytes) its pointer needs
    outputs: tuple[tuple[tuple, np.dtype], ...]  # (shape, dtype) of each allocated output
    scratch: tuple[int, ...] = ()               # byte offsets of the scratch parts
    scratch_bytes: int = 0
    scratch_zeroed: tuple[int, ...] = ()        # (offset, bytes) zeroed before launching, or ()
    launches: tuple[Launch, ...] = ()
    # What the call returns: indices into (arguments..., allocated outputs...); one index
    # returns that array, several a tuple, none returns None.
    result: tuple[int, ...] = ()
    # Several outputs share one allocation (one call into the memory pool): byte offsets.
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _output_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        offsets, total = [], 0
        for shape, dtype in self.outputs:
            offsets.append(total)
            total += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 256) * 256
        object.__setattr__(self, "_offsets", tuple(offsets))
        object.__setattr__(self, "_output_bytes", total)

    def allocate_outputs(self) -> list:
        if len(self.outputs) <= 1:
            return [cupy.empty(shape, dtype=dtype) for shape, dtype in self.outputs]
        mem = cupy.cuda.alloc(self._output_bytes)
        return [cupy.ndarray(shape, dtype, memptr=mem + off)
                for (shape, dtype), off in zip(self.outputs, self._offsets)]


class Slots:
    """Pointer slots of a call with ``num_args`` array arguments and ``num_outputs``
    allocated outputs: slot 0 is null, then the arguments, the outputs, the scratch parts."""

    def __init__(self, num_args: int, num_outputs: int):
        self.num_args, self.num_outputs = num_args, num_outputs

    def arg(self, i: int) -> int:
        return 1 + i

    def output(self, i: int) -> int:
        return 1 + self.num_args + i

    def scratch(self, part: int) -> int:
        return 1 + self.num_args + self.num_outputs + part


def returns(num_args: int, returned: list) -> tuple:
    """What a call returns, as a plan needs it. ``returned``: one ``(given, shape, dtype)``
    per array, ``given`` the index of the argument that holds it when the caller passed one
    (out=), else None: the call allocates it. -> (Slots, the plan's outputs, the pointer
    slot of each returned array, the plan's result)."""
    outputs = tuple((tuple(shape), np.dtype(dtype)) for given, shape, dtype in returned
                    if given is None)
    slots = Slots(num_args, len(outputs))
    slot_of, result, k = [], [], 0
    for given, _, _ in returned:
        if given is None:
            slot_of.append(slots.output(k))
            result.append(num_args + k)
            k += 1
        else:
            slot_of.append(slots.arg(given))
            result.append(given)
    return slots, outputs, tuple(slot_of), tuple(result)


def plan_for(cache: dict, arrays: tuple, names: tuple, scalars: tuple, build, stream,
             required: int):
    """(plan, arrays, stream, pointers) of a call: the cached plan of its signature, or
    ``build(arrays)``, which runs every check of the op (raising on a bad input) and returns
    the new plan. The first ``required`` arrays must be given (the rest may be None); arrays
    of other libraries are viewed as cupy arrays (``arrays`` returned) without a copy;
    ``stream`` is returned resolved (None: CuPy's current stream); ``pointers`` as _sign's."""
    if stream is not None:
        stream = A.resolve_stream(stream)
    signed, plan = _lookup(cache, arrays, scalars)
    if plan is not None and _aligned(plan, signed[1]):
        return plan, arrays, stream, signed[1]
    arrays = tuple(None if a is None and i >= required else A.as_device_array(a, n)
                   for i, (a, n) in enumerate(zip(arrays, names)))
    if signed is None:        # viewed as cupy arrays now: the cache may hold their plan
        signed, plan = _lookup(cache, arrays, scalars)
        if plan is not None and _aligned(plan, signed[1]):
            return plan, arrays, stream, signed[1]
    plan = build(arrays)
    device_info(plan.device_id)     # (a plan that launches nothing has not touched it yet)
    if signed is not None:
        if len(cache) >= _PLAN_CACHE_MAX:
            cache.clear()
        cache[signed[0]] = plan
    ptrs = [0] + [0 if a is None else a.data.ptr for a in arrays]
    return plan, arrays, stream, ptrs


def _lookup(cache: dict, arrays: tuple, scalars: tuple):
    """(_sign's (signature, pointers) or None, the cached plan or None)."""
    signed = _sign(arrays, scalars)
    if signed is None:
        return None, None
    try:
        return signed, cache.get(signed[0])
    except TypeError:          # an unhashable scalar: the op's checks say what is wrong
        return None, None


def _aligned(plan: Plan, ptrs: list) -> bool:
    for i, nbytes in plan.align:
        if ptrs[1 + i] % nbytes:
            return False
    return True


def execute(plan: Plan, arrays: tuple, stream, ptrs: list):
    """Allocate the outputs and scratch on the launch stream (resolved by plan_for; None:
    the current one) and device, pack, launch. ``ptrs``: plan_for's pointers (extended)."""
    if stream is not None:
        if stream.ptr != cupy.cuda.get_current_stream().ptr or \
                cupy.cuda.runtime.getDevice() != plan.device_id:
            with cupy.cuda.Device(plan.device_id), stream:
                return _run(plan, arrays, stream, ptrs)
        return _run(plan, arrays, stream, ptrs)
    if cupy.cuda.runtime.getDevice() != plan.device_id:
        with cupy.cuda.Device(plan.device_id):
            return _run(plan, arrays, None, ptrs)
    return _run(plan, arrays, None, ptrs)


def _run(plan: Plan, arrays: tuple, stream, ptrs: list):
    outs = plan.allocate_outputs() if plan.outputs else ()
    if plan.launches:
        for o in outs:
            ptrs.append(o.data.ptr)
        if plan.scratch:
            scratch = cupy.cuda.alloc(plan.scratch_bytes)
            on = stream if stream is not None else cupy.cuda.get_current_stream()
            A.keep_if_capturing(on, scratch)
            base = scratch.ptr
            for off in plan.scratch:
                ptrs.append(base + off)
            if plan.scratch_zeroed:
                off, n = plan.scratch_zeroed
                cupy.cuda.runtime.memsetAsync(base + off, 0, n, on.ptr)
        for launch in plan.launches:
            args = (launch.params(ptrs),)
            if launch.extra is not None:
                args += launch.extra(ptrs)
            launch.kernel(launch.grid, launch.block, args, stream=stream, shared_mem=launch.smem)
    result = plan.result
    if not result:
        return None
    everything = arrays + tuple(outs) if outs else arrays
    if len(result) == 1:
        return everything[result[0]]
    return tuple(everything[i] for i in result)
