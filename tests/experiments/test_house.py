"""experiments.house: the import-cycle finder and the length counters on synthetic packages (fast),
the coverage figures on the real product (the round one is slow)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from experiments import house


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_cycle_finder_sees_function_local_type_only_and_relative_imports(tmp_path) -> None:
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b  # function-local\n    return b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "pkg/c.py": "import pkg.a\nclass C: ...\n",
        "pkg/d.py": "from pkg.a import f\nimport os, json\n",  # into the cycle, not part of it
        "other/__init__.py": "from pkg.sub import thing\n",
        "other/e.py": "from . import f\n",
        "other/f.py": "from .e import x\n",  # a 2-cycle through a relative `from . import`
        "pkg/sub.py": "thing = 1\n",
    })
    graph = house.import_graph(root, ("pkg", "other"))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"} and graph["other"] == {"pkg.sub"}
    cycles = house.find_cycles(graph)
    assert [c["modules"] for c in cycles] == [["other.e", "other.f"], ["pkg.a", "pkg.b", "pkg.c"]]
    assert cycles[0]["example"] == ["other.e", "other.f", "other.e"]
    assert cycles[1]["example"] == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def test_cycle_finder_finds_none_in_a_tree_and_takes_the_shortest_loop() -> None:
    assert house.find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    cycles = house.find_cycles({"a": {"b", "x"}, "b": {"c"}, "c": {"a"}, "x": {"a"}})
    assert cycles == [{"modules": ["a", "b", "c", "x"], "example": ["a", "x", "a"]}]
    assert house.find_cycles({"a": {"a"}}) == [{"modules": ["a"], "example": ["a", "a"]}]


def test_length_counters_count_def_to_last_line_and_module_lines(tmp_path) -> None:
    body61 = "".join(f"    x{i} = {i}\n" for i in range(60))  # def + 60 lines = 61
    body60 = "".join(f"    y{i} = {i}\n" for i in range(59))  # def + 59 lines = 60: not over
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/m.py": f"@staticmethod\ndef long():\n{body61}\n\ndef fits():\n{body60}\n"
                    f"class K:\n    def method(self):\n        def inner():\n            pass\n"
                    + "".join(f"        z{i} = {i}\n" for i in range(60)),
        "pkg/big.py": "x = 1\n" * 601,
        "pkg/ok.py": "x = 1\n" * 600,
    })
    lengths = {f.name: f.lines for f in house.function_lengths(root / "pkg" / "m.py", root)}
    assert lengths == {"long": 61, "fits": 60, "K.method": 63, "K.method.inner": 2}
    found = house.long_functions(root, ("pkg",))
    assert [str(f) for f in found] == ["pkg/m.py:127 K.method (63 lines)", "pkg/m.py:2 long (61 lines)"]
    assert house.long_modules(root, ("pkg",)) == [("pkg/big.py", 601)]


def test_static_figures_of_the_product_and_the_table(capsys) -> None:
    figures = house.main(["--static", "--json"])
    assert set(figures) == {"import_cycles", "long_functions", "long_modules"}
    assert json.loads(capsys.readouterr().out) == figures
    for cycle in figures["import_cycles"]:
        assert cycle["example"][0] == cycle["example"][-1] and set(cycle["example"]) <= set(cycle["modules"])
    text = house.table(figures)
    assert text.splitlines()[0].split()[:3] == ["figure", "now", "target"]
    assert f"long_modules    {len(figures['long_modules'])}" in text


def test_a_decode_step_executes_the_session_loop_and_the_cached_forward() -> None:
    files = house.decode_step_files()
    assert {"node/engine/sessions.py", "node/models/byte_model.py", "cache/attention.py"} <= set(files), files
    assert not any(f.startswith("federation/") for f in files)


@pytest.mark.slow
def test_one_round_executes_code_in_every_package() -> None:
    rounds = house.round_files()
    assert set(rounds) == {"round-1", "round-2"}
    for files in rounds.values():
        assert {f.split("/")[0] for f in files} == set(house.PRODUCT_PACKAGES)
        assert "federation/client_app.py" in files and "federation/strategy.py" in files
    assert "federation/key_service.py" in rounds["round-1"]  # the first round provisions the key
