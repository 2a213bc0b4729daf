"""The device scripts against the test suite: every test id scripts/sanitize.sh names in its
reduced suite exists (a renamed or re-parametrized test would otherwise make the sanitizer
run fail at collection, on the device); scripts/pytest_shards.py hands each shard the options
with their values; bench/run.py's CPU behaviour."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_sanitizer_suite_names_existing_tests():
    script = (REPO / "scripts" / "sanitize.sh").read_text()
    ids = re.search(r'^reduced="([^"]*)"', script, re.MULTILINE).group(1).split()
    assert len(ids) > 40, ids
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *ids], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    # each named id (a file or an unparametrized name names several tests) collects one or more
    for test_id in ids:
        assert any(line == test_id or line.startswith((test_id + "::", test_id + "["))
                   for line in collected), test_id


def test_shards_keep_an_options_value_out_of_the_selection():
    # "--deselect ID" once took each shard's first test id as the value: ten tests unrun, unsaid
    spec = importlib.util.spec_from_file_location("pytest_shards",
                                                  REPO / "scripts" / "pytest_shards.py")
    pytest_shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pytest_shards)
    args = ["-m", "gpu", "-rfE", "--deselect", "tests/a.py::slow", "--maxfail=3", "-k", "x",
            "tests/a.py"]
    assert pytest_shards.shard_options(args) == ["-rfE", "--deselect", "tests/a.py::slow",
                                                 "--maxfail=3"]


# -- bench/run.py ------------------------------------------------------------------------------

def test_bench_refuses_an_unknown_suite_and_lists_them(capsys):
    import pytest

    from bench import run
    with pytest.raises(SystemExit) as done:
        run.main(["--suite", "foo"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "invalid choice: 'foo'" in err
    assert all(f"'{suite}'" in err for suite in run.SUITES)


def test_bench_without_a_gpu_precompiles_and_says_what_next(monkeypatch, capsys):
    """The precompile itself is tests/test_cli.py's: a stand-in records its command line."""
    import cuattn.__main__
    from bench import run
    from cuattn.jit import cache
    called = []
    monkeypatch.setattr(run, "_has_gpu", lambda: False)
    monkeypatch.setattr(cuattn.__main__, "main", lambda argv: called.append(argv) or 0)
    assert run.main(["--arch", "sm_86"]) == 0
    out = capsys.readouterr().out
    assert called == [["precompile", "--arch", "sm_86"]]
    assert "precompile --arch sm_86" in out and "..." not in out
    assert str(cache.cache_dir()) in out and "python bench/run.py" in out
