"""The compile cache's key sees every file NVRTC opens (CPU only: NVRTC needs no GPU).

NVRTC reports which headers it opened nowhere, so the tests make it say so: in a copy of
cuda_src/, every header ends with a ``#pragma message`` naming itself, and a syntax-only
compile of each kernel header prints the messages of the headers it reached.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

import cuattn  # noqa: F401  (defines every kernel's key class)
from cuattn.jit import Variant, cache, compiler

SRC = compiler.cuda_src_dir()
KERNEL_HEADERS = sorted(p.name for p in SRC.glob("*.cuh"))
_OPENED_RE = re.compile(r'#pragma message: "cuattn-opened (\S+)"')


def _key_classes():
    pending, seen = list(Variant.__subclasses__()), []
    while pending:
        cls = pending.pop()
        seen.append(cls)
        pending += cls.__subclasses__()
    return [c for c in seen if hasattr(c, "header")]


@pytest.fixture
def src_copy(tmp_path, monkeypatch):
    """A copy of cuda_src/ that the compiler and the cache use in place of the real one."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(SRC, copy)
    monkeypatch.setattr(compiler, "cuda_src_dir", lambda: copy)
    return copy


def _opened_by_nvrtc(source: str, arch: str = "sm_90a") -> set[str]:
    """The cuda_src/ headers NVRTC opens for ``source`` (in the marked copy)."""
    nvrtc = compiler._nvrtc()
    prog = compiler._check(nvrtc.nvrtcCreateProgram(
        source.encode(), str(compiler.program_name("probe")).encode(), 0, [], []), "create")
    try:
        options = [o.encode() for o in compiler.compile_options(arch) + ["-fdevice-syntax-only"]]
        nvrtc.nvrtcCompileProgram(prog, len(options), options)
        size = compiler._check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        compiler._check(nvrtc.nvrtcGetProgramLog(prog, log), "log")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return set(_OPENED_RE.findall(log.decode(errors="replace")))


def test_every_key_class_names_a_kernel_header():
    # so that walking the kernel headers below walks every generated source's includes
    headers = {cls.header for cls in _key_classes()}
    assert headers and headers <= set(KERNEL_HEADERS), headers - set(KERNEL_HEADERS)


@pytest.mark.parametrize("header", KERNEL_HEADERS)
def test_the_digest_covers_every_header_nvrtc_opens(header, src_copy):
    for path in src_copy.rglob("*.cuh"):
        rel = path.relative_to(src_copy).as_posix()
        path.write_text(path.read_text() + f'\n#pragma message("cuattn-opened {rel}")\n')
    source = f'#include "{header}"\n'
    opened = _opened_by_nvrtc(source)
    ours = {p.relative_to(src_copy).as_posix() for p in cache.included_files(source)
            if p.is_relative_to(src_copy)}
    assert header in opened
    assert opened == ours


def test_editing_a_header_included_from_its_own_folder_changes_the_key(src_copy):
    # common/wgmma.cuh includes "wgmma_ops.cuh" relative to common/, not to cuda_src/
    source = '#include "flash_fwd_sm90.cuh"\n'
    before = cache.digest(source, "sm_90a")
    nested = src_copy / "common" / "wgmma_ops.cuh"
    assert nested in cache.included_files(source)
    nested.write_text(nested.read_text() + "\n// an edit\n")
    assert cache.digest(source, "sm_90a") != before


def test_the_digest_covers_arch_options_and_nvrtc_version(monkeypatch):
    source = '#include "merge_attn_states.cuh"\n'
    before = cache.digest(source, "sm_90")
    assert cache.digest(source, "sm_80") != before
    options = compiler.compile_options
    monkeypatch.setattr(compiler, "compile_options", lambda arch: options(arch) + ["-G"])
    assert cache.digest(source, "sm_90") != before
    monkeypatch.setattr(compiler, "compile_options", options)
    assert cache.digest(source, "sm_90") == before
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (99, 0))
    assert cache.digest(source, "sm_90") != before


def test_the_digest_does_not_depend_on_where_cuda_src_lies(src_copy):
    source = '#include "flash_bwd_sm90.cuh"\n'
    moved = cache.digest(source, "sm_90a")
    os.utime(src_copy / "common" / "types.cuh")   # a new mtime, the same bytes
    assert cache.digest(source, "sm_90a") == moved
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "cuda_src_dir", lambda: SRC)
        assert cache.digest(source, "sm_90a") == moved


def test_the_digest_does_not_depend_on_where_the_cuda_headers_lie(src_copy, tmp_path,
                                                                  monkeypatch):
    # cuda_src/ and the CUDA headers both named in the key: whichever lies first on this
    # machine (CI's checkout sorted before its CUDA headers, this copy in /tmp after them)
    source = '#include "flash_fwd_sm90.cuh"\n'
    cuda = compiler.cuda_include_dir()
    keys = []
    for folder in ("0-before", "zz-after"):
        link = tmp_path / folder / "include"
        link.parent.mkdir()
        link.symlink_to(cuda, target_is_directory=True)
        monkeypatch.setattr(compiler, "cuda_include_dir", lambda link=link: str(link))
        assert any(p.is_relative_to(link) for p in cache.included_files(source))
        keys.append(cache.digest(source, "sm_90a"))
    assert keys[0] == keys[1]


def test_a_header_in_the_working_directory_is_never_compiled(tmp_path, monkeypatch):
    # NVRTC looks for the program's quoted includes in its name's folder first: named
    # plainly, that was the process's working directory
    for rel in ("merge_attn_states.cuh", "common/types.cuh"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("#error a stranger's header\n")
    monkeypatch.chdir(tmp_path)
    compiler.compile_cubin('#include "merge_attn_states.cuh"\n', "cwd_probe", "sm_80")
