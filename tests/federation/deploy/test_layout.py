"""The app does not reach into the deployment tools: no module of ``federation/`` outside
``federation/deploy/`` imports ``federation.deploy`` (the FAB and every round run without it)."""

from __future__ import annotations

import ast
from pathlib import Path

FEDERATION = Path(__file__).resolve().parents[3] / "federation"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def test_no_app_module_imports_the_deploy_tools() -> None:
    app = sorted(FEDERATION.glob("*.py"))
    assert len(app) > 10 and (FEDERATION / "node_store.py") in app
    offenders = {p.name: sorted(i for i in _imports(p) if i.startswith("federation.deploy"))
                 for p in app}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scan_sees_a_deploy_import(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from federation import deploy\n    from federation.deploy.provisioning import write_kits\n")
    assert {"federation.deploy", "federation.deploy.provisioning"} <= _imports(probe)
