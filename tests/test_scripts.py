"""The device scripts against the test suite: every test id scripts/sanitize.sh names in its
reduced suite exists (a renamed or re-parametrized test would otherwise make the sanitizer
run fail at collection, on the device); scripts/pytest_shards.py hands each shard the options
with their values and fails a shard that ran fewer tests than it was dealt; bench/run.py's CPU
behaviour."""
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


SHARDS = REPO / "scripts" / "pytest_shards.py"


def test_shards_keep_an_options_value_out_of_the_selection():
    # "--deselect ID" once took each shard's first test id as the value: ten tests unrun, unsaid
    spec = importlib.util.spec_from_file_location("pytest_shards", SHARDS)
    pytest_shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pytest_shards)
    args = ["-m", "gpu", "-rfE", "--deselect", "tests/a.py::slow", "--maxfail=3", "-k", "x",
            "tests/a.py"]
    assert pytest_shards.shard_options(args) == ["-rfE", "--deselect", "tests/a.py::slow",
                                                 "--maxfail=3"]


def test_shards_fail_when_a_shard_runs_fewer_tests_than_dealt(tmp_path):
    # --junit-prefix takes its value as the next argument and is not in VALUED: the shard's
    # first id becomes the prefix and that test does not run, as --deselect's did
    (tmp_path / "test_three.py").write_text("def test_a(): pass\n"
                                           "def test_b(): pass\n"
                                           "def test_c(): pass\n")
    done = subprocess.run([sys.executable, str(SHARDS), "-n", "1", "--logdir", "logs", "--",
                           "--junit-prefix", "p", "test_three.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shard0.txt: exit 0: 2 passed" in done.stdout, done.stdout
    assert "shard0.txt: accounts for 2 of the 3 tests it was dealt" in done.stdout, done.stdout
    # and the same selection without the option passes
    done = subprocess.run([sys.executable, str(SHARDS), "-n", "2", "--logdir", "logs", "--",
                           "test_three.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(3 tests): 3 passed" in done.stdout and "accounts for" not in done.stdout


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
