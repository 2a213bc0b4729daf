"""The adapters as modules, on the CPU, with or without the frameworks installed: ``import
cuattn`` imports neither JAX nor torch; ``import cuattn.jax`` / ``cuattn.torch`` without
the framework is one ImportError that says what to install; docs/api.md's signature blocks
of the adapters match the code (where the framework imports). The adapters' own behaviour:
tests/test_adapters_jax.py and tests/test_adapters_torch.py.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_docs import API, SIGNATURE, _parameters, code_blocks

REPO = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_cuattn_imports_no_framework():
    r = _python("import sys, cuattn\n"
                "print(sorted(m for m in ('jax', 'torch', 'flax', 'tensorflow') "
                "if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("module,framework,install", [
    ("cuattn.jax", "jax", 'pip install "jax[cuda12]"'),
    ("cuattn.torch", "torch", "pip install torch"),
])
def test_adapter_without_its_framework_is_one_clear_import_error(module, framework, install):
    """The framework blocked (sys.modules[name] = None makes its import fail, as if it were
    not installed): one ImportError naming the package to install."""
    r = _python(f"import sys\nsys.modules[{framework!r}] = None\n"
                f"try:\n    import {module}\n"
                "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
                "import cuattn\nprint(cuattn.flash_forward.__name__)")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"ImportError {module} needs"), lines
    assert install in lines[0], lines
    assert lines[1] == "flash_forward"          # cuattn itself is untouched


ADAPTER_CALL = re.compile(r"cuattn\.(jax|torch)\.(\w+)\(")


def _adapter_signatures():
    """(module, name, documented signature) of every cuattn.jax / cuattn.torch call in
    docs/api.md's signature blocks."""
    found = []
    for where, src in code_blocks(API):
        if not src.startswith(SIGNATURE + "\n"):
            continue
        code = "\n".join(line.split("#", 1)[0] for line in src.splitlines())
        for m in ADAPTER_CALL.finditer(code):
            depth, end = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(code[end], 0)
                end += 1
            namespace: dict = {}
            exec(f"def {m.group(2)}({code[m.end():end - 1]}): pass", namespace)  # our text
            found.append((m.group(1), m.group(2), inspect.signature(namespace[m.group(2)])))
    return found


def test_api_reference_documents_each_adapter_function():
    documented = {(module, name) for module, name, _ in _adapter_signatures()}
    assert documented == {("jax", "flash_attention"), ("jax", "flash_attention_varlen"),
                          ("torch", "flash_attn_func"), ("torch", "flash_attn_varlen_func")}


@pytest.mark.parametrize("module", ["jax", "torch"])
def test_api_reference_signatures_match_the_adapters(module):
    adapter = pytest.importorskip(f"cuattn.{module}", exc_type=ImportError)
    for mod, name, sig in _adapter_signatures():
        if mod == module:
            real = inspect.signature(getattr(adapter, name))
            assert _parameters(sig) == _parameters(real), f"cuattn.{module}.{name}"
            assert name in adapter.__all__


def test_adapter_modules_import_cleanly_when_their_framework_is_here():
    for module, framework in (("cuattn.jax", "jax"), ("cuattn.torch", "torch")):
        try:
            importlib.import_module(framework)
        except ImportError:
            continue
        importlib.import_module(module)


@pytest.mark.parametrize("test_file,alias,module", [
    ("test_adapters_jax.py", "cjax", "jax.py"),
    ("test_adapters_torch.py", "ct", "torch.py"),
])
def test_adapter_tests_use_only_names_the_adapter_defines(test_file, alias, module):
    """Every ``cjax.NAME`` / ``ct.NAME`` (and monkeypatch.setattr(alias, "NAME")) of an
    adapter's test file is a module-level name of cuattn/jax.py / cuattn/torch.py, read from
    the source (no framework needed): those files' GPU tests skip on a machine without
    one, so a renamed private (issue 52's _DESCALES) failed only on the device."""
    import ast
    tree = ast.parse((REPO / "cuattn" / module).read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                defined.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    used = set()
    for node in ast.walk(ast.parse((REPO / "tests" / test_file).read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == alias:
            used.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and \
                node.args[0].id == alias and isinstance(node.args[1], ast.Constant):
            used.add(node.args[1].value)
    assert used, f"{test_file}: no use of {alias} found (the test reads the wrong name)"
    assert sorted(used - defined) == [], f"{test_file} uses names cuattn/{module} lacks"
