"""No import cycle among the modules of server/odbd and client/odbclient (issue 28).

The graph is built from the source with `ast`, so it sees every import a module can run:
top-level ones, those under `if TYPE_CHECKING:` (a type-only cycle still ties the two modules
together) and those inside functions (a deferred import is no way out of a cycle). An edge goes
to the module named: `from pkg import sub` to pkg.sub when that is a module, else to pkg.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"odbd": REPO / "server" / "odbd", "odbclient": REPO / "client" / "odbclient"}

Graph = Mapping[str, frozenset[str]]


def modules_of(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Every module's dotted name -> its file (a package is its __init__.py)."""
    modules = {}
    for root in packages.values():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: Mapping[str, Path]) -> dict[str, frozenset[str]]:
    """module -> the modules of `modules` it imports anywhere in its source."""
    return {name: frozenset(_imports(name, path, modules)) for name, path in modules.items()}


def _imports(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return {m for m in found if m in modules and m != name}


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_of_odbd_or_odbclient_is_in_an_import_cycle() -> None:
    modules = modules_of(PACKAGES)
    assert len(modules) > 100 and "odbd.cli" in modules and "odbclient.trainer.client" in modules
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules importing each other): " + "; ".join(
        " <-> ".join(c) for c in found
    )


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        # the two cycles issue 28 named, in their old shapes: type-only and deferred imports
        (
            {
                "types": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from pkg.windows import Windows\n",
                "windows": "from pkg.types import IntArray\n",
            },
            [["pkg.types", "pkg.windows"]],
        ),
        (
            {
                "command": "def run():\n    from pkg.runner import execute\n",
                "runner": "from pkg import command\n",
            },
            [["pkg.command", "pkg.runner"]],
        ),
        ({"a": "from . import b\n", "b": "import pkg.c\n", "c": "from .a import x\n"}, None),
        ({"a": "from pkg import b\n", "b": "import json\n"}, []),
    ],
    ids=["type-checking", "function-level", "relative-three", "none"],
)
def test_the_graph_finds_a_cycle_however_it_is_imported(
    tmp_path: Path, sources: dict[str, str], expected: list[list[str]] | None
) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name, text in sources.items():
        (root / f"{name}.py").write_text(text)
    found = cycles(import_graph(modules_of({"pkg": root})))
    assert found == (expected if expected is not None else [["pkg.a", "pkg.b", "pkg.c"]])
