"""NVRTC through cuda-python: CUDA C++ source -> cubin for one named architecture.

No GPU is needed: the architecture is always given explicitly (``sm_90``), which is
what lets CI and ``python -m cuattn precompile --arch`` build kernels on a CPU machine.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path



class CompileError(RuntimeError):
    """NVRTC rejected a variant; carries the variant's name and the compiler's log."""

    def __init__(self, variant: str, arch: str, log: str):
        super().__init__(f"NVRTC failed to compile {variant} for {arch}:\n{log}")
        self.variant, self.arch, self.log = variant, arch, log


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel (``--ptxas-options=-v``)."""
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str

    def resources(self) -> dict[str, Resources]:
        return parse_ptxas_report(self.log)


@functools.cache
def cuda_src_dir() -> Path:
    """The kernel sources: inside the installed package, or at the top of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"cuattn: kernel sources (cuda_src/) not found near {package}")


@functools.cache
def cuda_include_dir() -> str:
    """Directory holding cuda_fp16.h / cuda_bf16.h, which NVRTC does not find by itself."""
    from cuda import pathfinder
    found = pathfinder.find_nvidia_header_directory("cudart")
    if found is None:
        raise FileNotFoundError(
            "cuattn: CUDA runtime headers (cuda_fp16.h) not found; install "
            "nvidia-cuda-runtime-cu12 (CUDA 12) or nvidia-cuda-runtime (CUDA 13)")
    return str(found)


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"NVRTC {what} failed: {err}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


# -- target architectures ---------------------------------------------------------------------
# The kernels use cp.async, bf16 mma.sync and ldmatrix: compute capability 8.0 (Ampere) and up.
MIN_COMPUTE_CAPABILITY = 80
_ARCH_RE = re.compile(r"sm_(\d{2,3})(a?)")


@functools.cache
def supported_archs() -> tuple[str, ...]:
    """The targets cuattn compiles for with this NVRTC: its real architectures from sm_80 on."""
    archs = _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return tuple(f"sm_{cc}" for cc in archs if cc >= MIN_COMPUTE_CAPABILITY)


def check_arch(arch) -> str:
    """``arch`` itself if cuattn can compile for it, else a ValueError saying why.

    Accepted: ``sm_XY`` with XY >= 80 that this NVRTC supports, optionally with the ``a``
    suffix of the arch-specific targets (``sm_90a``, from sm_90 on). The message starts
    with the value and ends with the supported list; callers prefix what it came from.
    """
    match = _ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    cc = int(match.group(1)) if match else None
    if match is None:
        problem = "is not an architecture name: expected sm_XY, such as sm_90"
    elif cc < MIN_COMPUTE_CAPABILITY:
        problem = (f"is below cuattn's minimum, compute capability "
                   f"{MIN_COMPUTE_CAPABILITY // 10}.{MIN_COMPUTE_CAPABILITY % 10}")
    elif match.group(2) and cc < 90:
        problem = "has no arch-specific ('a') form: those start at sm_90a"
    elif f"sm_{cc}" not in supported_archs():
        problem = f"is not a target of NVRTC {'.'.join(map(str, nvrtc_version()))}"
    else:
        return arch
    raise ValueError(f"{arch!r} {problem}; supported: {', '.join(supported_archs())} "
                     "(and sm_90a etc. for the arch-specific features)")


def include_dirs() -> list[Path]:
    """NVRTC's include path (``-I``), in its search order."""
    return [cuda_src_dir(), Path(cuda_include_dir())]


def program_name(variant: str) -> Path:
    """The name NVRTC gives a variant's generated source. NVRTC resolves a quoted include
    against the including file's folder first, and for the program itself that folder is
    its name's: named inside cuda_src/, a generated ``#include "flash_fwd.cuh"`` finds the
    kernel header there, never a file of that name in the process's working directory."""
    return cuda_src_dir() / f"{variant}.cu"


def compile_options(arch: str) -> list[str]:
    """Every option that reaches NVRTC (part of the cache key)."""
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--use_fast_math",        # exp2f/__expf and approximate division in the softmax
        "--ptxas-options=-v",     # register / spill report in the log, checked by tests
    ] + [f"-I{d}" for d in include_dirs()]


def compile_cubin(source: str, variant: str, arch: str) -> CompileResult:
    """Compile one translation unit to a cubin; raise CompileError with NVRTC's log."""
    return _compile(source, variant, arch, ptx=False)


def compile_ptx(source: str, variant: str, arch: str) -> str:
    """PTX of one translation unit (tests read constants back from it)."""
    return _compile(source, variant, arch.replace("sm_", "compute_"), ptx=True).cubin.decode()


def _compile(source: str, variant: str, arch: str, ptx: bool) -> CompileResult:
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(),
                                           str(program_name(variant)).encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        options = [o.encode() for o in compile_options(arch)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log_buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, log_buf), "nvrtcGetProgramLog")
        log = log_buf.rstrip(b"\0 ").decode(errors="replace")
        if int(err) != 0:
            raise CompileError(variant, arch, log)
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else
                         (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        size = _check(get_size(prog), get_size.__name__)
        binary = b" " * size
        _check(get(prog, binary), get.__name__)
        return CompileResult(cubin=bytes(binary).rstrip(b"\0") if ptx else bytes(binary), log=log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_FUNC_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY_RE = re.compile(r"Compiling entry function '(\S+)'")
_REGS_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log: str) -> dict[str, Resources]:
    """{kernel name: Resources} for every entry function in a ptxas -v report."""
    out: dict[str, Resources] = {}
    entry = func = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            entry, frame = m.group(1), (0, 0, 0)
        elif m := _FUNC_RE.search(line):
            func = m.group(1)
        elif (m := _FRAME_RE.search(line)) and func == entry:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _REGS_RE.search(line)) and entry:
            out[entry] = Resources(int(m.group(1)), *frame)
            entry = None
    return out
