"""A real ``redis-server`` for a test: a free port on loopback, a password, its own directory,
stopped by its pid however the test ends. Skipped (with the reason) only when no
``redis-server`` is on PATH, and failed instead when ``FEDKV_REQUIRE_REDIS=1`` (CI installs
Debian's ``redis-server`` package and must not skip)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER = "redis-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process: ``url`` to reach it, ``client()`` to look inside,
    ``stop``/``start``/``restart`` for fault tests (the same port and password each time)."""

    def __init__(self, directory: Path, *extra: str, save: bool = False) -> None:
        self.directory, self.extra, self.save = directory, extra, save
        self.port = _free_port()
        self.password = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass",
                self.password, "--dir", str(self.directory), "--appendonly", "no",
                "--logfile", str(self.directory / "redis.log"), "--daemonize", "no"]
        if not self.save:
            args += ["--save", ""]
        self.proc = subprocess.Popen([*args, *self.extra], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:  # noqa: BLE001 -- not listening yet
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "redis.log")
                raise RuntimeError("redis-server did not start: " +
                                   (log.read_text()[-2000:] if log.exists() else "no log"))
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the process by its pid (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL by pid: what a crash looks like."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=10)


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
