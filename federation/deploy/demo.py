"""The demo's state (``Demo``) and its preparation: kits, FLWR_HOME, environment, port; the
waiting and log-reading helpers the steps share."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from crypto import PASSPHRASE_ENV
from federation.deploy.netns import Netns
from federation.deploy.processes import VENV_BIN, Tracker, say
from federation.deploy.flwr_sandbox import free_port
from federation.deploy.provisioning import write_kits
from federation.deploy.serve_probe import ServeProbe

__all__ = ["CONNECTION", "Demo", "RunOutcome", "exited", "listening", "prepare", "tail", "wait_for"]

CONNECTION = "fedkv-demo"


@dataclass
class RunOutcome:
    returncode: int | None
    lines: list[str]
    killed: int | None
    results: dict | None


@dataclass
class Demo:
    work: Path
    nodes: int
    rounds: int
    task: str
    round_timeout: float
    kill_one: bool
    extra_run_config: str = ""
    netns: Netns | None = None
    procs: Tracker = field(default_factory=Tracker)
    kits: dict[str, Path] = field(default_factory=dict)
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    node_ids: dict[int, int] = field(default_factory=dict)
    """Flower node id -> partition id (from ``flwr supernode register``)."""
    refused: dict[str, bool] = field(default_factory=dict)
    outcome: RunOutcome | None = None
    killed: int | None = None
    app_ref: str | None = None
    """Run the app as committed at this git ref instead of the working tree."""
    isolated_nodes: int = 0
    """SuperNodes whose network namespace differs from ours (--netns: all of them)."""
    seal_kits: bool = False
    node_env: dict[str, str] = field(default_factory=dict, repr=False)
    """Extra environment of the SuperNodes only (the kit passphrase with --seal-kits)."""
    serve: ServeProbe | None = None
    """--serve: ``node.serving.openai_api`` beside SuperNode 0, following its cache directory."""

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def link_host(self) -> str:
        return self.netns.link_ip if self.netns else "127.0.0.1"

    def superlink_address(self) -> str:
        return f"{self.link_host}:{self.port}"


def prepare(demo: Demo) -> None:
    """Kits, FLWR_HOME with the ``fedkv-demo`` connection, environment, free port."""
    demo.work.mkdir(parents=True, exist_ok=True, mode=0o700)
    demo.logs.mkdir(exist_ok=True)
    hosts = ["localhost", "127.0.0.1", "::1"]
    if demo.netns:
        demo.netns.setup(demo.nodes)
        hosts.append(demo.netns.link_ip)
    if demo.seal_kits:  # random, never printed: only the SuperNodes' environment holds it
        demo.node_env[PASSPHRASE_ENV] = secrets.token_urlsafe(24)
    passphrase = demo.node_env.get(PASSPHRASE_ENV)
    demo.kits = write_kits(demo.work / "kits", demo.nodes, hosts=hosts,
                           passphrase=passphrase.encode() if passphrase else None)
    demo.port = free_port()
    home = demo.work / "flwr-home"
    home.mkdir(exist_ok=True, mode=0o700)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{demo.superlink_address()}"\nroot-certificates = "{demo.kits["server"] / "ca.crt"}"\n'
    )
    env = os.environ.copy()
    env.update(FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_DISABLE_UPDATE_CHECK="1", FLWR_TELEMETRY_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    demo.env = env
    say(f"kits in {demo.work / 'kits'}; SuperLink port {demo.port}; FLWR_HOME {home}")


def wait_for(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.5,
              abort: Callable[[], str | None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if abort is not None and (why := abort()):
            raise RuntimeError(f"{what}: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def exited(proc: subprocess.Popen, log: Path) -> Callable[[], str | None]:
    def check() -> str | None:
        if proc.poll() is None:
            return None
        return f"exited with {proc.returncode}; log tail: {tail(log)}"
    return check


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
