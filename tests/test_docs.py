"""The documentation against the code: README.md's Python blocks, docs/api.md, and the
facts of README.md and docs/ARCHITECTURE.md that the code can change.

A ```python block whose first line is ``# signature`` shows a function's signature: it is
not run, but each ``cuattn.<name>(...)`` in it must have exactly the parameters (names,
kinds, defaults) of the real function. Every other ```python block of the README must run
as written: it compiles everywhere, and runs on a GPU. A number in the docs that the code
decides (a struct's size, a count of variants) is either checked here or not written.
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
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
SIGNATURE = "# signature"
PUBLIC = sorted(name for name in cuattn.__all__ if inspect.isfunction(getattr(cuattn, name)))

_BLOCK_RE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def code_blocks(path: Path, language: str = "python") -> list[tuple[str, str]]:
    """[("<file>:<line>", source)] of every ```<language> block of a Markdown file ("": the
    blocks that name none)."""
    text = path.read_text()
    return [(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}", m.group(2))
            for m in _BLOCK_RE.finditer(text) if m.group(1) == language]


def runnable(path: Path) -> list[tuple[str, str]]:
    return [(where, src) for where, src in code_blocks(path)
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
    blocks = [(w, s) for w, s in code_blocks(path) if s.startswith(SIGNATURE + "\n")]
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


# -- facts the code can change ----------------------------------------------------------------

def test_architecture_shows_a_real_generated_source():
    """The example translation unit of docs/ARCHITECTURE.md is key.source() of the shipped
    variant it names: every line shown (less a trailing ``// comment``; ``...`` elides)
    stands in the real source, in order."""
    from cuattn import shipped as shipped_set
    (where, block), = [(w, b) for w, b in code_blocks(ARCHITECTURE, "") if 'extern "C"' in b]
    name = re.search(r"^(cuattn_\w+)\(", block, re.MULTILINE).group(1)
    shipped = {v.name: v for arch in ("sm_80", "sm_90") for v in shipped_set.shipped(arch=arch)}
    assert name in shipped, f"{where}: {name} is not a shipped variant"
    real = iter(shipped[name].source().splitlines())
    for line in block.splitlines():
        code = re.sub(r"\s+//.*$", "", line)
        if code.strip() != "...":
            assert any(code == r for r in real), f"{where}: not in {name}'s source: {code}"


def test_architecture_names_every_variant_and_params_struct():
    from cuattn import param_structs
    from tests.test_jit import _all_variant_classes
    text = ARCHITECTURE.read_text()
    mirrors = {name: p for name, p in vars(param_structs).items() if name.endswith("_PARAMS")}
    names = [c.__name__ for c in _all_variant_classes()] + list(mirrors) + \
        [p.cpp_name for p in mirrors.values()]
    assert [n for n in names if f"`{n}`" not in text] == []


def test_allocation_rule_is_one_statement():
    """README.md and docs/api.md say the same about what a call allocates."""
    def statement(path):
        found = re.search(r"allocates nothing but its outputs.*?CUDA graph\.",
                          " ".join(path.read_text().split()))
        assert found, f"{path.name}: no statement of what a call allocates"
        return found.group(0)
    assert statement(README) == statement(API)


def test_readme_shipped_set_count_is_the_codes():
    """The measured precompile of the shipped set names its size: when the set changes, the
    measurement is stale."""
    from cuattn import shipped as shipped_set
    found = re.search(r"precompile --arch sm_90` into an empty cache builds its (\d+) variants",
                      " ".join(README.read_text().split()))
    assert found, "README.md: the shipped set's measurement sentence moved"
    documented, shipped = int(found.group(1)), len(shipped_set.shipped(arch="sm_90"))
    assert documented == shipped, (
        f"README.md measured {documented} shipped variants, the code ships {shipped}: "
        "re-measure into an empty cache (CUATTN_CACHE_DIR=$(mktemp -d) time python -m cuattn "
        "precompile --arch sm_90; du -sh the directory) and update the sentence")
    from cuattn.__main__ import BUNDLE_ARCHS
    found = re.search(r"`time python -m cuattn bundle` writes its (\d+) cubins",
                      " ".join(README.read_text().split()))
    assert found, "README.md: the bundle's measurement sentence moved"
    bundled = sum(len(shipped_set.shipped(arch=a)) for a in BUNDLE_ARCHS)
    assert int(found.group(1)) == bundled, (
        f"README.md measured a bundle of {found.group(1)} cubins, the code bundles {bundled}: "
        "re-measure it in a copy of the checkout (time python -m cuattn bundle; python -m "
        "build) and update the paragraph")


def test_cuda13_install_line_lists_every_dependency():
    """README's CUDA 13 route installs with --no-deps, so its pip line must name every
    dependency of pyproject.toml and of the [test] extra (CUDA 12 wheels by their CUDA 13
    names): a missing `build` once failed the wheel test with "No module named build"."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cuda13 = {"cupy-cuda12x": "cupy-cuda13x", "nvidia-cuda-nvrtc-cu12": "nvidia-cuda-nvrtc",
              "nvidia-cuda-runtime-cu12": "nvidia-cuda-runtime"}
    needed = [re.match(r"[\w.-]+", d).group(0)
              for d in project["dependencies"] + project["optional-dependencies"]["test"]]
    text = README.read_text()
    line = re.search(r"pip install cupy-cuda13x(.*?)\npip install --no-deps", text, re.DOTALL)
    assert line, "README.md: the CUDA 13 install lines moved"
    listed = {re.match(r'"?([\w.-]+)', w).group(1) for w in line.group(1).split() if w != "\\"}
    listed.add("cupy-cuda13x")
    assert [cuda13.get(n, n) for n in needed if cuda13.get(n, n) not in listed] == []
