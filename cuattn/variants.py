"""The variants the library ships: what ``python -m cuattn precompile`` builds by default.

One entry per op; each op's module owns its list (dtypes x tuned sizes x the flags that
change code). Anything outside these lists compiles on first use.
"""
from __future__ import annotations

from collections.abc import Callable

from .jit import Variant


def _flash() -> list[Variant]:
    from .flash import shipped_variants
    return shipped_variants()


def _merge() -> list[Variant]:
    from .merge import shipped_variants
    return shipped_variants()


def _paged() -> list[Variant]:
    from .paged import shipped_variants
    return shipped_variants()


SHIPPED: dict[str, Callable[[], list[Variant]]] = {
    "flash": _flash,
    "merge": _merge,
    "paged": _paged,
}


def shipped(ops: list[str] | None = None) -> list[Variant]:
    ops = list(SHIPPED) if not ops else ops
    unknown = [op for op in ops if op not in SHIPPED]
    if unknown:
        raise ValueError(f"--ops: unknown op(s) {unknown}; known: {sorted(SHIPPED)}")
    return [v for op in ops for v in SHIPPED[op]()]
