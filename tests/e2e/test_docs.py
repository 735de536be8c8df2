"""Docs that are executed (as pydantic-core's ``tests/test_docstrings.py``): the ``python`` blocks of README.md and
of every page under docs/ (the guide included) run, in order, as one script per file (in a scratch directory, with the
repository's examples at hand), and the ``python`` blocks of the public modules' docstrings compile, with every
``train(...)`` in them checked against ``IApp.train``'s signature. A block that cannot run here says so next to it:
``<!-- ddlf-docs: skip (reason) -->`` on the line before its fence; nothing is skipped silently. A block that must run
in a fresh process says so the same way, ``<!-- ddlf-docs: own script (reason) -->``: it runs alone, in a script of
its own (PyTorch's compiler must load before TensorFlow in a process, so a PyTorch example after a Keras one runs
apart)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddlf

from ..conftest import REPO as _REPO

REPO = Path(_REPO)
SKIP = re.compile(r"<!--\s*ddlf-docs:\s*skip\s*\((?P<why>[^)]*)\)\s*-->")
OWN = re.compile(r"<!--\s*ddlf-docs:\s*own script\s*\((?P<why>[^)]*)\)\s*-->")
FENCE = re.compile(r"^```python\s*$")

PUBLIC_MODULES = [
    "ddlf.training.app",
    "ddlf.training.options",
    "ddlf.tune.sweep",
    "ddlf.cluster.cluster",
    "ddlf.collective",
    "ddlf.datasets",
    "ddlf.models",
    "ddlf.callbacks",
]


def blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason)`` of each python block of a markdown text."""
    return [(line, code, skip) for line, code, skip, _own in marked_blocks(text)]


def marked_blocks(text: str) -> list[tuple[int, str, str | None, str | None]]:
    """``(line, code, skip reason, own-script reason)`` of each python block of a markdown text."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i + 1
            j = start
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            before = lines[i - 1] if i else ""
            skip, own = SKIP.search(before), OWN.search(before)
            code = "\n".join(lines[start:j]) + "\n"
            out.append((start, code, skip.group("why") if skip else None, own.group("why") if own else None))
            i = j
        i += 1
    return out


def _train_calls(code: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "train"
    ]


TRAIN_PARAMS = set(inspect.signature(ddlf.IApp.train).parameters) - {"self"}


def _check_train_keywords(code: str, where: str) -> None:
    for call in _train_calls(code):
        unknown = {k.arg for k in call.keywords if k.arg is not None} - TRAIN_PARAMS
        assert not unknown, f"{where}: train() has no argument {sorted(unknown)} (it takes {sorted(TRAIN_PARAMS)})"


MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
WITH_CODE = [p for p in MARKDOWN if blocks(p.read_text())]


def test_every_markdown_block_is_run_or_says_why_not() -> None:
    found = [(p, b) for p in MARKDOWN for b in marked_blocks(p.read_text())]
    assert len(found) >= 20  # README's Keras and PyTorch apps, fit to train; the guide's pages
    assert {p.name for p in WITH_CODE} >= {"README.md", "training.md", "data.md", "pytorch.md", "machines.md"}
    for path, (line, code, why, own) in found:
        compile(code, f"{path.name}:{line}", "exec")  # every block is valid Python, skipped or not
        _check_train_keywords(code, f"{path.name}:{line}")
        assert why is None or why.strip(), f"{path.name}:{line}: a skip marker needs a reason"
        assert own is None or own.strip(), f"{path.name}:{line}: an own-script marker needs a reason"


def _scripts(path: Path) -> list[str]:
    """The scripts a markdown file's runnable blocks make: one of every block not marked ``own script``, in order,
    and one for each block that is."""
    name = path.relative_to(REPO)
    main: list[str] = []
    own: list[str] = []
    for line, code, why, alone in marked_blocks(path.read_text()):
        if why is not None:
            continue
        if "import torch" in code and importlib.util.find_spec("torch") is None:
            continue  # shown for PyTorch users; run where torch is installed (CI installs it)
        block = f"# --- {name}:{line}\n{code}"
        (own if alone else main).append(block)
    return ["\n".join(main)] * bool(main) + own


@pytest.mark.slow
@pytest.mark.parametrize("path", WITH_CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_blocks_run(path: Path, tmp_path: Path) -> None:
    scripts = _scripts(path)
    if not scripts:
        pytest.skip(f"{path.name}: no python block to run here")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for script in scripts:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{script.splitlines()[0]} ...\n{done.stderr[-4000:]}"


def _docstring_blocks(module: str) -> list[tuple[str, str]]:
    mod = importlib.import_module(module)
    docs = [(module, inspect.getdoc(mod) or "")]
    for name, obj in vars(mod).items():
        if getattr(obj, "__module__", None) == module and (inspect.isclass(obj) or inspect.isfunction(obj)):
            docs.append((f"{module}.{name}", inspect.getdoc(obj) or ""))
            if inspect.isclass(obj):
                docs += [(f"{module}.{name}.{m}", inspect.getdoc(f) or "") for m, f in vars(obj).items() if callable(f)]
    out = []
    for where, doc in docs:
        for line, code, _why in blocks(doc):
            out.append((f"{where}:{line}", code))
    return out


def test_docstring_examples_compile_and_call_train_as_it_is() -> None:
    found = [b for m in PUBLIC_MODULES for b in _docstring_blocks(m)]
    assert found  # the app's and the options' examples at least
    for where, code in found:
        compile(code, where, "exec")
        _check_train_keywords(code, where)
