"""The run-time compiler and its cache (CPU only: NVRTC needs no GPU when the arch is named)."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from cuattn import shipped as shipped_set, tuning
from cuattn.jit import CompileError, Variant, cache, compiler
from cuattn.jit.compiler import compile_ptx, parse_ptxas_report
from tests.compiled import compile_reports, unclean

REPO = Path(__file__).resolve().parent.parent
KEY = tuning.merge_variant("bf16", 128, False)


def _all_variant_classes():
    shipped_set.shipped()   # imports every op module
    pending, seen = list(Variant.__subclasses__()), []
    while pending:
        cls = pending.pop()
        seen.append(cls)
        pending += cls.__subclasses__()
    return sorted(seen, key=lambda c: c.__name__)


def test_names_are_readable_symbols():
    assert KEY.name == "cuattn_merge__bf16_hd128_pair_t256"
    names = [v.name for v in shipped_set.shipped()]
    assert len(names) == len(set(names)), "two shipped variants share a symbol"
    for name in names:
        assert re.fullmatch(r"cuattn_[a-z0-9_]+__[a-z0-9_]+", name), name


@pytest.mark.parametrize("cls", _all_variant_classes(), ids=lambda c: c.__name__)
def test_every_key_field_spells_itself_once(cls):
    """A key's fields each declare their symbol part (cuattn.jit.key_field), and a key that
    orders its parts or template arguments otherwise than its fields lists every field
    once."""
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields if f.metadata.get("name") is None] == []
    for order in (cls.name_order, cls.traits_order):
        assert not order or sorted(order) == sorted(f.name for f in fields), order


@pytest.mark.parametrize("cls", _all_variant_classes(), ids=lambda c: c.__name__)
def test_params_struct_layout_matches_cpp(cls):
    """Offsets of the NumPy mirror equal the C++ struct's, read back from compiled PTX."""
    params = cls.params
    fields = list(params.offsets())
    writes = "\n".join(
        f"  o[{i + 1}] = (unsigned long long)&(((cuattn::{params.cpp_name}*)0)->{f});"
        for i, f in enumerate(fields))
    src = (f'#include "{cls.header}"\nextern "C" __global__ void probe(unsigned long long* o) {{\n'
           f"  o[0] = sizeof(cuattn::{params.cpp_name});\n{writes}\n}}\n")
    ptx = compile_ptx(src, "probe", "sm_90")
    regs = dict(re.findall(r"mov\.u64\s+(%rd\d+),\s*(\d+);", ptx))
    got = {}
    for off, val in re.findall(r"st\.global\.u64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|\d+);", ptx):
        got[int(off or 0) // 8] = int(regs.get(val, val))
    assert got.get(0) == params.dtype.itemsize, f"sizeof({params.cpp_name})"
    for i, f in enumerate(fields):
        assert got.get(i + 1, 0) == params.offsets()[f], f"{params.cpp_name}.{f}"


@pytest.mark.slow
def test_every_shipped_variant_compiles_for_sm90_without_spills():
    shipped = shipped_set.shipped()
    reports = compile_reports(shipped, "sm_90")
    assert [v.name for v, _ in reports] == [v.name for v in shipped]
    assert unclean(reports) == []


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_representative_variants_compile(arch):
    """The first and last shipped variant of each op (the whole set for sm_90: marker slow)."""
    by_op: dict[str, list] = {}
    for v in shipped_set.shipped(arch=arch):
        by_op.setdefault(v.op, []).append(v)
    assert unclean(compile_reports([v for vs in by_op.values() for v in (vs[0], vs[-1])],
                                   arch)) == []


def test_compile_error_carries_name_and_log():
    with pytest.raises(CompileError) as err:
        compiler.compile_cubin("this is not C++", "cuattn_broken__x", "sm_90")
    assert "cuattn_broken__x" in str(err.value) and "error" in err.value.log


def test_ptxas_report_parser():
    log = textwrap.dedent("""\
        ptxas info    : Compiling entry function 'k1' for 'sm_90'
        ptxas info    : Function properties for k1
            16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 255 registers, used 1 barriers
        ptxas info    : Compiling entry function 'k2' for 'sm_90'
        ptxas info    : Function properties for k2
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 40 registers""")
    r = parse_ptxas_report(log)
    assert r["k1"].registers == 255 and r["k1"].spill_stores == 8 and r["k1"].stack_bytes == 16
    assert r["k2"].registers == 40 and r["k2"].spill_loads == 0


# -- the disk cache -------------------------------------------------------------------------

def test_cache_hit_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path))
    cubin1, compiled1 = cache.get_cubin(KEY.name, KEY.source(), "sm_90")
    cubin2, compiled2 = cache.get_cubin(KEY.name, KEY.source(), "sm_90")
    assert compiled1 and not compiled2 and cubin1 == cubin2
    (entry,) = cache.entries()
    assert entry.parent.name == "sm_90" and entry.name.startswith(KEY.name + "-")
    assert cache.looks_complete(entry.read_bytes())


def _build_in_subprocess(cache_dir: Path) -> subprocess.CompletedProcess:
    code = ("from cuattn.tuning import merge_variant; from cuattn.jit import build; "
            "print('compiled' if build(merge_variant('bf16', 128, False), 'sm_90') "
            "else 'cached')")
    env = dict(os.environ, CUATTN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_second_process_compiles_nothing(tmp_path):
    first = _build_in_subprocess(tmp_path).communicate()
    second = _build_in_subprocess(tmp_path).communicate()
    assert first[0].strip() == "compiled", first[1]
    assert second[0].strip() == "cached", second[1]


def test_concurrent_processes_compile_once_and_all_succeed(tmp_path):
    procs = [_build_in_subprocess(tmp_path) for _ in range(4)]
    outs = [p.communicate() + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in outs), outs
    assert sorted(o.strip() for o, _, _ in outs).count("compiled") == 1, outs
    entries = list((tmp_path / "sm_90").glob("*.cubin"))
    assert len(entries) == 1 and cache.looks_complete(entries[0].read_bytes())
    assert not list(tmp_path.rglob("*.tmp"))


def _precompile(cache_dir: Path, src: Path) -> subprocess.Popen:
    env = dict(os.environ, CUATTN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(src))
    return subprocess.Popen([sys.executable, "-m", "cuattn", "precompile", "--arch", "sm_90",
                             "--ops", "merge", "-q"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _counts(stdout: str) -> tuple[int, int]:
    """(variants, compiled) from precompile's summary line."""
    n, compiled = re.search(r"(\d+) variants, (\d+) compiled", stdout).groups()
    return int(n), int(compiled)


def test_eight_concurrent_precompiles_leave_a_consistent_cache(tmp_path):
    """Eight precompiles of the shipped merge variants into one fresh cache at once (~10 s
    on two cores): all succeed, each variant is compiled exactly once (the
    per-entry lock), every entry is a whole ELF, no temp file is left; a later run compiles
    nothing, and a cubin truncated on disk is detected and rebuilt by the next one."""
    import shutil
    src, cache_dir = tmp_path / "src", tmp_path / "cache"
    for d in ("cuattn", "cuda_src"):     # a snapshot: edits to the checkout cannot change keys
        shutil.copytree(REPO / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    procs = [_precompile(cache_dir, src) for _ in range(8)]
    outs = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in outs), outs
    n = _counts(outs[0][0])[0]
    assert sum(_counts(out)[1] for out, _, _ in outs) == n, outs
    entries = sorted((cache_dir / "sm_90").glob("*.cubin"))
    assert len(entries) == n and all(cache.looks_complete(p.read_bytes()) for p in entries)
    assert not [p for p in cache_dir.rglob("*") if p.name.endswith(".tmp")]

    out, err = _precompile(cache_dir, src).communicate(timeout=600)
    assert f"{n} variants, 0 compiled, {n} already cached or bundled, 0 failed" in out, err

    victim = entries[n // 2]
    good = victim.read_bytes()
    with open(victim, "r+b") as f:
        f.truncate(len(good) // 3)
    out, err = _precompile(cache_dir, src).communicate(timeout=600)
    assert _counts(out)[1] == 1, (out, err)
    assert victim.read_bytes() == good


def test_editing_an_included_header_changes_the_key(tmp_path, monkeypatch):
    import shutil
    src = tmp_path / "cuda_src"
    shutil.copytree(compiler.cuda_src_dir(), src)
    monkeypatch.setattr(compiler, "cuda_src_dir", lambda: src)
    before = cache.digest(KEY.source(), "sm_90")
    header = src / "common" / "softmax.cuh"   # included by merge_attn_states.cuh
    header.write_text(header.read_text() + "\n// an edit\n")
    assert cache.digest(KEY.source(), "sm_90") != before
    assert src / "common" / "softmax.cuh" in cache.included_files(KEY.source())
    assert cache.digest(KEY.source(), "sm_80") != cache.digest(KEY.source(), "sm_90")


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_corrupt_entry_is_rebuilt(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path))
    good, _ = cache.get_cubin(KEY.name, KEY.source(), "sm_90")
    (entry,) = cache.entries()
    entry.write_bytes({"truncate": good[: len(good) // 2], "empty": b"",
                       "garbage": b"\x7fELF" + os.urandom(200)}[damage])
    cubin, compiled = cache.get_cubin(KEY.name, KEY.source(), "sm_90")
    assert compiled and cubin == good and entry.read_bytes() == good


def test_unwritable_cache_dir_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(blocker / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cubin1, _ = cache.get_cubin(KEY.name, KEY.source(), "sm_90")
        other = tuning.merge_variant("f16", 64, True)
        cubin2, _ = cache.get_cubin(other.name, other.source(), "sm_90")
    assert cache.looks_complete(cubin1) and cache.looks_complete(cubin2)
    msgs = [str(w.message) for w in caught if "not writable" in str(w.message)]
    assert len(msgs) == 1, msgs


def test_cache_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path))
    cache.get_cubin(KEY.name, KEY.source(), "sm_90")
    assert cache.clear() == 1 and cache.entries() == []


# -- packaging --------------------------------------------------------------------------------

# Run in the fresh venv: a bundled form resolves to its cubin with NVRTC unusable and an
# empty cache, a form outside the bundle still compiles (into the cache).
_IN_THE_VENV = """
import sys, cuattn, cuattn.jit as jit
from cuattn.jit import cache, compiler
from cuattn.tuning import merge_variant
print(cuattn.__file__, compiler.cuda_src_dir(), cache.bundle_dir())
key = merge_variant("f16", 64, True)
def unusable():
    raise AssertionError("NVRTC called")
nvrtc, compiler._nvrtc = compiler._nvrtc, unusable
cubin, compiled = cache.get_cubin(key.name, key.source(), "sm_80")
assert not compiled and cubin == cache.bundle_path(key.name, key.source(), "sm_80").read_bytes()
assert cache.entries() == [], cache.entries()
compiler._nvrtc = nvrtc
cubin, compiled = cache.get_cubin(key.name, key.source(), "sm_90")
assert compiled and len(cache.entries()) == 1 and cache.looks_complete(cubin)
"""


def test_installed_wheel_finds_its_kernel_sources(tmp_path):
    """Bundle the merge forms for sm_80 into a copy of the checkout, build its wheel, install
    it into a fresh venv, and load from there (~6 s on two cores).

    The copy keeps the checkout's cuattn/cubins/ untouched (``python -m`` imports cuattn from
    its working directory first). The venv sees this interpreter's
    packages (cupy, NVRTC; --system-site-packages), but its own site-packages, holding the
    wheel, comes first, so the wheel, not this checkout (nor an editable install of it),
    provides cuattn."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".venv",
        "cubins"))
    r = subprocess.run([sys.executable, "-m", "cuattn", "bundle", "--arch", "sm_80", "--ops",
                        "merge", "-q"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n = len(shipped_set.shipped(["merge"], "sm_80"))
    assert f"{n} variants, {n} compiled" in r.stdout
    wheel_dir = tmp_path / "wheel"
    # (run outside the checkout: its build/ folder would pass for the build package)
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(wheel_dir),
                        str(repo)], cwd=tmp_path, capture_output=True, text=True)
    if "No module named build" in r.stderr:
        pytest.fail("the 'build' package is missing from this environment: pip install build "
                    "(README's install lines and the [test] extra list it)", pytrace=False)
    assert r.returncode == 0, r.stderr
    (wheel,) = wheel_dir.glob("cuattn-*.whl")
    import zipfile
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "cuattn/cuda_src/merge_attn_states.cuh" in names
        assert "cuattn/cuda_src/common/types.cuh" in names
        assert "cuattn/cuda_src/params/merge.cuh" in names
        assert "cuattn/paged/attention.py" in names
        assert len([m for m in names if m.startswith("cuattn/cubins/sm_80/")]) == n
    venv = tmp_path / "venv"
    # (without pip of its own: this interpreter's, seen through the system site-packages,
    # installs into the venv)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # (--ignore-installed: pip would take an installed cuattn of the same version, such as
    # the editable one in this interpreter's site-packages, as already satisfying the wheel)
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--ignore-installed", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUATTN_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([python, "-c", _IN_THE_VENV], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    site = str(venv / "lib")
    assert all(path.startswith(site) for path in r.stdout.split()), r.stdout


# -- the device check ---------------------------------------------------------------------------

def test_no_usable_device_is_one_clear_error():
    from tests.conftest import HAS_GPU
    if HAS_GPU:
        pytest.skip("this machine has a GPU")
    from cuattn.jit import DeviceError, device_info
    device_info.cache_clear()
    with pytest.raises(DeviceError, match=r"no usable CUDA device 0: .*python -m cuattn info"):
        device_info(0)


def test_a_gpu_below_sm80_is_refused_before_any_compile(monkeypatch):
    from cuattn.jit import DeviceError, device

    class Turing:               # what cupy.cuda.Device reports for a T4
        compute_capability = "75"
        attributes = {"MultiProcessorCount": 40, "MaxSharedMemoryPerMultiprocessor": 65536,
                      "MaxSharedMemoryPerBlockOptin": 65536}

    monkeypatch.setattr(device.cupy.cuda, "Device", lambda device_id: Turing())
    monkeypatch.setattr(device.cupy.cuda.runtime, "getDeviceProperties",
                        lambda device_id: {"name": b"Tesla T4"})
    device.device_info.cache_clear()
    try:
        with pytest.raises(DeviceError, match=r"device 0 \(Tesla T4\) has compute capability "
                                              r"7\.5; cuattn's kernels need 8\.0"):
            device.device_info(0)
    finally:
        device.device_info.cache_clear()
