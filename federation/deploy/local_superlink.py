"""The local SuperLink a fedkv run is handed to: one that this FLWR_HOME started, or none.

``flwr run`` with a local connection (``:local:``, Flower's default) probes
``127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT/health`` (default 39091) and hands the run to
whatever answers; only when nothing answers does it start ``flower-superlink`` (found on PATH)
itself, and it records no pid. On a shared host the answer can come from another user's or
another FLWR_HOME's SuperLink: the run then executes with that process's Python environment,
working directory and FEDKV_NODE_DIR (node keys included), and nothing of it is ours to stop.

``ensure`` therefore starts the SuperLink itself, with Flower's own command line
(``flwr.cli.local_superlink._start_local_superlink``) but on free ports, with this environment's
``flower-superlink`` and this FLWR_HOME's log and database; records it in
``$FLWR_HOME/local-superlink/fedkv-superlink.json`` (pid, start time, uid, ports, executable,
cwd, node root); and ``flwr_env`` gives ``flwr run`` the ports through Flower's two port
variables. A later run reuses it only while the record still names a live process of this user
that listens on the recorded port and was started from the same environment; anything else is
refused with a message naming the problem. ``federation.deploy.stop`` stops the recorded pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from federation import run_retention
from federation.deploy.flwr_sandbox import alive, descendants, free_port, stop_pids
from federation.deploy.port_owner import describe, listeners, process_uid
from federation.deploy.processes import VENV_BIN, start_time

__all__ = ["CONTROL_PORT_ENV", "FLOWER_DEFAULT_HTTP_PORT", "HTTP_PORT_ENV", "Fingerprint", "LinkSettings",
           "LocalSuperLinkError", "Plan", "Record", "default_flwr_home", "ensure", "flwr_env", "forget_record", "load_record",
           "local_address", "own_superlink_pids", "plan", "record_path", "running"]

HTTP_PORT_ENV = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"
CONTROL_PORT_ENV = "FLWR_LOCAL_CONTROL_API_PORT"
FLOWER_DEFAULT_HTTP_PORT = 39091
"""``flwr.cli.constant.LOCAL_SUPERLINK_HTTP_API_PORT`` without the variable."""
LOCAL_ADDRESSES = (":local:", ":local-in-memory:")
RECORD_NAME = "fedkv-superlink.json"
FINGERPRINT_ENV = ("FEDKV_KEEP_RUNS", "FEDKV_MODEL_DIR", "FEDKV_CACHE_DIR",
                   "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION")
"""Variables (besides the node root) that change what a run does; none holds a secret."""
STOP_HINT = "python -m federation.deploy.stop"


class LocalSuperLinkError(Exception):
    """A SuperLink a run will not be handed to, or one that did not start; the text says which and why."""


@dataclass(frozen=True)
class LinkSettings:
    """How fedkv starts a local SuperLink."""

    executable: Path = field(default_factory=lambda: VENV_BIN / "flower-superlink")
    """This environment's ``flower-superlink`` (never the first one on PATH)."""
    host: str = "127.0.0.1"
    """Where it listens (Flower's local SuperLink listens on loopback only)."""
    start_timeout_s: float = 60.0
    """How long it may take to answer ``/health`` (Flower waits 15 s; a loaded host needs more)."""


@dataclass(frozen=True)
class Fingerprint:
    """What decides where a run's files go and which code runs them."""

    executable: str
    cwd: str
    """The ServerApp's working directory: a relative ``results-dir`` lands here."""
    node_root: str
    """Where the nodes keep their keys and caches (``$FEDKV_NODE_DIR``, else ``~/.fedkv/nodes``)."""
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def here(cls, settings: LinkSettings) -> Fingerprint:
        root = Path(os.path.abspath(run_retention.default_node_root().expanduser()))
        return cls(str(settings.executable), os.getcwd(), str(root),
                   {k: os.environ[k] for k in FINGERPRINT_ENV if k in os.environ})

    def differences(self, now: Fingerprint) -> list[str]:
        """``name recorded (now value)`` for each field that differs from ``now``."""
        out = [f"{name} {getattr(self, name)} (now {getattr(now, name)})"
               for name in ("executable", "cwd", "node_root") if getattr(self, name) != getattr(now, name)]
        for key in sorted(set(self.env) | set(now.env)):
            if self.env.get(key) != now.env.get(key):
                out.append(f"{key}={self.env.get(key, '<unset>')} (now {now.env.get(key, '<unset>')})")
        return out


@dataclass(frozen=True)
class Record:
    """The SuperLink fedkv started for one FLWR_HOME: (pid, start time) name the process."""

    pid: int
    start_time: int
    uid: int
    http_port: int
    control_port: int
    fingerprint: Fingerprint


@dataclass(frozen=True)
class Plan:
    """Reuse ``reuse`` (ours, verified), or start a SuperLink on these ports."""

    reuse: Record | None
    http_port: int
    control_port: int


def default_flwr_home() -> Path:
    """``$FLWR_HOME`` if set, else ``~/.flwr`` (where ``flwr`` keeps its config and SuperLink)."""
    env = os.environ.get("FLWR_HOME")
    return Path(env).expanduser() if env else Path.home() / ".flwr"


# -- the record ------------------------------------------------------------------------------------
def record_path(flwr_home: Path) -> Path:
    return Path(flwr_home) / "local-superlink" / RECORD_NAME


def load_record(flwr_home: Path) -> Record | None:
    """The recorded SuperLink, or None (no record, or one that does not parse: it is replaced)."""
    try:
        raw = json.loads(record_path(flwr_home).read_text())
        return Record(**{**raw, "fingerprint": Fingerprint(**raw["fingerprint"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_record(flwr_home: Path, record: Record) -> None:
    path = record_path(flwr_home)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(record), fh, indent=1)
    os.replace(tmp, path)


def forget_record(flwr_home: Path, record: Record) -> None:
    """Remove the record if it still names ``record``'s process."""
    if load_record(flwr_home) == record:
        record_path(flwr_home).unlink(missing_ok=True)


def running(record: Record) -> bool:
    """The recorded process is alive, is the same process (start time) and belongs to this user."""
    return (alive(record.pid) and start_time(record.pid) == record.start_time
            and record.uid == os.getuid() == process_uid(record.pid))


# -- finding SuperLinks by their own command line ----------------------------------------------------
def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _logs_in(argv: list[str], flwr_home: Path) -> bool:
    log = _option(argv, "--log-file")
    return log is not None and Path(log).parent == Path(flwr_home) / "local-superlink"


def own_superlink_pids(flwr_home: Path) -> list[int]:
    """This user's ``flower-superlink`` processes whose ``--log-file`` lies in ``flwr_home``
    (how ``flwr run`` starts one): ``flwr run`` itself records no pid."""
    mine = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and process_uid(int(entry)) == os.getuid():
            argv = _argv(int(entry))
            if any(Path(a).name == "flower-superlink" for a in argv[:4]) and _logs_in(argv, flwr_home):
                mine.append(int(entry))
    return mine


# -- deciding ----------------------------------------------------------------------------------------
def _port_from(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise LocalSuperLinkError(f"{name}={raw!r} is not a TCP port (1-65535)")
    return int(raw)


def _check_reusable(record: Record, flwr_home: Path, now: Fingerprint, wanted: int | None) -> None:
    """Raise unless the running recorded SuperLink is one a run may be handed to."""
    where = f"this FLWR_HOME's SuperLink (pid {record.pid}, 127.0.0.1:{record.http_port}, FLWR_HOME={flwr_home})"
    argv = _argv(record.pid)
    if record.fingerprint.executable not in argv[:2] or _option(argv, "--port") != str(record.http_port) \
            or not _logs_in(argv, flwr_home):
        raise LocalSuperLinkError(f"{where}: its command line is not the one fedkv started; stop it with "
                                  f"{STOP_HINT}")
    holders = listeners(record.http_port)
    if not holders or any(h.pid not in (record.pid, *descendants(record.pid)) for h in holders):
        raise LocalSuperLinkError(f"{where}: 127.0.0.1:{record.http_port} is held by {describe(holders)}, "
                                  f"not by it; stop it with {STOP_HINT}")
    changed = record.fingerprint.differences(now)
    if changed:
        raise LocalSuperLinkError(f"{where} was started from another environment, the run would use its: "
                                  f"{'; '.join(changed)}. Stop it first: {STOP_HINT}")
    if wanted is not None and wanted != record.http_port:
        raise LocalSuperLinkError(f"{where} does not listen on {HTTP_PORT_ENV}={wanted}: unset the variable "
                                  f"or stop it first: {STOP_HINT}")


def plan(flwr_home: Path, now: Fingerprint, env: Mapping[str, str]) -> Plan:
    """Reuse this FLWR_HOME's recorded SuperLink, or pick the ports of a new one; raises
    ``LocalSuperLinkError`` where a run would land in a SuperLink fedkv did not start here."""
    wanted = _port_from(env, HTTP_PORT_ENV)
    record = load_record(flwr_home)
    if record is not None and running(record):
        _check_reusable(record, flwr_home, now, wanted)
        return Plan(record, record.http_port, record.control_port)
    if wanted is not None:
        taken = listeners(wanted)
        if taken:
            raise LocalSuperLinkError(
                f"127.0.0.1:{wanted} ({HTTP_PORT_ENV}) is held by {describe(taken)}, not by a SuperLink "
                f"that fedkv started for FLWR_HOME={flwr_home}: flwr run would run inside it, with its "
                f"environment and directories. Unset {HTTP_PORT_ENV} and {CONTROL_PORT_ENV} (fedkv then "
                "starts its own SuperLink on free ports) or choose a free port")
        return Plan(None, wanted, _port_from(env, CONTROL_PORT_ENV) or _other_free_port(wanted))
    http = free_port()
    return Plan(None, http, _port_from(env, CONTROL_PORT_ENV) or _other_free_port(http))


def _other_free_port(than: int) -> int:
    port = free_port()
    while port == than:
        port = free_port()
    return port


# -- starting ----------------------------------------------------------------------------------------
def _command(settings: LinkSettings, chosen: Plan, runtime: Path, in_memory: bool) -> list[str]:
    """``flwr.cli.local_superlink._start_local_superlink``'s command (flwr 1.42), with our ports."""
    cmd = [str(settings.executable), "--insecure", "--simulation", "--isolation", "subprocess",
           "--control-api-address", f"{settings.host}:{chosen.control_port}", "--host", settings.host,
           "--port", str(chosen.http_port), "--log-file", str(runtime / "superlink.log"),
           "--log-rotation-interval-hours", "24", "--log-rotation-backup-count", "7"]
    return cmd if in_memory else [*cmd, "--database", str(runtime / "state.db")]


def _healthy(host: str, port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with opener.open(f"http://{host}:{port}/health", timeout=2) as reply:
            return 200 <= reply.status < 300
    except (OSError, ValueError):
        return False


def _wait_ready(proc: subprocess.Popen, record: Record, settings: LinkSettings, log: Path) -> None:
    deadline = time.monotonic() + settings.start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalSuperLinkError(f"flower-superlink exited with code {proc.returncode} before it "
                                      f"answered on 127.0.0.1:{record.http_port}; see {log}")
        holders = listeners(record.http_port)
        if any(h.pid not in (proc.pid, *descendants(proc.pid)) for h in holders):
            raise LocalSuperLinkError(f"127.0.0.1:{record.http_port} was taken by {describe(holders)} while "
                                      "fedkv's SuperLink started; run again")
        if holders and _healthy(settings.host, record.http_port):
            return
        time.sleep(0.2)
    raise LocalSuperLinkError(f"flower-superlink did not answer on 127.0.0.1:{record.http_port} within "
                              f"{settings.start_timeout_s:g} s; see {log}")


def _start(flwr_home: Path, chosen: Plan, settings: LinkSettings, now: Fingerprint, in_memory: bool) -> Record:
    runtime = flwr_home / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True, mode=0o700)
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{settings.executable.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(_command(settings, chosen, runtime, in_memory), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    record = Record(proc.pid, start_time(proc.pid) or 0, os.getuid(), chosen.http_port, chosen.control_port, now)
    _write_record(flwr_home, record)  # first: stop finds it even if we are interrupted now
    try:
        _wait_ready(proc, record, settings, runtime / "superlink.log")
    except BaseException:
        stop_pids([proc.pid, *descendants(proc.pid)], grace_s=5.0)
        proc.poll()
        forget_record(flwr_home, record)
        raise
    return record


def ensure(flwr_home: Path, in_memory: bool = False, settings: LinkSettings | None = None) -> tuple[Record, bool]:
    """This FLWR_HOME's verified SuperLink, started if needed: (its record, whether we started it now)."""
    settings = settings or LinkSettings()
    flwr_home = Path(os.path.abspath(Path(flwr_home).expanduser()))
    now = Fingerprint.here(settings)
    chosen = plan(flwr_home, now, os.environ)
    if chosen.reuse is not None:
        return chosen.reuse, False
    return _start(flwr_home, chosen, settings, now, in_memory), True


def flwr_env(record: Record) -> dict[str, str]:
    """The variables that make ``flwr run`` (and ``flwr ls``/``log``/``stop``) talk to ``record``'s SuperLink."""
    return {HTTP_PORT_ENV: str(record.http_port), CONTROL_PORT_ENV: str(record.control_port)}


def local_address(connection: str | None) -> str | None:
    """The address of the SuperLink connection ``flwr run`` would use (``None``: the default one)
    when it is a local simulation (``:local:``, ``:local-in-memory:``), else None (an explicit
    address is the user's SuperLink; an unreadable config is left for flwr to report)."""
    from flwr.cli.flower_config import read_superlink_connection  # reads $FLWR_HOME/config.toml as flwr does

    try:
        conn = read_superlink_connection(connection)
    except Exception:  # click.ClickException and the like: flwr run says it better
        return None
    address = conn.address if conn.address is not None or conn.options is None else LOCAL_ADDRESSES[0]
    return address if address in LOCAL_ADDRESSES else None
