"""Test configuration: GPU tests carry the ``gpu`` marker and skip cleanly without a device;
the exhaustive compile sweeps carry the ``slow`` marker and run only when ``-m`` names it
(``python -m pytest -m slow``: CI's second step; tests/compiled.py says how the two tiers
of compile checks divide the work)."""
from __future__ import annotations

import os

import pytest

# JAX takes three quarters of a GPU's memory at its first call unless told otherwise; the
# adapter tests share the device with the other test processes (scripts/pytest_shards.py)
# and with CuPy's pool in their own, so JAX allocates what it uses, as the examples do.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    skips = []
    if not HAS_GPU:
        skips.append(("gpu", pytest.mark.skip(reason="no CUDA device on this machine")))
    if "slow" not in (config.getoption("markexpr") or ""):
        skips.append(("slow", pytest.mark.skip(
            reason="an exhaustive compile sweep: python -m pytest -m slow runs it")))
    for item in items:
        for marker, skip in skips:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test compiles into a per-session cache directory, never the user's own."""
    if "CUATTN_CACHE_DIR" not in os.environ or not os.environ.get("CUATTN_TEST_KEEP_CACHE"):
        monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def _release_device_memory(request):
    """After each GPU test, CuPy's pool gives its cached blocks back to the device, so that
    test processes sharing one GPU (scripts/pytest_shards.py) do not starve each other."""
    yield
    if HAS_GPU and "gpu" in request.keywords:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


@pytest.fixture
def rng(request):
    """Fresh random data every run; the seed is printed so a failure can be replayed."""
    import numpy as np
    seed = int(os.environ.get("CUATTN_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"\n[seed] {request.node.nodeid}: CUATTN_TEST_SEED={seed}")
    return np.random.default_rng(seed)
