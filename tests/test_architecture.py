"""The picture in docs/architecture.md, held against the code's import graph.

The rooms table of the page is the source: every room named there exists, every package of the
project belongs to a room, each room imports only the rooms its row allows, no two files import
each other in a cycle, and modules and folders stay small (the known exceptions are ceilings).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fleetgate", "gateway", "backends", "router", "policies")
PAGE = ROOT / "docs" / "architecture.md"
MAX_LINES = 400
MAX_MODULES = 15

#: modules and folders over the size rules today: (lines or modules) they may not exceed. Shrink
#: a number when the code shrinks; never raise one (split the module instead).
KNOWN_LARGE: dict[str, int] = {
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The project module an import names (its longest existing prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    """Every project module a file imports, wherever the import statement stands."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        out.update(t for t in map(_target, names) if t is not None)
    return out


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _rooms() -> dict[str, set[str] | None]:
    """room -> the rooms it may import (None: any), read from the page's rooms table."""
    text = PAGE.read_text()
    table = text[text.index("<!-- rooms: checked by tests/test_architecture.py -->") :]
    rooms: dict[str, set[str] | None] = {}
    for line in table.splitlines()[3:]:
        if not line.startswith("| `"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        room = cells[0].strip("`")
        allowed = cells[2]
        if allowed.startswith("any room"):
            rooms[room] = None
        elif allowed == "nothing of the project":
            rooms[room] = set()
        else:
            rooms[room] = {a.strip() for a in allowed.split(",")}
    return rooms


ROOMS = _rooms()


def _room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) == 1:
        return parts[0]
    if parts[1] in ("config", "config_reference"):
        return "gateway.config"
    return f"gateway.{parts[1]}"


def test_the_page_names_every_room_and_every_room_exists() -> None:
    rooms_in_code = {_room_of(m) for m in MODULES if m != "gateway"}
    assert rooms_in_code - set(ROOMS) == set(), "rooms in the code but not in docs/architecture.md"
    assert set(ROOMS) - rooms_in_code == set(), "rooms in docs/architecture.md that do not exist"


def test_each_room_imports_only_what_its_row_allows() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        room = _room_of(module)
        allowed = ROOMS.get(room)
        if allowed is None:
            continue
        for target in targets:
            other = _room_of(target)
            if other != room and other != "gateway" and other not in allowed:
                wrong.append(f"{module} imports {target} ({room} may import {sorted(allowed) or 'nothing'})")
    assert wrong == []


def test_no_file_level_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH.get(node, ()):
            # a package's own __init__ imported by its submodules is not a cycle between files
            if node.startswith(nxt + ".") and MODULES[nxt].name == "__init__.py":
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert cycles == []


@pytest.mark.parametrize("package", PACKAGES)
def test_modules_and_folders_stay_small(package: str) -> None:
    too_large = []
    for path in (ROOT / package).rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > KNOWN_LARGE.get(rel, MAX_LINES):
            too_large.append(f"{rel}: {lines} lines")
    folders = defaultdict(int)
    for path in (ROOT / package).rglob("*.py"):
        if path.name != "__init__.py":
            folders[path.parent.relative_to(ROOT).as_posix()] += 1
    for folder, count in folders.items():
        if count > KNOWN_LARGE.get(folder, MAX_MODULES):
            too_large.append(f"{folder}/: {count} modules")
    assert too_large == []


def test_bench_is_a_package_without_path_edits() -> None:
    bench = ROOT / "bench"
    assert (bench / "__init__.py").exists()
    edits = [p.name for p in bench.glob("*.py") if re.search(r"sys\.path\s*(\[|\.insert|\.append)", p.read_text())]
    assert edits == []
