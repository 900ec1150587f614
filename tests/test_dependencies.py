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
LAZY_EXTRAS = {"node/models.py": ("llm",), "node/chat.py": ("llm",)}
"""Product modules serving an optional extra: imports *inside functions* may come from it (the
main job never calls them); their module-level imports must still be core dependencies."""


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


def _outside_functions(node: ast.AST):
    """``ast.walk`` without descending into function bodies (module- and class-level code)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _outside_functions(child)


def _imports(package: str, lazy: frozenset[str] = frozenset(), only: str | None = None) -> dict[str, str]:
    """Top-level module -> one file importing it, for every absolute import in ``package``
    (in the files named in ``lazy``, only the imports outside functions; with ``only``, the
    one file of that path, all its imports)."""
    found: dict[str, str] = {}
    paths = [REPO / only] if only else sorted((REPO / package).rglob("*.py"))
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(REPO).as_posix()
        for node in (_outside_functions(tree) if rel in lazy else ast.walk(tree)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                found.setdefault(mod.split(".")[0], rel)
    return found


def _undeclared(packages: tuple[str, ...], extras: tuple[str, ...],
                lazy: frozenset[str] = frozenset(), only: str | None = None) -> list[str]:
    declared = _declared(extras)
    dists = packages_distributions()
    own = set(_pyproject()["tool"]["setuptools"]["packages"]["find"]["include"])
    missing = []
    for package in packages:
        for mod, where in _imports(package, lazy, only).items():
            if mod in sys.stdlib_module_names or f"{mod}*" in own or mod == "__future__":
                continue
            providers = {_name(d) for d in dists.get(mod, [])}
            if not providers & declared:
                missing.append(f"{mod} (imported by {where}; provided by {sorted(providers) or 'nothing installed'})")
    return missing


def test_the_product_imports_only_declared_dependencies() -> None:
    assert _undeclared(PRODUCT, extras=(), lazy=frozenset(LAZY_EXTRAS)) == []


def test_modules_serving_an_extra_import_only_the_core_or_that_extra() -> None:
    """node.models needs transformers (the llm extra) only when it converts or tokenizes."""
    for rel, extras in LAZY_EXTRAS.items():
        assert _undeclared((rel,), extras=extras, only=rel) == []
        assert _undeclared((rel,), extras=(), only=rel) != []  # the extra is really needed


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
