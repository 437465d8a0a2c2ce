"""odbclient's tree shows its two sides (issue 28): trainer/ reads shared memory, producer/
writes it, and the top level holds only what both sides and the daemon share.

Read from the source (ast), not by importing, so a violation is named by file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client" / "odbclient"
SERVER = ROOT / "server" / "odbd"
MAX_LINES = 600

# The top level: what both sides and the daemon import (and the public API in __init__).
SHARED = {"__init__", "alloc", "connect", "errors", "framing", "local_trust", "samples", "shm"}


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "wire" not in p.relative_to(root).parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `import odbclient...` / `from odbclient... import` in path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def _offending(paths: list[Path], forbidden: str) -> list[str]:
    """file:line of each import of forbidden or below it (`from odbclient import trainer` too)."""
    return sorted(
        {
            f"{p.relative_to(ROOT)}:{line} imports {forbidden}"
            for p in paths
            for line, module in _imports(p)
            if module == forbidden or module.startswith(forbidden + ".")
        }
    )


def test_the_top_level_holds_only_the_shared_layout() -> None:
    top = {p.stem for p in CLIENT.glob("*.py")}
    assert top == SHARED, (
        f"client/odbclient/ has {sorted(top - SHARED)} beside the shared modules: a module one "
        "side uses goes in trainer/ or producer/; one the daemon and both sides import goes in "
        "SHARED here (and in odbclient/__init__'s docstring)"
    )
    packages = {p.name for p in CLIENT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"adapters", "producer", "trainer", "wire"}


@pytest.mark.parametrize(
    ("side", "other"), [("trainer", "odbclient.producer"), ("producer", "odbclient.trainer")]
)
def test_neither_side_imports_the_other(side: str, other: str) -> None:
    bad = _offending(_modules(CLIENT / side), other)
    assert not bad, f"the {side} side must not need the other side's code: {bad}"


def test_the_shared_modules_import_neither_side() -> None:
    shared = [CLIENT / f"{name}.py" for name in sorted(SHARED - {"__init__"})]
    bad = _offending(shared, "odbclient.trainer") + _offending(shared, "odbclient.producer")
    assert not bad, f"the shared layout must stand alone (move the code it needs here): {bad}"


def test_the_daemon_imports_no_trainer_module() -> None:
    """The daemon spawns producers (producer_main, dataset) and reads their lane headers (lane),
    but never needs the trainer side's code; its demo trainer uses the public ODBClient."""
    bad = _offending(_modules(SERVER), "odbclient.trainer")
    assert not bad, f"move what these need into a shared odbclient module: {bad}"


@pytest.mark.parametrize("root", [CLIENT, SERVER], ids=["client", "server"])
def test_no_module_is_over_600_lines(root: Path) -> None:
    sizes = {p: len(p.read_text().splitlines()) for p in _modules(root)}
    over = {str(p.relative_to(ROOT)): n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these by concern (at most {MAX_LINES} lines each): {over}"
