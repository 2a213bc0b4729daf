"""ptxas reports of kernel variants, each variant compiled once per test session.

Several CPU tests check overlapping sets (the shipped set, every flash form, odd paged
variants, ...): compile_reports() compiles what this session has not compiled yet, in
parallel (NVRTC releases the GIL), and keeps every report for the tests after it.
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
    """The variants of ``reports`` that spill, use a stack frame or exceed 255 registers."""
    return [f"{v.name}: {r}" for v, r in reports
            if r.spill_stores or r.spill_loads or r.stack_bytes or r.registers > 255]
