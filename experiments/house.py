"""The house's shape, measured: issue 22's targets as numbers a restructuring can be held to.

    python -m experiments.house            # a small table
    python -m experiments.house --json     # the same as one JSON object
    python -m experiments.house --static   # only the parts that need no run (seconds)

(the measured round's own log lines go to stderr; the table or JSON to stdout; ~20 s on 2 cores)

A tool that inspects the code; it changes nothing. The product is the packages ``node/``,
``federation/``, ``crypto/`` and ``cache/`` (``experiments/`` and ``tests/`` are not). Measured:

- ``round_files``: product files that execute code during one round of the in-process grid
  (``federation.local.run_local``: digits, he=true, dp-mode distributed, 2 nodes; round 1, so
  the round includes enrolment and CKKS provisioning, as a run's first round does). Measured
  with ``coverage``; a file counts when a line *inside a function or method body* ran, so a
  module only imported (its top-level ``def``/``class``/constants) does not count, whether it
  was imported before or during the round; ``federation/local.py`` (the in-process grid, which
  stands in for Flower's ``Grid``) counts like any product file. Target <= 25.
  ``round_files_steady`` is the same for a steady-state round (round 2 of 2: no provisioning).
- ``decode_step_files``: the same for one cached decode step: a node (lm, fp32 K/V) holds a
  session whose system prompt and first turn are prefilled and decoded; the step measured is
  ``CacheNode.send(session, b"", max_new_tokens=1)`` (one token through the session's turn
  loop and the model's cached forward), in the middle of a block. Target <= 8.
  ``decode_block_files``: the same over a block's worth of steps (16) for fp32 and int8 K/V
  together, so the steps that fill a block and, under int8, quantize one are in.
- ``import_cycles``: strongly connected components of the product's import graph, every
  import statement counted wherever it sits (module top level, inside a function, under
  ``if TYPE_CHECKING:``), relative imports resolved, ``from p import name`` an edge to the
  module ``p.name`` when that is a module, else to ``p``. Each cycle: its modules and one
  shortest loop through the first of them. Target: none.
- ``long_functions``: product functions (methods and nested functions included) over 60
  lines, ``def`` line to last line, decorators not counted. Target: none.
- ``long_modules``: product modules over 600 lines. Target: none.

Caveat of the coverage figures: code without a line in a product file (e.g. the ``__init__``
a ``@dataclass`` generates) is not seen, so a file whose only role in the round is such a class
does not count.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PRODUCT_PACKAGES", "Function", "ROOT", "TARGETS", "decode_block_files", "decode_step_files",
    "executed_files", "find_cycles", "function_lengths", "import_graph", "long_functions",
    "long_modules", "main", "measure", "module_name", "product_files", "round_files", "table",
]

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("node", "federation", "crypto", "cache")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600
TARGETS = {"round_files": 25, "decode_step_files": 8, "import_cycles": 0, "long_functions": 0,
           "long_modules": 0}
"""Issue 22's targets: the most of each (counts)."""

ROUND_CONFIG = {"task": "digits", "he": True, "dp-mode": "distributed", "min-clients": 2, "seed": 42,
                "sampler-seed": 0}


# -- the product's files and modules ------------------------------------------------------------

def product_files(root: Path = ROOT, packages: Sequence[str] = PRODUCT_PACKAGES) -> list[Path]:
    """Every ``.py`` file of the product packages, sorted."""
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path, root: Path = ROOT) -> str:
    """``cache/engine.py`` -> ``cache.engine``; ``cache/__init__.py`` -> ``cache``."""
    parts = list(path.resolve().relative_to(root.resolve()).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rel(path: Path | str, root: Path) -> str:
    return Path(path).resolve().relative_to(root.resolve()).as_posix()


# -- import cycles ------------------------------------------------------------------------------

def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              modules: set[str]) -> set[str]:
    """Product modules one import statement names (see the module docstring)."""

    def known(name: str) -> str | None:  # the module itself, else its nearest product package
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    if isinstance(node, ast.Import):
        targets = [known(a.name) for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            base = ".".join(package + ([base] if base else []))
        targets = [known(f"{base}.{a.name}" if base else a.name) or known(base) for a in node.names]
    return {t for t in targets if t and t != module}


def import_graph(root: Path = ROOT, packages: Sequence[str] = PRODUCT_PACKAGES) -> dict[str, set[str]]:
    """{module: product modules it imports}, every import statement in the file counted."""
    files = {module_name(p, root): p for p in product_files(root, packages)}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, path.name == "__init__.py", modules)
        graph[module] = edges
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[dict[str, list[str]]]:
    """The graph's cycles as strongly connected components (Tarjan, iterative): each
    ``{"modules": sorted members, "example": a shortest loop from the first member}``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in graph.get(v, ()):
                        components.append(sorted(comp))
    return [{"modules": comp, "example": _shortest_loop(graph, comp)} for comp in sorted(components)]


def _shortest_loop(graph: Mapping[str, Iterable[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (BFS inside it)."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start] + path[::-1][1:] + [start] if v != start else [start, start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    return []


# -- long functions and modules -----------------------------------------------------------------

@dataclass(frozen=True)
class Function:
    path: str
    line: int
    name: str
    """Qualified within the module: ``Class.method``, ``outer.<locals>.inner`` as ``outer.inner``."""
    lines: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} ({self.lines} lines)"


def function_lengths(path: Path, root: Path = ROOT) -> list[Function]:
    """Every function in the file with its length (``def`` line to last line)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.append(Function(_rel(path, root), child.lineno, name,
                                    (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def long_functions(root: Path = ROOT, packages: Sequence[str] = PRODUCT_PACKAGES,
                   limit: int = MAX_FUNCTION_LINES) -> list[Function]:
    """Product functions over ``limit`` lines, longest first."""
    found = [f for p in product_files(root, packages) for f in function_lengths(p, root) if f.lines > limit]
    return sorted(found, key=lambda f: (-f.lines, f.path, f.line))


def long_modules(root: Path = ROOT, packages: Sequence[str] = PRODUCT_PACKAGES,
                 limit: int = MAX_MODULE_LINES) -> list[tuple[str, int]]:
    """Product modules over ``limit`` lines as ``(path, lines)``, longest first."""
    sizes = [(_rel(p, root), len(p.read_text(encoding="utf-8").splitlines())) for p in product_files(root, packages)]
    return sorted(((p, n) for p, n in sizes if n > limit), key=lambda pn: (-pn[1], pn[0]))


# -- files that execute code (coverage) ---------------------------------------------------------

def _body_lines(path: Path) -> set[int]:
    """Lines inside function and method bodies (what runs when the function is called)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            for stmt in body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _coverage(root: Path, packages: Sequence[str]) -> Any:
    import coverage

    return coverage.Coverage(data_file=None, include=[str(root / pkg / "*") for pkg in packages],
                             branch=False, config_file=False)


def _files_of(data: Any, root: Path, context: str | None = None) -> list[str]:
    """Product files with a function-body line in the coverage data (of ``context`` only)."""
    if context is not None:
        data.set_query_contexts([f"^{context}$"])
    files = [m for m in data.measured_files() if set(data.lines(m) or ()) & _body_lines(Path(m))]
    return sorted(_rel(m, root) for m in files)


def executed_files(action: Callable[[], Any], root: Path = ROOT,
                   packages: Sequence[str] = PRODUCT_PACKAGES) -> list[str]:
    """Product files in which ``action()`` ran a line inside a function body, sorted."""
    cov = _coverage(root, packages)
    cov.start()
    try:
        action()
    finally:
        cov.stop()
    return _files_of(cov.get_data(), root)


class _NodeDir:
    """A private ``$FEDKV_NODE_DIR`` for the in-process nodes' key files, removed after."""

    def __enter__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="fedkv-house-")
        self.before = os.environ.get("FEDKV_NODE_DIR")
        os.environ["FEDKV_NODE_DIR"] = self.tmp.name

    def __exit__(self, *exc: object) -> None:
        if self.before is None:
            os.environ.pop("FEDKV_NODE_DIR", None)
        else:
            os.environ["FEDKV_NODE_DIR"] = self.before
        self.tmp.cleanup()


def round_files(num_nodes: int = 2) -> dict[str, list[str]]:
    """Product files each round of a 2-round in-process run executes code in:
    ``{"round-1": [...], "round-2": [...]}`` (round 1 includes enrolment and provisioning).
    One coverage run; ``on_round`` switches coverage's context when a round is recorded."""
    from federation import node_host
    from federation.local import run_local

    config = {**ROUND_CONFIG, "num-server-rounds": 2}
    cov = _coverage(ROOT, PRODUCT_PACKAGES)

    def on_round(rec: Any) -> None:
        cov.switch_context(f"round-{rec.round + 1}")

    with _NodeDir():
        node_host.forget_all()
        cov.start()
        cov.switch_context("round-1")
        try:
            results = run_local(config, num_nodes, on_round=on_round)
        finally:
            cov.stop()
            node_host.forget_all()
    if results.status != "completed" or len(results.rounds) != 2:
        raise RuntimeError(f"the measured run did not complete 2 rounds: {results.status}")
    data = cov.get_data()
    return {name: _files_of(data, ROOT, name) for name in ("round-1", "round-2")}


def _decode_node(kv_dtype: str) -> tuple[Any, str]:
    """An lm node holding a session whose system prompt and first turn are prefilled and decoded."""
    from node.cache_node import CacheNode, NodeSpec

    node = CacheNode(NodeSpec(0, 2, task="lm", kv_dtype=kv_dtype))
    session = node.create_session(b"# You are a helpful Python assistant.\n")
    node.send(session, b"def add(a, b):\n", max_new_tokens=4)  # prefill, then decode steps
    return node, session


def decode_step_files(kv_dtype: str = "fp32", steps: int = 1) -> list[str]:
    """Product files ``steps`` cached decode steps execute code in (see the module docstring)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        node, session = _decode_node(kv_dtype)
        return executed_files(lambda: node.send(session, b"", max_new_tokens=steps))
    finally:
        torch.set_num_threads(before)


def decode_block_files() -> list[str]:
    """Product files a block's worth of decode steps executes code in, fp32 and int8 K/V
    together: one step fills a block (prefix index, allocation, prefetch) and under int8 one
    pushes a block out of the full-precision window (quantization)."""
    from cache.config import CacheConfig

    steps = CacheConfig.block_size
    return sorted(set(decode_step_files("fp32", steps)) | set(decode_step_files("int8", steps)))


# -- the command --------------------------------------------------------------------------------

def measure(static_only: bool = False, num_nodes: int = 2) -> dict[str, Any]:
    """Every figure of the module docstring as one JSON-able dict."""
    out: dict[str, Any] = {}
    if not static_only:
        rounds = round_files(num_nodes)
        out["round_files"] = rounds["round-1"]
        out["round_files_steady"] = rounds["round-2"]
        out["decode_step_files"] = decode_step_files()
        out["decode_block_files"] = decode_block_files()
    out["import_cycles"] = find_cycles(import_graph())
    out["long_functions"] = [str(f) for f in long_functions()]
    out["long_modules"] = [f"{p} ({n} lines)" for p, n in long_modules()]
    return out


def table(figures: Mapping[str, Any]) -> str:
    """The figures as a small text table (count, target, a few examples)."""
    rows = [("figure", "now", "target", "examples")]
    for key, value in figures.items():
        target = TARGETS.get(key.removesuffix("_steady"))
        if key == "import_cycles":
            sample = "; ".join(" -> ".join(c["example"]) for c in value[:3])
        else:
            sample = ", ".join(str(v).split(" (")[0] for v in value[:3])
        more = f" (+{len(value) - 3} more)" if len(value) > 3 else ""
        rows.append((key, str(len(value)), "-" if target is None else f"<= {target}" if target else "0",
                     sample + more))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m experiments.house", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--static", action="store_true",
                   help="only import cycles and lengths (no round, no decode step; seconds)")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the measured round (default 2)")
    args = p.parse_args(argv)
    figures = measure(static_only=args.static, num_nodes=args.nodes)
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        print(table(figures))
        for key in ("round_files", "decode_step_files"):
            if key in figures:
                print(f"\n{key}: " + " ".join(figures[key]))
        for cycle in figures["import_cycles"]:
            print(f"\ncycle: {' '.join(cycle['modules'])}\n  e.g. {' -> '.join(cycle['example'])}")
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
