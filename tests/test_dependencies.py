"""Every module the product imports comes from a dependency ``pyproject.toml`` declares.

A fresh ``pip install -e .`` must run the main job: an import that only arrives through an
extra or another package's dependencies (``safetensors`` through ``transformers``) breaks it on a
new machine while the test venv, which has the extras, stays green.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions, requires
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("cache", "crypto", "node", "federation")
"""Packages the main job and the tests' product paths import (experiments may use extras)."""
def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _declared(extras: tuple[str, ...] = ()) -> set[str]:
    """Declared distributions plus what the declared extras of each bring (``flwr[dp]``)."""
    project = _pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    names = {_name(r) for r in reqs}
    for r in reqs:  # a requirement's own extras: flwr[simulation,dp] brings ray, dp-accounting
        m = re.match(r"\s*([\w.-]+)\[([^\]]+)\]", r)
        if not m:
            continue
        wanted = {e.strip() for e in m.group(2).split(",")}
        for dep in requires(m.group(1)) or []:
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", dep)
            if extra and extra.group(1) in wanted:
                names.add(_name(dep))
    return names


def _imports(package: str) -> dict[str, str]:
    """Top-level module -> one file importing it, for every absolute import in ``package``
    (function-local ones included: a call that reaches them must not fail on a base install)."""
    found: dict[str, str] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                found.setdefault(mod.split(".")[0], rel)
    return found


def _undeclared(packages: tuple[str, ...], extras: tuple[str, ...]) -> list[str]:
    declared = _declared(extras)
    dists = packages_distributions()
    own = set(_pyproject()["tool"]["setuptools"]["packages"]["find"]["include"])
    missing = []
    for package in packages:
        for mod, where in _imports(package).items():
            if mod in sys.stdlib_module_names or f"{mod}*" in own or mod == "__future__":
                continue
            providers = {_name(d) for d in dists.get(mod, [])}
            if not providers & declared:
                missing.append(f"{mod} (imported by {where}; provided by {sorted(providers) or 'nothing installed'})")
    return missing


def test_the_product_imports_only_declared_dependencies() -> None:
    """Every import of the product, those behind ``except ImportError`` too (``response_format``'s
    llguidance): ``pip install -e .`` alone must give a new user's main job all of them."""
    assert _undeclared(PRODUCT, extras=()) == []


def test_experiments_import_only_declared_dependencies_or_the_bench_and_test_extras() -> None:
    """The test extra too: ``experiments.house`` measures the product with ``coverage``."""
    assert _undeclared(("experiments",), extras=("bench", "test")) == []


def test_the_check_sees_an_undeclared_import(tmp_path, monkeypatch) -> None:
    """The check itself can fail: a module importing a package nobody declares is named."""
    pkg = tmp_path / "cache"
    pkg.mkdir()
    (pkg / "x.py").write_text("import pytest\nfrom numpy import zeros\n")
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    missing = _undeclared(("cache",), extras=())
    assert len(missing) == 1 and missing[0].startswith("pytest (imported by cache/x.py")
