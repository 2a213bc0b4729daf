"""The command line (``cuattn`` / ``python -m cuattn``) and the architecture check behind it.

CPU only. Bad command lines end in one line on stderr, exit code 2 and no traceback.
Most tests call ``main()`` in this process; the first runs the real ``python -m cuattn``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuattn import shipped as shipped_set
from cuattn.__main__ import main
from cuattn.jit import cache, compiler

REPO = Path(__file__).resolve().parent.parent


def _cli(*args, cache_dir):
    env = dict(os.environ, CUATTN_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "cuattn", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def _main(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(args)`` in this process."""
    try:
        rc = main(list(args))
    except SystemExit as exc:       # argparse ends --help and bad command lines so
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_precompile_info_list_clear(tmp_path):
    r = _cli("precompile", "--arch", "sm_90", "--ops", "merge", "-q", cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    n = len(shipped_set.shipped(["merge"]))
    assert f"{n} variants, {n} compiled" in r.stdout
    r = _cli("info", cache_dir=tmp_path)
    assert r.returncode == 0 and f"({n} kernels" in r.stdout and "sm_90" in r.stdout
    assert "cuda-bindings" in r.stdout
    assert "sm_90a (arch-specific" in r.stdout      # the Hopper kernels' target
    r = _cli("cache", "list", cache_dir=tmp_path)
    listed = r.stdout.splitlines()
    assert r.returncode == 0 and len(listed) == n
    assert all(line.endswith(".cubin") and "/sm_90/" in line for line in listed)
    r = _cli("cache", "clear", cache_dir=tmp_path)
    assert r.returncode == 0 and f"removed {n}" in r.stdout


def test_cli_precompile_without_gpu_needs_arch(tmp_path, monkeypatch, capsys):
    from tests.conftest import HAS_GPU
    if HAS_GPU:
        pytest.skip("this machine has a GPU, so --arch is optional here")
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path))
    rc, _, err = _main(capsys, "precompile")
    assert rc == 2 and "--arch" in err and len(err.splitlines()) == 1


def _one_line_error(rc, err, *needles):
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("arch,why", [("sm_75", "minimum"), ("sm_70", "minimum"),
                                      ("foo", "not an architecture name"),
                                      ("90", "not an architecture name"),
                                      ("sm_86a", "start at sm_90a"),
                                      ("sm_999", "not a target of NVRTC")])
def test_cli_precompile_rejects_bad_arch_before_compiling(arch, why, tmp_path, monkeypatch,
                                                         capsys):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path))
    rc, out, err = _main(capsys, "precompile", "--arch", arch, "-q")
    _one_line_error(rc, err, repr(arch), why, "supported: sm_80")
    assert out == "" and cache.entries() == []


def test_check_arch():
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"):
        assert compiler.check_arch(arch) == arch
    supported = compiler.supported_archs()
    assert supported[0] == "sm_80" and {"sm_86", "sm_89", "sm_90"} <= set(supported)
    for bad in ("sm_75", "SM_90", "sm_90 ", "compute_90", "sm90", "", None, 90):
        with pytest.raises(ValueError, match="supported: sm_80, sm_86"):
            compiler.check_arch(bad)


def test_cli_unknown_op(capsys):
    rc, _, err = _main(capsys, "precompile", "--arch", "sm_90", "--ops", "merge", "bogus")
    _one_line_error(rc, err, "--ops", "'bogus'", "flash", "merge", "paged")


@pytest.mark.parametrize("jobs", ["0", "-1", "x"])
def test_cli_jobs_must_be_positive(jobs, capsys):
    rc, _, err = _main(capsys, "precompile", "--arch", "sm_90", "-j", jobs)
    _one_line_error(rc, err, "-j/--jobs", repr(jobs))


def test_cli_precompile_into_unwritable_cache_fails(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"       # a file where the directory should be: unwritable
    blocker.write_text("not a directory")   # even for root, unlike chmod
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(blocker / "cache"))
    rc, out, err = _main(capsys, "precompile", "--arch", "sm_90", "--ops", "merge", "-q")
    assert rc == 1 and out == "", (out, err)
    assert len(err.splitlines()) == 1 and "CUATTN_CACHE_DIR" in err
    assert str(blocker / "cache") in err


@pytest.mark.parametrize("action", [("list",), ()], ids=["list", "no-action"])
def test_cli_cache_list_says_when_empty(action, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUATTN_CACHE_DIR", str(tmp_path / "never_made"))
    rc, out, _ = _main(capsys, "cache", *action)       # cache alone lists
    assert rc == 0 and out.strip() == f"no kernels in {tmp_path / 'never_made'}"


def test_cli_cache_unknown_action_names_the_actions(capsys):
    rc, _, err = _main(capsys, "cache", "purge")
    assert rc == 2 and len(err.splitlines()) == 1 and "'list', 'clear'" in err


@pytest.mark.parametrize("command", [(), ("precompile",), ("bundle",), ("cache",), ("info",)])
def test_cli_help_is_plain_text(command, capsys):
    rc, out, _ = _main(capsys, *command, "--help")
    assert rc == 0 and "usage:" in out
    assert "`" not in out, out              # no raw RST markup
    if command == ():
        assert all(c in out for c in ("info", "precompile", "bundle", "cache", "list or clear"))
    if command == ("precompile",):
        assert "flash, merge, paged" in out                 # the valid ops
        assert "-j N, --jobs N" in out and "compiler threads" in out
        assert "sm_80 or newer" in out
    if command == ("bundle",):
        assert "default: sm_80 sm_86 sm_89 sm_90;" in " ".join(out.split())
        assert "flash, merge, paged" in out
    if command == ("cache",):
        assert "{list,clear}" in out


def test_console_script_is_main():
    tomllib = pytest.importorskip("tomllib")      # Python >= 3.11
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"cuattn": "cuattn.__main__:main"}
