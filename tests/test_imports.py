"""No import circle among cuattn's modules (CPU; the source is parsed, nothing imported).

Every import statement counts, at module level and inside functions alike (an import inside
a function only delays the circle to the first call). Relative imports are resolved against
the importing module's package.

What an edge is: ``import a.b`` and ``from a.b import name`` are an edge to ``a.b``, and,
where ``a.b.name`` is itself a module, to that module as well (``from . import tuning``
reaches cuattn.tuning, not cuattn/__init__). Importing a submodule first runs its
package's ``__init__``; that is not counted as an edge to the package, because the package
is then either already imported or being imported by the very chain that got here (its
``__init__`` at the root), so it cannot close a circle that Python would trip over; and
an edge to a package's ``__init__`` only where the package itself is imported by name
(``from .paged import paged_attention``), which runs its ``__init__``'s imports.
"""
from __future__ import annotations

import ast
import os

CUATTN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuattn")


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every module under cuattn/ (a package: its __init__)."""
    out = {}
    root = os.path.dirname(CUATTN)
    for folder, _, files in os.walk(CUATTN):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, f)
    return out


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _targets(node, module: str, path: str, modules) -> set[str]:
    """The cuattn modules one import statement reaches."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:
        base = _package_of(module, path)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = set()
    for a in node.names:
        sub = f"{target}.{a.name}"
        if sub in modules:
            out.add(sub)
        elif target in modules:
            out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _targets(node, module, path, modules)
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}      # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "cuattn.tuning" in graph["cuattn.tuning_bwd"]           # from . import tuning
    assert "cuattn._launch" in graph["cuattn._overrides"]          # inside _changed()
    assert "cuattn.paged" in graph["cuattn"]                       # from .paged import ...
    assert "cuattn.jit.variant" in graph["cuattn.jit"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
