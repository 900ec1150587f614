"""A ``redis-server`` of one's own: a free loopback port, a fresh password, its own directory,
stopped by its pid. What the Redis tier's tests and ``experiments.bench_redis`` start (Debian's
``redis-server`` package; ``--save ''`` unless a dump is wanted)."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

from federation.deploy.flwr_sandbox import free_port

SERVER = "redis-server"


class RedisServer:
    """One ``redis-server`` process: ``url`` to reach it, ``client()`` to look inside,
    ``stop``/``start``/``restart`` for fault tests (the same port and password each time)."""

    def __init__(self, directory: Path, *extra: str, save: bool = False) -> None:
        self.directory, self.extra, self.save = directory, extra, save
        self.port = free_port()
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


def start_in(parent: Path, name: str) -> RedisServer:
    """A started server whose files live in a new 0700 folder ``parent/name``."""
    d = parent / name
    d.mkdir(mode=0o700)
    server = RedisServer(d)
    server.start()
    return server
