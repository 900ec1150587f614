"""crypto sits at the bottom: it must not import node, federation, experiments, cache or flwr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("node", "federation", "experiments", "cache", "flwr")


def test_crypto_imports_nothing_upward() -> None:
    code = (
        "import sys, crypto, crypto.ckks, crypto.slot_plan, crypto.header_check, crypto.signing, crypto.key_wrap, crypto.dp.privacy, crypto.dp.encoding_policy, crypto.layout, crypto.packing\n"
        "from crypto import dp_sgd_epsilon\n"
        "dp_sgd_epsilon(1.0, 0.1, 3, 1e-5)\n"  # pulls opacus in too
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_upward_import_statements_in_source() -> None:
    for path in (ROOT / "crypto").rglob("*.py"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")):
                top = stripped.split()[1].split(".")[0]
                assert top not in FORBIDDEN, f"{path.name}: {stripped}"
