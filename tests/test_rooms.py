"""The rooms of raylm/cluster/ (pyproject's [tool.raylm.rooms], lowest first): a module imports its own room, a lower
one, or the floors below cluster, never a room above it, so that the engine reaches none of the tools or front ends.
Rooms listed together share a rank and may import each other."""
from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "raylm" / "cluster"
PACKAGE = "raylm.cluster"


def room_ranks() -> dict[str, int]:
    order = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["raylm"]["rooms"]["cluster"]
    return {room: rank for rank, rooms in enumerate(order) for room in ([rooms] if isinstance(rooms, str) else rooms)}


def imported_rooms(tree: ast.AST) -> set[str]:
    """The rooms `tree` imports from; PACKAGE itself (its face imports the front ends) and a relative import count as
    the names they are, which are no room."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.append("." * node.level + (node.module or ""))
            elif node.module == PACKAGE:  # from raylm.cluster import core / LLM
                names += [f"{PACKAGE}.{alias.name}" for alias in node.names]
            elif node.module:
                names.append(node.module)
    found = set()
    for name in names:
        if name.startswith("."):
            found.add(name)
        elif name == PACKAGE or name.startswith(PACKAGE + "."):
            found.add(name.removeprefix(PACKAGE).lstrip(".").split(".")[0] or PACKAGE)
    return found


def upward_imports(room: str, tree: ast.AST, ranks: dict[str, int]) -> list[str]:
    return sorted(target for target in imported_rooms(tree)
                  if target not in ranks or ranks[target] > ranks[room])


def test_every_cluster_module_is_in_a_room() -> None:
    ranks = room_ranks()
    loose = [path.relative_to(CLUSTER).as_posix() for path in CLUSTER.rglob("*.py")
             if path.relative_to(CLUSTER).parts[0] not in ranks and path != CLUSTER / "__init__.py"]
    assert loose == []


def test_imports_point_down_the_rooms() -> None:
    ranks = room_ranks()
    upward = []
    for path in sorted(CLUSTER.rglob("*.py")):
        if path == CLUSTER / "__init__.py":  # the package's face: `from raylm.cluster import LLM`
            continue
        room = path.relative_to(CLUSTER).parts[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        upward += [f"{path.relative_to(ROOT)} ({room}) imports {target}"
                   for target in upward_imports(room, tree, ranks)]
    assert upward == []


def test_the_engine_sits_below_the_tools_and_front_ends() -> None:
    ranks = room_ranks()
    assert ranks["core"] < ranks["engine"] < ranks["tools"] < ranks["entrypoints"]
    assert ranks["engine"] < ranks["serve"]


def test_an_upward_import_is_caught() -> None:
    ranks = room_ranks()
    for source in ("from raylm.cluster.entrypoints.llm import LLM", "import raylm.cluster.serve.app",
                   "from raylm.cluster import tools", "from raylm.cluster import LLM", "from .engine import x",
                   "def f():\n    from raylm.cluster.tools import serving_benchmark"):
        assert upward_imports("core", ast.parse(source), ranks), source
    assert upward_imports("engine", ast.parse("from raylm.cluster.core.scheduler import Scheduler\n"
                                              "from raylm.runner import attention"), ranks) == []
