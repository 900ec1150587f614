"""A real ``redis-server`` for a test (``experiments.redis_server.RedisServer``: a free port on
loopback, a password, its own directory, stopped by its pid however the test ends). Skipped
(with the reason) only when no ``redis-server`` is on PATH, and failed instead when
``FEDKV_REQUIRE_REDIS=1`` (CI installs Debian's ``redis-server`` package and must not skip)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.redis_server import SERVER, RedisServer

__all__ = ["RedisServer", "require_server", "running_redis"]


def require_server() -> None:
    if shutil.which(SERVER) is None:
        reason = (f"{SERVER} is not on PATH (Debian/Ubuntu: apt-get install redis-server); "
                  f"the Redis tier's tests need a real server")
        if os.environ.get("FEDKV_REQUIRE_REDIS") == "1":
            pytest.fail(reason + " and FEDKV_REQUIRE_REDIS=1 forbids skipping")
        pytest.skip(reason)


def running_redis(tmp_path: Path, *extra: str, save: bool = False) -> Iterator[RedisServer]:
    """Body of a fixture: a started server, always stopped afterwards."""
    require_server()
    d = tmp_path / "redis"
    d.mkdir(mode=0o700)
    server = RedisServer(d, *extra, save=save)
    try:
        server.start()
        yield server
    finally:
        server.stop()
