"""ptxas reports of kernel variants, each variant compiled once per test session.

How the CPU compile checks are organised (read this before adding one, e.g. for a new
kernel):

- Every test that compiles goes through compile_reports(): it compiles only what this
  session has not compiled yet (keyed by (variant, arch), so a form two tests list is
  compiled once, whichever asks first), in parallel threads (NVRTC releases the GIL), and
  keeps every report for the tests after it. Never call cuattn.jit.compile_variant in a
  test directly.
- Two tiers, because one compile costs about half a second of a 2-core machine and the
  forms number about a thousand:
  * the default run (``python -m pytest``, the README's command) compiles a few forms of
    each kernel: the lightest and the heaviest of each sweep (the largest head dim, every
    hook, split, window), the shipped set's first and last of each op, and a few per older
    architecture. Its tests are named ``test_a_few_...`` or ``test_representative_...``.
  * every exhaustive sweep carries ``@pytest.mark.slow``: it skips in the default run and
    runs with ``python -m pytest -m slow`` (tests/conftest.py; .ci/run runs it as a second
    step).
- A new kernel: a function that lists its forms (e.g. tests/test_prefill.py
  _prefill_forms), a slow test compiling all of them, and a default test compiling a few
  of them (the same function with narrower arguments, or hand-picked extremes).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from cuattn.jit import Resources, Variant, compile_variant

_reports: dict[tuple[Variant, str], Resources] = {}


def compile_reports(variants, arch: str) -> list[tuple[Variant, Resources]]:
    """[(variant, its ptxas report for arch)], compiling each variant at most once per run."""
    variants = list(variants)
    todo = [v for v in dict.fromkeys(variants) if (v, arch) not in _reports]

    def one(v):
        return compile_variant(v, arch).resources()[v.name]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        for v, report in zip(todo, pool.map(one, todo)):
            _reports[(v, arch)] = report
    return [(v, _reports[(v, arch)]) for v in variants]


def unclean(reports) -> list[str]:
    """The variants of ``reports`` that spill, use a stack frame or exceed 255 registers
    (a kernel whose key declares a ``spill_bound``, the backward's, may spill up to that
    many bytes: its stack then holds the spilled values)."""
    out = []
    for v, r in reports:
        bound = getattr(v, "spill_bound", 0)
        if bound:
            bad = r.spill_stores > bound or r.stack_bytes > bound + 16
        else:
            bad = r.spill_stores or r.spill_loads or r.stack_bytes
        if bad or r.registers > 255:
            out.append(f"{v.name}: {r}")
    return out
