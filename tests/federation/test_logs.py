"""federation.logs: every log record of a fedkv app prints once, whatever imports Opacus when."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
OPACUS_BASIC_CONFIG = """logging.basicConfig(
    format="%(asctime)s:%(levelname)s:%(message)s",
    datefmt="%m/%d/%Y %H:%M:%S",
    stream=sys.stderr,
)"""
"""What ``opacus/utils/module_utils.py`` runs at import (checked against the installed source)."""


def _run(order: str) -> str:
    """stderr+stdout of a fresh interpreter that logs after the given setup."""
    steps = {
        "opacus-only": ["OPACUS"],
        "fix-then-opacus": ["FIX", "OPACUS"],
        "opacus-then-fix": ["OPACUS", "FIX", "FIX"],
    }[order]
    body = "\n".join({"OPACUS": OPACUS_BASIC_CONFIG, "FIX": "configure_logging()"}[s] for s in steps)
    code = textwrap.dedent("""
        import logging, sys
        from flwr.common import log
        from federation.logs import configure_logging
        """) + body + textwrap.dedent("""
        log(logging.INFO, "MARK-INFO")
        log(logging.DEBUG, "MARK-DEBUG")
        logging.getLogger("some.library").warning("MARK-OTHER-WARNING")
        logging.getLogger("some.library").info("MARK-OTHER-INFO")
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_opacus_still_configures_the_root_logger_at_import() -> None:
    spec = importlib.util.find_spec("opacus.utils.module_utils")
    assert spec is not None and spec.origin is not None
    assert OPACUS_BASIC_CONFIG in Path(spec.origin).read_text()  # the cause, read without importing


def test_the_cause_opacus_basic_config_duplicates_flower_records() -> None:
    out = _run("opacus-only")
    assert out.count("MARK-INFO") == 2 and "MARK-DEBUG" in out


@pytest.mark.parametrize("order", ["fix-then-opacus", "opacus-then-fix"])
def test_configure_logging_prints_every_record_once(order) -> None:
    out = _run(order)
    assert out.count("MARK-INFO") == 1
    assert "MARK-DEBUG" not in out  # Flower's console handler is INFO; the root no longer prints its DEBUG
    assert out.count("MARK-OTHER-WARNING") == 1  # other libraries' warnings still print, once
    assert "MARK-OTHER-INFO" not in out  # as without Opacus: the root prints WARNING and above only
