"""node/ by responsibility: each room imports only the rooms below it (``node/__init__``).

Read from the source's import statements (function-local ones too), so a lazy import cannot
slip an upward dependency past the check.
"""

from __future__ import annotations

import ast
from pathlib import Path

NODE = Path(__file__).resolve().parents[2] / "node"
ROOMS = {  # room -> the rooms it may import
    "models": set(),
    "tasks": {"models"},
    "engine": {"models"},
    "serving": {"engine", "tasks", "models"},
}
TOP = {"__init__", "cache_node", "serve_gate", "workload_pass"}


def _node_imports(path: Path) -> set[str]:
    """``node.X...`` modules a file imports, as ``X`` (a room or a top-level module)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            parts = n.module.split(".")
            if parts[0] == "node":
                out |= {parts[1]} if len(parts) > 1 else {a.name for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name.split(".")[1] for a in n.names if a.name.startswith("node.")}
    return out


def test_the_top_holds_the_node_itself_and_the_rooms() -> None:
    modules = {p.stem for p in NODE.glob("*.py")}
    rooms = {p.name for p in NODE.iterdir() if (p / "__init__.py").exists()}
    assert modules == TOP and rooms == set(ROOMS)


def test_each_room_imports_only_the_rooms_below_it() -> None:
    wrong = []
    for room, allowed in ROOMS.items():
        for path in sorted((NODE / room).rglob("*.py")):
            bad = _node_imports(path) - allowed - {room}
            wrong += [f"node/{room}/{path.name} imports node.{b}" for b in sorted(bad)]
    assert wrong == []


def test_every_room_says_what_lives_there_and_what_it_may_import() -> None:
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((NODE / room / "__init__.py").read_text()))
        assert doc and "import" in doc, room


def test_the_check_sees_an_upward_import(tmp_path) -> None:
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from node.serving import serve\n    import node.cache_node\n")
    assert _node_imports(bad) == {"serving", "cache_node"}
