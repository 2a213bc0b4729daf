"""examples/*.py: each runs and checks its own result on a GPU (exit 0), and says in one
line that it cannot run when it cannot (exit 2) instead of pretending to succeed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HAS_GPU

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.py") if not p.name.startswith("_"))
CANNOT_RUN = 2


def _run(example: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(example)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_every_example_is_tested():
    assert {p.name for p in EXAMPLES} >= {"paged_decode.py", "engine_step.py",
                                          "interop_torch.py", "interop_jax.py", "streams.py"}


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: the examples can run here")
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_without_a_gpu_says_it_cannot_run(example):
    r = _run(example)
    assert r.returncode == CANNOT_RUN, (r.stdout, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"{example.name}: cannot run here: no usable CUDA device" in r.stderr
    assert "python -m cuattn info" in r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_and_checks_its_result(example):
    r = _run(example)
    if r.returncode == CANNOT_RUN and ("not installed" in r.stderr or " has no " in r.stderr):
        pytest.skip(r.stderr.strip())         # torch / jax (with a GPU backend) missing
    assert r.returncode == 0, (r.stdout, r.stderr)
