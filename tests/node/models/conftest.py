"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from node.models import kernels


@pytest.fixture(scope="module")
def k():
    """The fused CPU kernels (``node.models.kernels``); the test is skipped where they are
    not built."""
    ops = kernels.ops()
    if ops is None:
        pytest.skip(f"fused kernels not built here: {kernels.status()}")
    return ops
