"""The packages import one way (docs/DESIGN.md "Layers", docs/STYLE.md rule 19).

Imports inside functions count (moving an import into a function does not remove a cycle);
imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _runtime_imports(path: Path, root: Path = ROOT) -> list[str]:
    """The absolute names `path` (under `root`) imports at run time, relative ones resolved."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    package = path.relative_to(root).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            # `from pkg import name` may import the submodule pkg.name
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def _unit_graph(package: str, depth: int, root: Path = ROOT) -> dict[str, set[str]]:
    """Edges between the units of `package`: its modules and subpackages `depth` levels down."""
    graph: dict[str, set[str]] = defaultdict(set)
    paths = sorted((root / package).rglob("*.py"))
    units = {".".join(p.relative_to(root).with_suffix("").parts[:depth + 1]) for p in paths}
    for path in paths:
        parts = path.relative_to(root).with_suffix("").parts
        if len(parts) <= depth:  # the package's own __init__ imports its API from every unit
            continue
        unit = ".".join(parts[:depth + 1])
        for name in _runtime_imports(path, root):
            target = ".".join(name.split(".")[:depth + 1])
            if target in units and target != unit:
                graph[unit].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package,depth", [("jaxengine", 1), ("scheduler", 1)])
def test_no_import_cycle_between_units(package: str, depth: int) -> None:
    assert _cycles(_unit_graph(package, depth)) == []


def test_the_check_counts_imports_in_functions_not_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import x\n")
    (pkg / "a.py").write_text("from pkg.b import y\nx = 1\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.a import x\n")
    (pkg / "b.py").write_text("y = 2\n")
    assert _cycles(_unit_graph("pkg", 1, tmp_path)) == []
    (pkg / "b.py").write_text("y = 2\ndef f():\n    from . import a\n")
    assert _cycles(_unit_graph("pkg", 1, tmp_path)) == [["pkg.a", "pkg.b"]]
    assert "pkg.c" not in _unit_graph("pkg", 1, tmp_path)


@pytest.mark.parametrize("package", ["scheduler", "jaxengine_kernels"])
def test_lower_packages_never_import_jaxengine(package: str) -> None:
    offenders = [f"{path.relative_to(ROOT)}: {name}"
                 for path in (ROOT / package).rglob("*.py")
                 for name in _runtime_imports(path)
                 if name == "jaxengine" or name.startswith("jaxengine.")]
    assert offenders == []


def test_scheduler_imports_no_jax() -> None:
    offenders = [f"{path.relative_to(ROOT)}: {name}"
                 for path in (ROOT / "scheduler").rglob("*.py")
                 for name in _runtime_imports(path)
                 if name.split(".")[0] in ("jax", "jaxlib", "numpy", "flax")]
    assert offenders == []
