"""Fixtures for the federation tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from federation import node_host
from federation.deploy.flwr_sandbox import FlwrSandbox, flwr_sandbox


@pytest.fixture(autouse=True)
def _node_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node-local key files of each test go to its own temporary directory."""
    monkeypatch.setenv("FEDKV_NODE_DIR", str(tmp_path / "fedkv-nodes"))


@pytest.fixture(autouse=True)
def _fresh_node_cache() -> Iterator[None]:
    """Each test starts with no cached nodes (as a fresh ClientApp process would)."""
    node_host.forget_all()
    yield
    node_host.forget_all()


@pytest.fixture
def flwr_cli(tmp_path: Path) -> Iterator[FlwrSandbox]:
    """Real ``flwr run`` in a temp FLWR_HOME on free ports; SuperLink + Ray stopped after."""
    with flwr_sandbox(tmp_path) as box:
        yield box
