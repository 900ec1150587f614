"""Shared CKKS material for the crypto tests (created once: key generation is the slow part)."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import CkksContext, make_secret_context


@pytest.fixture(scope="session")
def secret_ctx() -> CkksContext:
    return make_secret_context()


@pytest.fixture(scope="session")
def public_bytes(secret_ctx: CkksContext) -> bytes:
    return secret_ctx.public_bytes()


@pytest.fixture(scope="session")
def other_ctx() -> CkksContext:
    """Same parameters, different key: what a foreign dealer would hold."""
    return make_secret_context()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)
