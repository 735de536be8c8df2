"""The package's layout holds what docs/ARCHITECTURE.md says: no import circle (function-local imports included,
``TYPE_CHECKING`` blocks excepted: they never run), and the master's code and the daemon's code apart."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "python"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(module: str) -> set[str]:
    """The ddlf modules ``module`` imports when it runs (its own parent packages left out: Python imports those
    first whatever a module says)."""
    path, package = MODULES[module]
    base = module.split(".") if package else module.split(".")[:-1]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[: len(base) - (node.level - 1)]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
                elif target in MODULES and not f"{module}.".startswith(f"{target}."):
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package() -> None:
    # The checks below mean something only if the graph is the package's: its main modules and their edges.
    assert {"ddlf.cluster.cluster", "ddlf.worker.executor", "ddlf.training.replica.registry"} <= set(GRAPH)
    assert "ddlf.data.store" in GRAPH["ddlf.cluster.cluster"]
    assert (
        "ddlf.training.replica.steppers.keras_tensorflow" in GRAPH["ddlf.training.replica.steppers"]
    )  # a function-local import counts


def test_no_import_circle() -> None:
    assert _cycles() == []


# Which parts may not import which: (importer prefix, imported prefix, why).
NEVER = [
    ("ddlf.worker", "ddlf.cluster", "the daemon never runs the master's code"),
    ("ddlf.worker", "ddlf.training", "the daemon knows nothing of training: training registers its services with it"),
    ("ddlf.training.replica", "ddlf.cluster", "a replica runs in the daemon"),
    ("ddlf.data", "ddlf.cluster", "loaders and stores run on workers"),
    ("ddlf.data", "ddlf.training", "datasets know nothing of training"),
    ("ddlf.cluster", "ddlf.training", "the connection knows nothing of training"),
    ("ddlf.frameworks", "ddlf.training", "framework adapters sit below training"),
    ("ddlf.frameworks", "ddlf.cluster", "framework adapters sit below the connection"),
    *[
        ("ddlf.training.replica", f"ddlf.training.{m}", "the worker's side imports only the contract (messages)")
        for m in ("app", "synchronous", "asynchronous", "exchange", "run", "membership", "replies", "plan")
    ],
]


@pytest.mark.parametrize(("importer", "imported", "why"), NEVER)
def test_the_two_programs_stay_apart(importer: str, imported: str, why: str) -> None:
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in GRAPH.items()
        if m == importer or m.startswith(f"{importer}.")
        for t in targets
        if t == imported or t.startswith(f"{imported}.")
    )
    assert bad == [], why


# -- one concept per file, and framework choices in one place -----------------------------------------------------

LONGEST = 600
"""Lines a source file of the package may have (tests and benchmarks aside): a longer one holds several concepts."""


def test_no_source_file_of_the_package_is_over_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path, _ in MODULES.values()
        if (n := len(path.read_text().splitlines())) > LONGEST
    }
    assert long == {}, f"split by what each part does (at most {LONGEST} lines)"


def test_no_rust_source_file_is_over_the_limit() -> None:
    sources = sorted((ROOT.parent / "rust").glob("*/src/**/*.rs"))
    assert len(sources) > 40  # the crates' sources are where this looks
    long = {str(p.relative_to(ROOT.parent)): n for p in sources if (n := len(p.read_text().splitlines())) > LONGEST}
    assert long == {}, f"split by what each part does (at most {LONGEST} lines)"


FRAMEWORK_CHECKS = 8
"""``hasattr`` and ``isinstance(..., TorchModel)`` checks the package may make outside ``ddlf/frameworks/``:
training asks a model's adapter (``ddlf.frameworks.adapter``), never its type or what it happens to have."""


def _framework_checks(tree: ast.AST) -> int:
    return sum(
        node.func.id == "hasattr" or (node.func.id == "isinstance" and "TorchModel" in ast.unparse(node.args[1]))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    )


def test_framework_behaviour_is_chosen_by_the_adapter_not_by_duck_typing() -> None:
    outside = {
        str(path.relative_to(ROOT)): n
        for module, (path, _) in MODULES.items()
        if not module.startswith("ddlf.frameworks") and (n := _framework_checks(ast.parse(path.read_text())))
    }
    assert sum(outside.values()) <= FRAMEWORK_CHECKS, outside


def test_the_layout_table_names_every_module() -> None:
    architecture = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
    start = architecture.index("| path | what lives there |")
    end = architecture.find("\n\n", start)
    table = architecture[start : end if end != -1 else len(architecture)]
    unnamed = sorted(
        str(path.relative_to(ROOT))
        for path, package in MODULES.values()
        if not package and path.name != "__main__.py" and f"{path.name}`" not in table
    )
    assert unnamed == [], "docs/ARCHITECTURE.md's layout table is where a contributor looks for a module"


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports), ``if`` and ``try`` blocks
    included."""
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            todo.extend(node.body)
            todo.extend(getattr(node, "orelse", []))
            todo.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return names


def test_every_name_in_a_modules_all_is_defined_there() -> None:
    """``__all__`` names only what the module defines or imports: ``from module import *`` would fail on a name
    it lacks (``replica`` once listed a ``configure`` that had moved away)."""
    missing = []
    for module, (path, _) in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if isinstance(node, ast.Assign) and names == ["__all__"]:
                listed = ast.literal_eval(node.value)
                defined = _top_level_names(tree)
                missing += [f"{module}: {name}" for name in listed if name not in defined]
    assert not missing, missing
