"""Drive the real ``flwr run . --stream`` CLI in isolation, and always clean up (tests, benchmarks).

Isolation: a temporary FLWR_HOME *and* free ports for the local SuperLink. ``flwr run``
decides whether to start a SuperLink by probing 127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT
(default 39091), not by FLWR_HOME: with the default port a test would silently reuse
(and could then kill) a colleague's SuperLink.

Cleanup: the CLI leaves a detached ``flower-superlink`` running. We find exactly the one
whose ``--log-file`` lies in our FLWR_HOME, remember all its descendants (superexec,
flwr-simulation, Ray's gcs_server/raylet/workers), stop the SuperLink by pid and then
any descendant still alive, by pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "federation", "crypto", "cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_app_dir(dest: Path, source: Path = REPO) -> Path:
    """A minimal copy of the project at ``source`` that ``flwr run`` can build into a FAB.

    Uses that checkout's pyproject (which holds the ``[tool.flwr.app]`` sections); another
    ``source`` lets a benchmark run an older checkout beside this one.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for pkg in PACKAGES:
        if (source / pkg).is_dir():
            shutil.copytree(
                source / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
    shutil.copy(source / "pyproject.toml", dest / "pyproject.toml")
    return dest


def flwr_env(flwr_home: Path, http_port: int, control_port: int) -> dict[str, str]:
    env = os.environ.copy()
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port),
        FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
    )
    # The SuperLink's children must find the venv's executables.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


# -- processes ---------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def superlink_pids(flwr_home: Path) -> list[int]:
    """flower-superlink processes whose log file is inside ``flwr_home`` (ours only)."""
    marker = str(Path(flwr_home) / "local-superlink")
    return [p for p in _all_pids() if "flower-superlink" in _cmdline(p) and marker in _cmdline(p)]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        parent = _ppid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True for a running process (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_pids(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM each pid, wait, SIGKILL the stubborn; returns pids that needed SIGKILL."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    killed = []
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def stop_superlinks(flwr_home: Path) -> list[int]:
    """Stop our SuperLink(s) and every descendant (Ray included). Returns survivors."""
    survivors: list[int] = []
    for link in superlink_pids(flwr_home):
        family = descendants(link)
        stop_pids([link])
        stop_pids([p for p in family if alive(p)])
        survivors += [p for p in [link, *family] if alive(p)]
    return survivors


# -- running -------------------------------------------------------------------------------
@dataclass
class FlwrRun:
    returncode: int
    output: str
    results_path: Path | None
    wall_s: float
    superlink_pids: list[int] = field(default_factory=list)
    family: list[int] = field(default_factory=list)
    """SuperLink descendants seen right after the run (checked for leftovers)."""


@dataclass
class FlwrSandbox:
    app_dir: Path
    flwr_home: Path
    env: dict[str, str]
    runs: list[FlwrRun] = field(default_factory=list)

    def run(self, num_supernodes: int, run_config: dict[str, object], timeout: float = 600.0,
            extra_federation_config: str = "") -> FlwrRun:
        """``flwr run <app> --stream`` with the given nodes and run-config overrides."""
        rc = " ".join(f"{k}={_toml(v)}" for k, v in run_config.items())
        cmd = [
            "flwr", "run", str(self.app_dir), "--stream",
            "--federation-config", f"num-supernodes={num_supernodes} {extra_federation_config}".strip(),
            "--run-config", rc,
        ]
        t0 = time.monotonic()
        proc = subprocess.run(
            cmd, env=self.env, cwd=self.app_dir, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        wall = time.monotonic() - t0
        out = proc.stdout + proc.stderr
        m = re.findall(r"FEDKV_RESULTS (\S+)", out)
        links = superlink_pids(self.flwr_home)
        family = [p for link in links for p in descendants(link)]
        run = FlwrRun(proc.returncode, out, Path(m[-1]) if m else None, wall, links, family)
        self.runs.append(run)
        return run


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return "'" + v + "'"
    return str(v)


@contextmanager
def flwr_sandbox(tmp: Path, source: Path = REPO) -> Iterator[FlwrSandbox]:
    """An isolated FLWR_HOME + ports + app copy (of ``source``); stops our SuperLink and Ray on exit."""
    flwr_home = tmp / "flwr-home"
    flwr_home.mkdir(parents=True)
    box = FlwrSandbox(make_app_dir(tmp / "app", source), flwr_home, flwr_env(flwr_home, free_port(), free_port()))
    try:
        yield box
    finally:
        survivors = stop_superlinks(flwr_home)
        leftovers = [p for r in box.runs for p in r.family if alive(p)]
        if leftovers:
            stop_pids(leftovers)
        if survivors or [p for p in leftovers if alive(p)]:
            raise RuntimeError(f"processes survived cleanup: {survivors + leftovers}")
