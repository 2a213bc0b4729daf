"""The bundle: cubins a wheel carries (``python -m cuattn bundle``), found before the disk
cache and NVRTC, under a key that leaves out the user's toolchain. CPU only.

The wheel itself (built, installed into a fresh venv, loading a bundled cubin with NVRTC
unusable) is tests/test_jit.py's test_installed_wheel_finds_its_kernel_sources.
"""
from __future__ import annotations

import shutil

import pytest

from cuattn import shipped
from cuattn.__main__ import main
from cuattn.jit import CompileResult, build, cache, compiler
from cuattn.tuning import merge_variant

KEY = merge_variant("f16", 64, True)
SOURCE = KEY.source()
# The smallest bytes cache.looks_complete takes for a whole ELF64 file (no headers, no
# sections): a stand-in cubin, never loaded.
FAKE_CUBIN = b"\x7fELF\x02" + bytes(59)


def _bundle_key(arch="sm_80"):
    return cache.digest(SOURCE, arch, toolchain=False)


def test_the_bundle_key_ignores_the_nvrtc_version(monkeypatch):
    before, cached = _bundle_key(), cache.digest(SOURCE, "sm_80")
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (99, 9))
    assert _bundle_key() == before
    assert cache.digest(SOURCE, "sm_80") != cached        # the disk cache's key still does


def test_the_bundle_key_ignores_the_cuda_headers(monkeypatch):
    cuda = compiler.cuda_include_dir()
    assert any(p.is_relative_to(cuda) for p in cache.included_files(SOURCE))  # cuda_fp16.h
    before, cached = _bundle_key(), cache.digest(SOURCE, "sm_80")
    read = cache._read
    monkeypatch.setattr(cache, "_read", lambda path: (read(path)[0], b"other bytes")
                        if path.startswith(cuda) else read(path))
    assert _bundle_key() == before
    assert cache.digest(SOURCE, "sm_80") != cached


def test_the_bundle_key_follows_cuattns_headers_the_arch_and_the_options(tmp_path,
                                                                          monkeypatch):
    before = _bundle_key()
    assert _bundle_key("sm_86") != before
    src = tmp_path / "cuda_src"
    shutil.copytree(compiler.cuda_src_dir(), src)
    monkeypatch.setattr(compiler, "cuda_src_dir", lambda: src)
    assert _bundle_key() == before        # where cuda_src/ lies (checkout or wheel) is no input
    header = src / "common" / "softmax.cuh"   # included by merge_attn_states.cuh
    header.write_text(header.read_text() + "\n// an edit\n")
    edited = _bundle_key()
    assert edited != before
    options = compiler.compile_options
    monkeypatch.setattr(compiler, "compile_options", lambda arch: options(arch) + ["-G"])
    assert _bundle_key() != edited


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """An empty bundle folder and disk cache in place of the package's and the user's."""
    monkeypatch.setattr(cache, "bundle_dir", lambda: tmp_path / "cubins")
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cubins"


class NvrtcCalled(Exception):
    pass


def _no_nvrtc(source, name, arch):
    raise NvrtcCalled(name)


def test_a_bundled_cubin_is_taken_before_the_cache_and_nvrtc(bundle, monkeypatch):
    path = cache.bundle_path(KEY.name, SOURCE, "sm_80")
    assert path.parent == bundle / "sm_80" and path.name.startswith(KEY.name)
    path.parent.mkdir(parents=True)
    path.write_bytes(FAKE_CUBIN)
    monkeypatch.setattr(compiler, "compile_cubin", _no_nvrtc)
    assert cache.get_cubin(KEY.name, SOURCE, "sm_80") == (FAKE_CUBIN, False)
    assert build(KEY, "sm_80") is False                 # precompile skips it
    assert cache.entries() == []
    # What the loader does when the driver refuses the cubin: compile, not reuse it.
    with pytest.raises(NvrtcCalled):
        cache.get_cubin(KEY.name, SOURCE, "sm_80", force=True)
    # Not in the bundle: another arch, another form, or a truncated file.
    for name, arch in ((KEY.name, "sm_86"), ("other", "sm_80")):
        with pytest.raises(NvrtcCalled):
            cache.get_cubin(name, SOURCE, arch)
    path.write_bytes(FAKE_CUBIN[:40])
    with pytest.raises(NvrtcCalled):
        cache.get_cubin(KEY.name, SOURCE, "sm_80")


def test_bundle_command_writes_the_shipped_set_and_only_it(bundle, monkeypatch, capsys):
    compiled = []

    def fake_compile(source, name, arch):   # the command's bookkeeping, not NVRTC's work
        compiled.append((name, arch))
        return CompileResult(cubin=FAKE_CUBIN, log="")

    monkeypatch.setattr(compiler, "compile_cubin", fake_compile)
    stale = bundle / "sm_80" / "gone-0123.cubin"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(FAKE_CUBIN)
    assert main(["bundle", "--arch", "sm_80", "sm_90", "--ops", "merge", "flash", "-q"]) == 0
    want = {(v.name, v.target_arch(a)) for a in ("sm_80", "sm_90")
            for v in shipped.shipped(["merge", "flash"], a)}
    assert sorted(compiled) == sorted(want)
    assert {a for _, a in want} == {"sm_80", "sm_90", "sm_90a"}
    files = {(p.parent.name, p.name) for p in cache.bundle_entries()}
    assert len(files) == len(want) and not stale.exists()
    out = capsys.readouterr().out
    assert f"{len(want)} compiled, 0 already bundled, 0 failed, 1 stale removed" in out
    assert main(["bundle", "--arch", "sm_80", "sm_90", "--ops", "merge", "flash", "-q"]) == 0
    assert f"0 compiled, {len(want)} already bundled" in capsys.readouterr().out
    assert main(["info"]) == 0
    assert f"({len(want)} kernels" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["sm_90a", "sm_75", "hopper"])
def test_bundle_rejects_an_arch_it_cannot_bundle(arch, bundle, capsys):
    rc = main(["bundle", "--arch", arch, "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("bundle: --arch"), err
    assert not bundle.exists()
