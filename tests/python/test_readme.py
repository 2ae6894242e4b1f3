"""The README's Python examples against the package: every `lk.<name>(...)` call and every
`from llm_kernels... import ...` in its python blocks must name something that exists and take the
arguments the example passes (count and keyword names, by inspect.signature), so that the front
door does not drift from the API. The blocks are fragments (their tensors are not defined), so
they are parsed, not run."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import llm_kernels as lk

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block."""
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def lk_target(node: ast.expr):
    """The object an attribute chain rooted at `lk` names (lk.a.b -> llm_kernels.a.b), or None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "lk") or not names:
        return None
    obj = lk
    for name in reversed(names):
        assert hasattr(obj, name), f"README names lk.{'.'.join(reversed(names))}, which does not exist"
        obj = getattr(obj, name)
    return obj


def calls_and_imports():
    """(where, kind, payload) for every lk call and llm_kernels import of the README's blocks."""
    found = []
    for line, src in python_blocks():
        tree = ast.parse(src)
        for node in ast.walk(tree):
            where = f"README.md:{line + getattr(node, 'lineno', 1) - 1}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                found.append((where, "call", node))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llm_kernels"):
                found.append((where, "import", node))
    return found


def test_the_readme_has_python_examples():
    assert len(calls_and_imports()) > 40


@pytest.mark.parametrize("where,kind,node", calls_and_imports(), ids=lambda v: v if isinstance(v, str) else "")
def test_readme_example_matches_the_api(where, kind, node):
    if kind == "import":
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        return
    target = lk_target(node.func)
    if target is None:  # not an lk call (torch, the model, rich)
        return
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature: existence is all we can check
        return
    args = [None] * len(node.args)
    kwargs = {kw.arg: None for kw in node.keywords if kw.arg is not None}
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        pytest.fail(f"{where}: {ast.unparse(node)[:120]} does not fit {getattr(target, '__qualname__', target)}{sig}: {e}")


def test_star_import_exports_every_public_function_and_class():
    """`from llm_kernels import *` gives every function and class the package's __init__ brings in
    from its modules (the API the README shows as lk.<name>), and __all__ names nothing missing."""
    assert all(hasattr(lk, name) for name in lk.__all__)
    public = {name for name, obj in vars(lk).items()
              if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
              and getattr(obj, "__module__", "").startswith("llm_kernels")}
    assert public - set(lk.__all__) == set()


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_readme_cpp_example_compiles(tmp_path):
    """The README's C++ example, its statements wrapped in a function whose parameters are the
    names it leaves undefined, compiles against include/ (syntax and types; nothing runs)."""
    blocks = re.findall(r"```cpp\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    lines = blocks[0].splitlines()
    includes = [line for line in lines if line.startswith("#include")]
    body = [line for line in lines if not line.startswith("#include")]
    src = tmp_path / "readme_example.cpp"
    src.write_text("\n".join(includes) + "\n#include <cstdint>\n"
                   "void readme_example(void* x_ptr, void* y_ptr, void* w_ptr, int64_t rows, llmk::Stream stream) {\n"
                   + "\n".join(body) + "\n}\n")
    include = README.parent / "include"
    done = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", f"-I{include}", str(src)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def cli_mentions():
    """(line, subcommand, the rest of the line up to a backtick or table bar) of each
    `llm-kernels <subcommand> ...` the README shows."""
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2))
            for m in re.finditer(r"llm-kernels ([a-z][a-z0-9-]*)([^`\n|]*)", text)]


def test_readme_cli_commands_and_options_exist():
    """Every `llm-kernels` subcommand the README names exists, with every --option shown for it,
    and every e2e --variant it names is one the e2e command takes."""
    typer = pytest.importorskip("typer")
    from llm_kernels import cli

    commands = typer.main.get_command(cli.app).commands
    mentions = cli_mentions()
    assert len(mentions) > 15
    wrong = []
    for line, sub, rest in mentions:
        if sub not in commands:
            wrong.append(f"README.md:{line}: no command {sub!r}")
            continue
        options = {o for p in commands[sub].params for o in p.opts + p.secondary_opts}
        wrong += [f"README.md:{line}: {sub} has no {flag}" for flag in re.findall(r"--[a-z][a-z0-9-]*", rest)
                  if flag not in options]
        if sub == "e2e":
            e2e = importlib.import_module("llm_kernels.e2e")
            wrong += [f"README.md:{line}: e2e has no variant {v!r}" for v in re.findall(r"--variant ([a-z_]+)", rest)
                      if v not in e2e.VARIANTS]
    assert not wrong, "\n".join(wrong)


ROOT = README.parent
# The pages that describe the code as it is (docs/gpu-test-runs.md is a log and may name patches
# since landed, switches since renamed).
DOCS = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "gpu-test-runs.md")]


def test_docs_name_files_that_exist():
    """Paths into the repository that the README and the docs pages name (scripts, patches,
    results, sources) exist."""
    assert len(DOCS) >= 6
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"(?<![\w/.-])((?:scripts|bench|docs|tests|src|include|python|cmake)/[\w./-]*\w)", text):
            if "*" not in m.group(1) and not (ROOT / m.group(1)).exists():
                missing.append(f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(1)}")
    assert not missing, "\n".join(missing)


def heading_anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to -)."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.*)$", doc.read_text(), re.M)}


def test_docs_links_resolve():
    """Every relative Markdown link of the README and the docs pages points at a file that exists,
    and an #anchor at one of that file's headings (the README's sections moved into docs/ on
    2026-12-04, and the pages link back to the README's sections)."""
    broken = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            if not file.exists():
                broken.append(f"{where}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
                broken.append(f"{where}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def code_text(*patterns: str) -> str:
    return "".join(f.read_text(errors="replace") for pattern in patterns for f in ROOT.glob(pattern) if f.is_file())


LIBRARY_SOURCES = ("src/**/*.cu", "src/**/*.cpp", "src/**/*.h", "include/**/*.h", "python/llm_kernels/*.py")


def test_documented_environment_switches_are_read_somewhere():
    """Every LLMK_* variable the README and the docs pages (other than the plans in next-steps.md)
    document is read by the library, its build or a script (never only by a prepared patch), so a
    renamed switch cannot linger in the docs."""
    code = code_text(*LIBRARY_SOURCES, "scripts/*.py", "scripts/*.sh", "CMakeLists.txt", "cmake/*",
                     "tests/python/conftest.py")
    described = [doc for doc in DOCS if doc.name != "next-steps.md"]  # plans name prepared patches' switches
    names = {n for doc in described for n in re.findall(r"LLMK_[A-Z0-9_]*[A-Z0-9]", doc.read_text())}
    assert len(names) > 10
    assert sorted(n for n in names if n not in code) == []


def test_every_runtime_switch_is_in_the_readme_table():
    """Every environment variable the library reads at run time (gpu::env_flag / std::getenv / a
    local env_int in C++, os.environ in Python) is named in the README's "Environment switches"
    section, the one place a user looks them up."""
    read = set(re.findall(r"(?:env_flag|env_int|getenv|environ\.get)\(\s*\"(LLMK_[A-Z0-9_]+)\"",
                          code_text(*LIBRARY_SOURCES)))
    assert {"LLMK_PDL", "LLMK_DECODE_KERNEL", "LLMK_FUSE_ROPE_KV"} <= read  # the pattern finds both languages
    text = README.read_text()
    section = text[text.index("## Environment switches"):]
    section = section[:section.index("\n## ", 1)]
    assert sorted(read - set(re.findall(r"LLMK_[A-Z0-9_]+", section))) == []
