"""Dump every kernel key cuattn can enumerate on the CPU: ``{variant.name: variant.source()}``.

The proof tool of a refactor that must not change a kernel: run it before and after, then
diff the two JSON files (every name and every generated source must be identical).

    PYTHONPATH=. python3 scripts/dump_keys.py /tmp/keys.json [--plans /tmp/plans.json]

It collects three sets, nothing compiled and no GPU touched:

- the shipped set (what ``python -m cuattn precompile`` builds);
- every form a CPU compile test lists, default and ``slow`` tiers: it runs those tests
  (the ones whose body calls a compile helper of tests/compiled.py) under pytest with
  ``compile_variant`` replaced by a recorder that returns a clean ptxas report;
- the keys of the plans of representative op calls: each op's plan builder runs on fake
  arrays (shape, strides, dtype and an aligned address), with the device (sm_90 or
  sm_80), the kernel loader and the tensor-map driver call faked, so the plan holds the
  variants it would launch. ``--plans`` also writes, per call, everything its plan
  launches and allocates (each launch's kernel, grid, block, shared memory, pointer slots
  and packed scalar bytes; the outputs, scratch and alignment), or the error it raised.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_COMPILE_HELPERS = ("compile_reports", "_check_clean", "_within_bounds", "_check_fp8(")


def _shipped() -> list:
    import importlib
    # (cuattn.variants: the trees before issue 52's move, the "before" side of a diff)
    for mod in ("cuattn.shipped", "cuattn.variants"):
        try:
            return importlib.import_module(mod).shipped()
        except (ImportError, AttributeError):
            continue
    raise SystemExit("no shipped() found")


def _test_forms() -> list:
    """Every variant the CPU compile tests pass to tests.compiled.compile_reports."""
    import pytest
    import cuattn.jit as jit
    from tests import compiled

    seen: list = []

    class _Fake:
        def __init__(self, v):
            self.v = v

        def resources(self):
            return {self.v.name: jit.Resources(32, 0, 0, 0)}

    def record(v, arch):
        seen.append(v)
        return _Fake(v)

    class Plugin:
        def pytest_collection_modifyitems(self, config, items):
            keep = []
            for item in items:
                fn = getattr(item, "function", None)
                try:
                    src = inspect.getsource(fn) if fn else ""
                except (OSError, TypeError):
                    src = ""
                if any(h in src for h in _COMPILE_HELPERS):
                    keep.append(item)
            items[:] = keep

    compiled.compile_variant = record
    compiled._reports.clear()
    tests = sorted(os.path.join("tests", f) for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        # results do not matter (a test may assert on a real report): only what it asked for
        pytest.main(["-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                     "--no-header", "-rN", "--continue-on-collection-errors", *tests],
                    plugins=[Plugin()])
    finally:
        os.chdir(cwd)
    return seen


# ---- plans of representative calls, on fake arrays ---------------------------------------------

class _Data:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeArray:
    """What the plan builders read of an array: no data."""
    _next = 1 << 20

    def __init__(self, shape, dtype, strides=None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape)) if self.shape else 1
        self.itemsize = self.dtype.itemsize
        self.nbytes = self.size * self.itemsize
        if strides is None:
            strides, acc = [], self.itemsize
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= max(n, 1)
        self.strides = tuple(strides)
        self.device = SimpleNamespace(id=0)
        self.data = _Data(FakeArray._next)
        FakeArray._next += ((self.nbytes + 4095) // 4096 + 1) * 4096

    def __repr__(self):     # labels of calls: the same in every run
        return f"FakeArray({self.shape}, {self.dtype})"

    def reshape(self, *shape):
        out = FakeArray(shape[0] if len(shape) == 1 else shape, self.dtype)
        out.data = self.data
        return out


class _Captured(Exception):
    def __init__(self, plan):
        self.plan = plan


def _fake_plan_for(cache, arrays, names, scalars, build, stream, required):
    raise _Captured(build(arrays))


def _device(arch):
    from cuattn.jit import DeviceInfo
    fields = dict(arch=arch, sm_count=132 if arch == "sm_90" else 108,
                  smem_per_sm=233472 if arch == "sm_90" else 167936,
                  smem_per_block_optin=232448 if arch == "sm_90" else 166912)
    names = {f for f in DeviceInfo.__dataclass_fields__}
    extra = {n: 0 for n in names - fields.keys()}
    return DeviceInfo(**fields, **extra)


def _patch(arch):
    """Fake the device, the loader, the launch path and the driver in every cuattn module."""
    import cuattn
    import cuattn._tma as tma
    info = _device(arch)
    fakes = {
        "plan_for": _fake_plan_for,
        "get_kernel": lambda variant, device_id=0, *a, **k: variant,
        "device_info": lambda device_id=0: info,
        "on_device": lambda device_id=0: contextlib.nullcontext(),
    }
    for name, mod in list(sys.modules.items()):
        if name.startswith("cuattn") and mod is not None:
            for attr, fake in fakes.items():
                if attr in vars(mod):
                    setattr(mod, attr, fake)
    tma.encodable = lambda dtype_short, arrays, kv_layout=None: all(
        tma.fits(x) for x in arrays if x is not None) if kv_layout is None else True
    tma.FlashMaps = lambda *a, **k: None
    # flash_with_kvcache makes its constant arrays and packed views with cupy itself
    import cuattn.kvcache as kvcache
    kvcache.cupy = SimpleNamespace(
        asarray=lambda x: FakeArray(np.shape(x), np.asarray(x).dtype),
        ndarray=lambda shape, dtype, memptr=None, strides=None: FakeArray(shape, dtype, strides),
        cuda=SimpleNamespace(Device=lambda i=0: SimpleNamespace(synchronize=lambda: None)))
    import cuattn._arrays as arrays
    real = getattr(arrays, "_real_as_device_array", arrays.as_device_array)
    arrays._real_as_device_array = real
    arrays.as_device_array = lambda x, name: x if isinstance(x, FakeArray) else real(x, name)
    del cuattn


def _plan_of(call):
    """(the plan the call would launch, or None; what was raised instead, or None)."""
    try:
        call()
    except _Captured as c:
        return c.plan, None
    except Exception as e:      # a call the fakes cannot carry, or a refused one: keep going
        return None, f"{type(e).__name__}: {e}"
    return None, "no plan built"


def _launches(plan) -> list:
    return list(getattr(plan, "launches", ())) + [
        launch for sub in getattr(plan, "plans", ()) or () for launch in sub.launches]


def _described(plan) -> dict:
    """Everything a plan launches and allocates, as plain data (``--plans``)."""
    fields = ("align", "outputs", "scratch", "scratch_bytes", "scratch_zeroed", "result")
    out = {f: repr(getattr(plan, f, None)) for f in fields}
    out["launches"] = [dict(kernel=launch.kernel.name, grid=list(launch.grid),
                            block=list(launch.block), smem=launch.smem,
                            params=str(launch.dtype), slots=list(launch.slots),
                            tail=launch.tail.hex(), extra=launch.extra is not None)
                       for launch in _launches(plan)]
    return out


def _calls():
    """(label, thunk) of representative op calls."""
    import ml_dtypes
    import cuattn
    from cuattn import paged

    bf16, f16 = ml_dtypes.bfloat16, np.float16
    e4m3 = ml_dtypes.float8_e4m3fn
    F = FakeArray
    calls = []
    for hd in (64, 80, 128, 256):
        for dt in (bf16, f16):
            for kw in (dict(), dict(causal=True), dict(window_size=(64, 0)),
                       dict(causal=True, softcap=30.0), dict(num_splits=4),
                       dict(causal=True, num_splits=3, return_lse=True)):
                calls.append((f"flash {hd} {dt} {kw}", lambda hd=hd, dt=dt, kw=kw:
                              cuattn.flash_forward(F((2, 1000, 8, hd), dt), F((2, 1500, 2, hd), dt),
                                                   F((2, 1500, 2, hd), dt), **kw)))
            calls.append((f"flash decode {hd} {dt}", lambda hd=hd, dt=dt: cuattn.flash_forward(
                F((4, 1, 32, hd), dt), F((4, 8000, 8, hd), dt), F((4, 8000, 8, hd), dt))))
            calls.append((f"flash alibi sinks {hd} {dt}", lambda hd=hd, dt=dt: cuattn.flash_forward(
                F((2, 300, 8, hd), dt), F((2, 300, 8, hd), dt), F((2, 300, 8, hd), dt),
                causal=True, alibi_slopes=F((8,), np.float32), sinks=F((8,), np.float32))))
            calls.append((f"varlen {hd} {dt}", lambda hd=hd, dt=dt: cuattn.flash_varlen_forward(
                F((900, 8, hd), dt), F((1200, 4, hd), dt), F((1200, 4, hd), dt),
                F((4,), np.int32), F((4,), np.int32), 500, 700, causal=True)))
            calls.append((f"bwd {hd} {dt}", lambda hd=hd, dt=dt: cuattn.flash_backward(
                F((2, 500, 8, hd), dt), F((2, 500, 8, hd), dt), F((2, 600, 2, hd), dt),
                F((2, 600, 2, hd), dt), F((2, 500, 8, hd), dt), F((2, 8, 500), np.float32),
                causal=True)))
            calls.append((f"bwd varlen {hd} {dt}", lambda hd=hd, dt=dt: cuattn.flash_varlen_backward(
                F((900, 8, hd), dt), F((900, 8, hd), dt), F((1200, 4, hd), dt),
                F((1200, 4, hd), dt), F((900, 8, hd), dt), F((8, 900), np.float32),
                F((4,), np.int32), F((4,), np.int32), 500, 700, sinks=F((8,), np.float32))))
            calls.append((f"kvcache {hd} {dt}", lambda hd=hd, dt=dt: cuattn.flash_with_kvcache(
                F((2, 3, 8, hd), dt), F((2, 4096, 2, hd), dt), F((2, 4096, 2, hd), dt),
                k=F((2, 3, 2, hd), dt), v=F((2, 3, 2, hd), dt),
                cache_seqlens=F((2,), np.int32), causal=True)))
    for hd in (128, 256):
        calls.append((f"fp8 {hd}", lambda hd=hd: cuattn.flash_forward(
            F((2, 1000, 8, hd), e4m3), F((2, 1000, 2, hd), e4m3), F((2, 1000, 2, hd), e4m3),
            causal=True)))
    for hs in (64, 128, 80):
        for dt in (bf16, f16):
            for bs, layout in ((16, "vllm"), (32, "vllm"), (16, "nhd"), (64, "nhd")):
                kc, vc = paged.paged_kv_cache_shapes(200, 2, hs, bs, dt, layout)
                for kw in (dict(), dict(softcap=20.0), dict(sinks=F((8,), np.float32)),
                           dict(version="v1"), dict(version="v2")):
                    calls.append((f"paged {hs} {dt} {bs} {layout} {kw}",
                                  lambda kc=kc, vc=vc, hs=hs, dt=dt, kw=kw, layout=layout:
                                  cuattn.paged_attention(
                                      F((4, 8, hs), dt), F(kc, dt), F(vc, dt),
                                      F((4, 64), np.int32), F((4,), np.int32),
                                      kv_layout=layout, **kw)))
                if layout == "vllm":
                    k8, v8 = paged.paged_kv_cache_shapes(200, 2, hs, bs, e4m3, layout)
                    calls.append((f"paged fp8 {hs} {dt} {bs}", lambda k8=k8, v8=v8, hs=hs, dt=dt:
                                  cuattn.paged_attention(
                                      F((4, 8, hs), dt), F(k8, e4m3), F(v8, e4m3),
                                      F((4, 64), np.int32), F((4,), np.int32))))
                for nq in (300, 3):
                    for kw in (dict(), dict(softcap=10.0, sinks=F((8,), np.float32))):
                        calls.append((f"prefill {hs} {dt} {bs} {layout} {nq} {kw}",
                                      lambda kc=kc, vc=vc, hs=hs, dt=dt, nq=nq, layout=layout, kw=kw:
                                      cuattn.paged_prefill(
                                          F((nq * 4, 8, hs), dt), F(kc, dt), F(vc, dt),
                                          F((4, 64), np.int32), F((4,), np.int32),
                                          F((5,), np.int32), nq, kv_layout=layout, **kw)))
                calls.append((f"reshape {hs} {dt} {bs} {layout}", lambda kc=kc, vc=vc, hs=hs, dt=dt, layout=layout:
                              cuattn.reshape_and_cache(
                                  F((40, 2, hs), dt), F((40, 2, hs), dt), F(kc, dt), F(vc, dt),
                                  F((40,), np.int64), kv_layout=layout)))
            calls.append((f"merge {hs} {dt}", lambda hs=hs, dt=dt: cuattn.merge_attn_states(
                F((100, 8, hs), dt), F((8, 100), np.float32), F((100, 8, hs), dt),
                F((8, 100), np.float32))))
            calls.append((f"merge_states {hs} {dt}", lambda hs=hs, dt=dt: cuattn.merge_states(
                F((4, 100, 8, hs), dt), F((4, 8, 100), np.float32))))
    # the branches the shared checks and plan builders take: every hook, out= given, lse,
    # splits, windows, FP8 descales, paged FP8 math, dense caches with a batch index
    f32 = np.float32
    for dt in (bf16, f16):
        for hd in (64, 128):
            hooks = dict(alibi_slopes=F((8,), f32), sinks=F((8,), f32), softcap=15.0)
            calls.append((f"flash hooks out lse {hd} {dt}", lambda hd=hd, dt=dt, hooks=hooks:
                          cuattn.flash_forward(
                              F((2, 700, 8, hd), dt), F((2, 900, 4, hd), dt),
                              F((2, 900, 4, hd), dt), window_size=(100, 20), return_lse=True,
                              out=F((2, 700, 8, hd), dt), **hooks)))
            calls.append((f"varlen hooks split {hd} {dt}", lambda hd=hd, dt=dt, hooks=hooks:
                          cuattn.flash_varlen_forward(
                              F((900, 8, hd), dt), F((1200, 2, hd), dt), F((1200, 2, hd), dt),
                              F((4,), np.int32), F((4,), np.int32), 500, 700, num_splits=3,
                              return_lse=True, out=F((900, 8, hd), dt), **hooks)))
            calls.append((f"bwd hooks det {hd} {dt}", lambda hd=hd, dt=dt, hooks=hooks:
                          cuattn.flash_backward(
                              F((2, 500, 8, hd), dt), F((2, 500, 8, hd), dt),
                              F((2, 600, 2, hd), dt), F((2, 600, 2, hd), dt),
                              F((2, 500, 8, hd), dt), F((2, 8, 500), f32), causal=True,
                              deterministic=True, **hooks)))
            calls.append((f"kvcache batch idx {hd} {dt}", lambda hd=hd, dt=dt:
                          cuattn.flash_with_kvcache(
                              F((2, 1, 8, hd), dt), F((5, 2048, 2, hd), dt),
                              F((5, 2048, 2, hd), dt), cache_seqlens=F((2,), np.int32),
                              cache_batch_idx=F((2,), np.int32), return_lse=True)))
        kc, vc = paged.paged_kv_cache_shapes(200, 2, 128, 64, e4m3, "nhd")
        for nq in (300, 3):
            calls.append((f"prefill fp8 q_scale {nq} {dt}", lambda kc=kc, vc=vc, dt=dt, nq=nq:
                          cuattn.paged_prefill(
                              F((nq * 4, 8, 128), dt), F(kc, e4m3), F(vc, e4m3),
                              F((4, 64), np.int32), F((4,), np.int32), F((5,), np.int32), nq,
                              kv_layout="nhd", q_scale=0.5, k_scale=0.25,
                              v_scale=2.0)))
    for hd in (128, 256):
        calls.append((f"fp8 descales {hd}", lambda hd=hd: cuattn.flash_forward(
            F((2, 1000, 8, hd), e4m3), F((2, 1000, 2, hd), e4m3), F((2, 1000, 2, hd), e4m3),
            q_descale=F((2, 2), f32), k_descale=F((2, 2), f32), v_descale=F((2, 2), f32),
            out_dtype=bf16)))
    calls.append(("flashinfer", lambda: cuattn.block_tables_from_flashinfer(
        F((5,), np.int32), F((100,), np.int32), F((4,), np.int32), 16, 64)))
    return calls


def _plans() -> dict:
    """{arch and call label: (plan, error)} of every representative call."""
    out = {}
    for arch in ("sm_90", "sm_80"):
        _patch(arch)
        for label, call in _calls():
            assert f"{arch} {label}" not in out, f"two calls labelled {label}"
            out[f"{arch} {label}"] = _plan_of(call)
    return out


def main(path: str, plans_path: str | None) -> None:
    import cuattn  # noqa: F401  (every module loaded before the patches)
    for adapter in ("cuattn.jax", "cuattn.torch"):
        with contextlib.suppress(ImportError):
            __import__(adapter)
    shipped, tests, plans = _shipped(), _test_forms(), _plans()
    for label, (plan, error) in plans.items():
        if plan is None:
            print(f"  {label}: {error}"[:200], file=sys.stderr)
    if plans_path:
        with open(plans_path, "w") as f:
            json.dump({label: _described(plan) if plan is not None else {"raised": error}
                       for label, (plan, error) in plans.items()}, f, indent=0, sort_keys=True)
    groups = {"shipped": shipped, "tests": tests,
              "plans": [launch.kernel for plan, _ in plans.values() for launch in _launches(plan)]}
    keys = {}
    for group, variants in groups.items():
        for v in variants:
            name, src = v.name, v.source()
            assert keys.get(name, src) == src, f"{name}: two sources"
            keys[name] = src
        print(f"{group}: {len(variants)} variants ({len(set(variants))} distinct)",
              file=sys.stderr)
    print(f"total distinct names: {len(keys)}", file=sys.stderr)
    with open(path, "w") as f:
        json.dump(keys, f, indent=0, sort_keys=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    plans_path = args[args.index("--plans") + 1] if "--plans" in args else None
    paths = [a for a in args if a not in ("--plans", plans_path)]
    main(paths[0] if paths else "keys.json", plans_path)
