"""The layering rules of docs/design.md, enforced on the code's own imports.

Every ``import``/``from ... import`` in ``src/deepcee`` (module level and inside functions,
``TYPE_CHECKING`` blocks included) is read with :mod:`ast`; the rules below say which
packages must never import which. The torch-free core is checked by running it
(``test_core_no_torch.py``); this file checks the arrows between deepcee's own parts and
that no set of modules imports each other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _not_run_on_import(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (read by type checkers only) and ``if __name__ == "__main__":`` (the
    module run as a script: another program)."""
    if not isinstance(node, ast.If):
        return False
    t = node.test
    if isinstance(t, ast.Name):
        return t.id == "TYPE_CHECKING"
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def _walk(tree: ast.AST, typing_only: bool):
    """Every node, leaving out blocks that do not run on import unless ``typing_only``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not typing_only and _not_run_on_import(child):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(path: Path, module: str, typing_only: bool = True) -> set[str]:
    """deepcee modules imported anywhere in ``path`` (relative imports resolved); with
    ``typing_only=False``, imports that run on import (see :func:`_not_run_on_import`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in _walk(tree, typing_only):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("deepcee"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("deepcee"):
                continue
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def _graph(typing_only: bool) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, name, typing_only) if m in modules and m != name}
    return graph


GRAPH = _graph(typing_only=True)
"""Every import, type-only ones included: the layering rules hold for both."""
RUNTIME_GRAPH = _graph(typing_only=False)
"""Imports that run: no circles among them."""


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


NEVER = [
    # (importer, imported, why)
    ("deepcee.simulator", "deepcee.planner", "the simulator reads plans; it never plans"),
    ("deepcee.runtime", "deepcee.planner", "the runtime runs plans; it never plans"),
    ("deepcee.runtime", "deepcee.simulator", "link and collective models live in deepcee.comm"),
    ("deepcee.schedule", "deepcee.simulator", "schedules are below the simulator"),
    ("deepcee.schedule", "deepcee.planner", "schedules are below the planner"),
    ("deepcee.plan", "deepcee.planner", "the plan is data; the planner writes it"),
    ("deepcee.cluster", "deepcee.planner", "the data model is below everything"),
    ("deepcee.cluster", "deepcee.simulator", "the data model is below everything"),
    ("deepcee.comm", "deepcee.simulator", "the link models are below the simulator"),
]


@pytest.mark.parametrize(("importer", "imported", "why"), NEVER, ids=[f"{a}-x-{b}" for a, b, _ in NEVER])
def test_never(importer: str, imported: str, why: str) -> None:
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _in(m, importer)
                 for t in targets if _in(t, imported))
    assert not bad, f"{why}: {bad}"


def test_nothing_imports_the_cli() -> None:
    bad = sorted(m for m, targets in GRAPH.items() if not _in(m, "deepcee.cli")
                 and any(_in(t, "deepcee.cli") for t in targets))
    assert not bad, f"the CLI is the top: nothing imports it, but {bad} do"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` that only re-exports its children would tie every child to
    its parent; edges into a package face are followed to nothing, edges out of it kept."""
    packages = {m for m in graph if any(o.startswith(m + ".") for o in graph)}
    return {m: {t for t in ts if t not in packages} for m, ts in graph.items()}


CALL_TIME_EDGES = {
    ("deepcee._callable", "deepcee.api"):
        "[Note: callable modules]: deepcee.plan/profile/train forward a call to the API at call time",
}
"""Upward imports made inside a function, on purpose, each with its reason; they run when the
function is called, never on import, and are the only ones left out of the circle check."""


def test_no_import_circles() -> None:
    graph = {m: {t for t in ts if (m, t) not in CALL_TIME_EDGES} for m, ts in RUNTIME_GRAPH.items()}
    cycles = _cycles(_without_packages(graph))
    assert not cycles, f"modules that import each other in a circle: {cycles}"


def test_the_scan_sees_the_code() -> None:
    assert len(GRAPH) >= 50 and "deepcee.planner.search" in GRAPH and GRAPH["deepcee.cli"]
    for importer, imported in CALL_TIME_EDGES:  # an exemption that no longer exists is removed
        assert imported in RUNTIME_GRAPH[importer], (importer, imported)
