"""The documentation against the code: README.md's Python blocks and docs/api.md.

A ```python block whose first line is ``# signature`` shows a function's signature: it is
not run, but each ``cuattn.<name>(...)`` in it must have exactly the parameters (names,
kinds, defaults) of the real function. Every other ```python block of the README must run
as written: it compiles everywhere, and runs on a GPU.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import cuattn

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
API = REPO / "docs" / "api.md"
SIGNATURE = "# signature"
PUBLIC = sorted(name for name in cuattn.__all__ if inspect.isfunction(getattr(cuattn, name)))

_BLOCK_RE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """[("<file>:<line>", source)] of every ```python block of a Markdown file."""
    text = path.read_text()
    return [(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}", m.group(2))
            for m in _BLOCK_RE.finditer(text) if m.group(1) == "python"]


def runnable(path: Path) -> list[tuple[str, str]]:
    return [(where, src) for where, src in python_blocks(path)
            if not src.startswith(SIGNATURE + "\n")]


def documented_signatures(source: str) -> list[tuple[str, inspect.Signature]]:
    """(name, signature) of every ``cuattn.<name>(...)`` in a signature block."""
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    found = []
    for m in re.finditer(r"cuattn\.(\w+)\(", code):
        depth, end = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        namespace: dict = {}
        exec(f"def {m.group(1)}({code[m.end():end - 1]}): pass", namespace)   # our own text
        found.append((m.group(1), inspect.signature(namespace[m.group(1)])))
    return found


def _parameters(sig: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def test_readme_python_blocks_compile():
    blocks = runnable(README)
    assert len(blocks) >= 4, blocks     # the intro, PyTorch, JAX, streams
    for where, src in blocks:
        compile(src, where, "exec")      # a SyntaxError names the block's line


@pytest.mark.parametrize("path", [README, API], ids=lambda p: p.name)
def test_signature_blocks_match_the_code(path):
    blocks = [(w, s) for w, s in python_blocks(path) if s.startswith(SIGNATURE + "\n")]
    seen = set()
    for where, src in blocks:
        for name, sig in documented_signatures(src):
            assert name in PUBLIC, f"{where}: cuattn.{name} is not public"
            real = inspect.signature(getattr(cuattn, name))
            assert _parameters(sig) == _parameters(real), f"{where}: {name}{sig} != {real}"
            seen.add(name)
    assert seen == set(PUBLIC), f"{path.name}: no signature of {set(PUBLIC) - seen}"


def _api_sections() -> dict[str, str]:
    """{heading: body} of every ``## `` section of docs/api.md but the adapters'
    (``## cuattn.jax``, ``## cuattn.torch``: tests/test_adapters.py checks those)."""
    parts = re.split(r"^## (.+)$", API.read_text(), flags=re.MULTILINE)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2])
            if not heading.startswith("cuattn.")}


def test_api_reference_describes_every_public_function_and_argument():
    sections = _api_sections()
    assert sorted(sections) == PUBLIC
    for name in PUBLIC:
        prose = _BLOCK_RE.sub("", sections[name])          # outside the signature block
        for param in inspect.signature(getattr(cuattn, name)).parameters:
            assert f"`{param}`" in prose, f"docs/api.md, {name}: `{param}` is not described"


@pytest.mark.gpu
@pytest.mark.parametrize("where,src", runnable(README), ids=[w for w, _ in runnable(README)])
def test_readme_python_blocks_run(where, src):
    for module in ("torch", "jax"):
        if re.search(rf"^import .*\b{module}\b", src, re.MULTILINE):
            lib = pytest.importorskip(module)
            if module == "torch" and not lib.cuda.is_available():
                pytest.skip("torch has no CUDA device")
            if module == "jax" and not any(d.platform == "gpu" for d in lib.devices()):
                pytest.skip("jax has no GPU backend")
    exec(compile(src, where, "exec"), {"__name__": "__readme__"})
