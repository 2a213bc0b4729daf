"""The flash forward's plan on the CPU: the params its launch packs, read back field by field.

The plan builders run on stand-ins for device arrays (shape, strides, dtype, an aligned
address), with the device, the kernel loader and the plan cache faked, so that what a GPU
test would only see as a wrong result (a stride in the wrong field) fails here by name.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import flash
from cuattn.jit import DeviceInfo

BF16 = np.dtype(ml_dtypes.bfloat16)


class Stand:
    """What a plan builder reads of a device array."""
    _next = 1 << 20

    def __init__(self, shape, dtype=BF16, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        if strides is None:
            strides, step = [], self.itemsize
            for n in reversed(self.shape):
                strides.insert(0, step)
                step *= n
        self.strides = tuple(strides)
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.itemsize
        self.device = SimpleNamespace(id=0)
        self.data = SimpleNamespace(ptr=Stand._next)
        Stand._next += (self.nbytes // 4096 + 2) * 4096


class _Built(Exception):
    def __init__(self, plan):
        self.plan = plan


@pytest.fixture
def planned(monkeypatch):
    """call -> the params of its first launch, as a NumPy record (an sm_80 device)."""
    info = DeviceInfo(**{f: 0 for f in DeviceInfo.__dataclass_fields__} |
                      dict(arch="sm_80", sm_count=108, smem_per_sm=167936,
                           smem_per_block_optin=166912))

    def plan_for(cache, arrays, names, scalars, build, stream, required):
        raise _Built(build(arrays))
    monkeypatch.setattr(flash, "plan_for", plan_for)
    monkeypatch.setattr(flash, "device_info", lambda device_id=0: info)
    monkeypatch.setattr(flash, "on_device", lambda device_id=0: contextlib.nullcontext())
    monkeypatch.setattr(flash, "get_kernel", lambda variant, device_id=0: variant)

    def params(call):
        with pytest.raises(_Built) as built:
            call()
        launch = built.value.plan.launches[0]
        raw = bytes(8 * len(launch.slots)) + launch.tail
        return np.frombuffer(raw, dtype=launch.dtype)[0]
    return params


def _strides(p, name, dims=("batch", "row", "head")):
    return tuple(int(p[f"{name}_stride_{d}"]) for d in dims)


def test_fixed_call_strides(planned):
    b, sq, sk, h, hkv, d = 2, 100, 150, 8, 2, 64
    k = Stand((b, sk, hkv, 2 * d))          # a view: K's rows are twice as long
    p = planned(lambda: cuattn.flash_forward(
        Stand((b, sq, h, d)), Stand((b, sk, hkv, d), strides=k.strides),
        Stand((b, sk, hkv, d)), causal=True, return_lse=True))
    assert _strides(p, "q") == (sq * h * d, h * d, d)
    assert _strides(p, "k") == (sk * hkv * 2 * d, hkv * 2 * d, 2 * d)
    assert _strides(p, "v") == (sk * hkv * d, hkv * d, d)
    assert _strides(p, "o") == (sq * h * d, h * d, d)
    assert _strides(p, "lse", ("batch", "head", "row")) == (h * sq, sq, 1)
    assert (int(p["seqlen_q"]), int(p["seqlen_k"])) == (sq, sk)


def test_varlen_call_strides(planned):
    total_q, total_k, h, hkv, d = 900, 1200, 8, 4, 128
    p = planned(lambda: cuattn.flash_varlen_forward(
        Stand((total_q, h, d)), Stand((total_k, hkv, d)), Stand((total_k, hkv, d)),
        Stand((4,), np.int32), Stand((4,), np.int32), 500, 700, return_lse=True))
    assert _strides(p, "q") == (0, h * d, d)
    assert _strides(p, "k") == _strides(p, "v") == (0, hkv * d, d)
    assert _strides(p, "o") == (0, h * d, d)
    assert _strides(p, "lse", ("batch", "head", "row")) == (0, total_q, 1)
    assert (int(p["seqlen_q"]), int(p["seqlen_k"])) == (total_q, 0)
