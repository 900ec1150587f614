"""A real multi-process Flower deployment on this machine: TLS, SuperNode auth, a crash.

``python -m federation.deploy demo --nodes 5 --rounds 3 --kill-one`` provisions startup kits
(``federation.kit``), starts one ``flower-superlink`` (TLS + ``--enable-supernode-auth``) on a
free loopback port with a private FLWR_HOME and database, registers every node's auth key,
shows that an unregistered key and a wrong root certificate are refused, starts N
``flower-supernode`` processes, runs the app with ``flwr run --stream`` and, with
``--kill-one``, SIGKILLs the highest partition's SuperNode (its whole process family) once it
has received its train message of round R-1 of R (``kill_round``: the round before the last,
so the key rotation that follows is seen; round 1 with ``--rounds`` 1 or 2). The run must
finish with the survivors.

Kits, logs (``logs/``) and results (``results/``) go to ``--workdir DIR``, kept; without it to
a temporary directory that is removed at the end unless ``--keep``. The last progress line
says which (``workdir_note``).

Every process is started in its own session and tracked by (pid, start time), with its
descendants; all are stopped by pid on success, failure, SIGINT and SIGTERM. The last stdout
line is one JSON object (see ``summary``); progress goes to stderr.

``--serve`` (with ``--task lm``) starts ``python -m node.serve`` beside SuperNode 0, on that
node's cache directory: each write-back of the node invalidates it, and the summary's
``serve_agent`` shows the model versions its replies were computed under. Its client
authenticates with the bearer token the agent writes on first start (``serve-token`` beside
that cache directory).

``--netns`` puts each SuperNode in a network namespace of its own (``fedkv-<tag>-<i>``), joined
by a veth pair to a bridge the command creates on the host (10.250.<k>.0/24, the first free
<k>); the SuperLink binds the bridge's address 10.250.<k>.1 only. Namespaces, veths and the
bridge are removed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from crypto import PASSPHRASE_ENV
from federation.flwr_sandbox import REPO, alive, descendants, free_port, make_app_dir
from federation.kit import make_auth_key, make_tls, write_kits
from federation.serve_probe import ServeProbe

CONNECTION = "fedkv-demo"
VENV_BIN = Path(sys.executable).parent


def say(msg: str) -> None:
    print(f"[deploy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- processes -----------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Tracker:
    """Every process we start plus each descendant ever seen, keyed by (pid, start time).

    A background thread keeps adding descendants (ClientApp/ServerApp processes come and go),
    so a process orphaned by a crashed parent is still ours to stop. The start time guards
    against a recycled pid."""

    def __init__(self) -> None:
        self.roots: dict[str, subprocess.Popen] = {}
        self.seen: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._scan_loop, daemon=True)
        self._thread.start()

    def start(self, name: str, cmd: Sequence[str], log: Path, env: dict[str, str], cwd: Path | None = None,
              pipe: bool = False) -> subprocess.Popen:
        out = subprocess.PIPE if pipe else open(log, "wb")
        proc = subprocess.Popen(
            list(cmd), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if not pipe:
            out.close()
        with self._lock:
            if name in self.roots:
                raise ValueError(f"a process named {name!r} was started already")
            self.roots[name] = proc
            self._remember(proc.pid)
        return proc

    def run(self, name: str, cmd: Sequence[str], log: Path, env: dict[str, str], timeout: float) -> int:
        """Start, wait (at most ``timeout``), stop if still running; returns the exit code."""
        proc = self.start(name, cmd, log, env)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(name)
            return proc.wait()

    def _remember(self, pid: int) -> None:
        st = _start_time(pid)
        if st is not None:
            self.seen.setdefault(pid, st)

    def scan(self) -> None:
        """Remember every descendant of a live process of ours (one pass over /proc)."""
        children = _children_map()
        with self._lock:
            todo = [p for p in self.seen if self._is_ours(p)]
            while todo:
                for child in children.get(todo.pop(), ()):
                    if child not in self.seen:
                        self._remember(child)
                        todo.append(child)

    def _scan_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.scan()

    def _is_ours(self, pid: int) -> bool:
        return alive(pid) and _start_time(pid) == self.seen.get(pid)

    def family(self, name: str) -> list[int]:
        root = self.roots[name].pid
        self.scan()
        return [p for p in [root, *descendants(root)] if self._is_ours(p)]

    def kill(self, name: str) -> list[int]:
        """SIGKILL a process and its descendants at once (a crashed machine: no goodbye)."""
        pids = self.family(name)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        self.roots[name].wait()
        return pids

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        """SIGTERM the process (then its remaining family), SIGKILL what ignores it."""
        pids = self.family(name) if name in self.roots else []
        self._terminate(pids[:1], grace_s)
        self._terminate([p for p in pids[1:] if self._is_ours(p)], grace_s)
        self.roots[name].poll()

    def _terminate(self, pids: list[int], grace_s: float) -> None:
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self._is_ours(p) for p in pids):
            time.sleep(0.2)
        stubborn = [p for p in pids if self._is_ours(p)]
        for pid in stubborn:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # SIGKILL is not instant (a process in D state)
        while time.monotonic() < deadline and any(self._is_ours(p) for p in stubborn):
            time.sleep(0.1)

    def stop_all(self, grace_s: float = 10.0) -> int:
        """SIGTERM every started process at once, then what is left of their families;
        SIGKILL whatever outlives the grace period. Returns how many are still alive."""
        self.scan()
        roots = [p.pid for p in reversed(list(self.roots.values())) if self._is_ours(p.pid)]
        self._terminate(roots, grace_s)
        self.scan()
        self._stop.set()
        self._thread.join(timeout=5)
        rest = [p for p in self.seen if self._is_ours(p)]
        if rest:
            say(f"stopping {len(rest)} orphaned descendant(s): {rest}")
        self._terminate(rest, grace_s / 2)
        for proc in self.roots.values():
            proc.poll()  # reap
        return sum(1 for p in self.seen if self._is_ours(p))

    def started_pids(self) -> list[tuple[int, int]]:
        return list(self.seen.items())


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def _net_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM -> an exception in the main thread, so the cleanup in ``finally`` runs
    (installed explicitly: a shell may start us with SIGINT ignored)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


# --- network namespaces (optional) -------------------------------------------------------------


@dataclass
class Netns:
    """One namespace per SuperNode, all joined to a host bridge we create (10.250.<k>.0/24).

    The bridge holds 10.250.<k>.1 (the SuperLink binds exactly that address, not 0.0.0.0);
    node i's namespace holds 10.250.<k>.<10+i> on its end of a veth pair whose host end is a
    bridge port. <k> is the first 10.250.x subnet no interface of this host uses yet."""

    tag: str
    subnet: int = 0
    created: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"fk{self.tag}br"

    @property
    def link_ip(self) -> str:
        return f"10.250.{self.subnet}.1"

    def name(self, i: int) -> str:
        return f"fedkv-{self.tag}-{i}"

    def setup(self, nodes: int) -> None:
        used = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
        self.subnet = next(k for k in range(1, 255) if f"10.250.{k}." not in used)
        _ip("link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        _ip("addr", "add", f"{self.link_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(nodes):
            self._add(i)

    def _add(self, i: int) -> None:
        ns, host_if, ns_if = self.name(i), f"fk{self.tag}h{i}", f"fk{self.tag}n{i}"
        _ip("netns", "add", ns)
        self.created.append(ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        self.links.append(host_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"10.250.{self.subnet}.{10 + i}/24", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name(i), *cmd]

    def remove(self) -> None:
        """Delete what we created (veths go with their namespace or host end)."""
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.links.clear()
        self.created.clear()

    def leftovers(self) -> list[str]:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        return [n for n in names.split() if n.startswith(f"fedkv-{self.tag}-")] + \
            [w for w in links.split() if w.startswith(f"fk{self.tag}")]


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")


# --- the demo ------------------------------------------------------------------------------------


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
    """--serve: a ``node.serve`` agent beside SuperNode 0, on its cache directory."""

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


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.5,
              abort: Callable[[], str | None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if abort is not None and (why := abort()):
            raise RuntimeError(f"{what}: {why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _exited(proc: subprocess.Popen, log: Path) -> Callable[[], str | None]:
    def check() -> str | None:
        if proc.poll() is None:
            return None
        return f"exited with {proc.returncode}; log tail: {_tail(log)}"
    return check


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_superlink(demo: Demo) -> None:
    k = demo.kits["server"]
    cmd = [
        str(VENV_BIN / "flower-superlink"), "--ssl-certfile", str(k / "server.crt"),
        "--ssl-keyfile", str(k / "server.key"), "--ssl-ca-certfile", str(k / "ca.crt"),
        "--enable-supernode-auth", "--disable-runtime-dependency-installation",
        "--database", str(demo.work / "superlink.db"), "--host", demo.link_host, "--port", str(demo.port),
    ]
    log = demo.logs / "superlink.log"
    proc = demo.procs.start("superlink", cmd, log, demo.env, cwd=demo.work)
    _wait_for(lambda: _listening(demo.link_host, demo.port) and "Uvicorn running on https://" in _tail(log, 100_000),
              60, "the SuperLink to listen", abort=_exited(proc, log))
    say(f"SuperLink pid {proc.pid} on https://{demo.link_host}:{demo.port} (TLS, SuperNode auth)")


_calls = itertools.count(1)


def _flwr(demo: Demo, name: str, *args: str, timeout: float = 60) -> str:
    name = f"{name}-{next(_calls)}"
    log = demo.logs / "cli" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    rc = demo.procs.run(name, [str(VENV_BIN / "flwr"), *args], log, demo.env, timeout)
    out = log.read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"flwr {' '.join(args)} exited with {rc}: {out[-1500:]}")
    return out


def register_nodes(demo: Demo) -> None:
    """``flwr supernode register <kit>/supernode-auth.pub fedkv-demo`` for every node (in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    def register(i: int) -> tuple[int, int]:
        pub = demo.kits[f"node-{i}"] / "supernode-auth.pub"
        out = _flwr(demo, f"register-{i}", "supernode", "register", str(pub), CONNECTION, "--format", "json")
        return int(json.loads(out[out.index("{"):])["node-id"]), i

    with ThreadPoolExecutor(max_workers=min(4, demo.nodes)) as pool:
        demo.node_ids.update(pool.map(register, range(demo.nodes)))
    say(f"registered {demo.nodes} SuperNode auth keys")


def online_nodes(demo: Demo, tag: str) -> set[int]:
    out = _flwr(demo, f"list-{tag}", "supernode", "list", CONNECTION, "--format", "json")
    data = json.loads(out[out.index("{"):])
    return {int(n["node-id"]) for n in data.get("nodes", []) if n.get("status") == "online"}


def _supernode_cmd(demo: Demo, i: int | None, root_ca: Path, auth_key: Path, node_config: str,
                   extra: Sequence[str] = ()) -> list[str]:
    cmd = [
        str(VENV_BIN / "flower-supernode"), "--root-certificates", str(root_ca),
        "--superlink", demo.superlink_address(), "--auth-supernode-private-key", str(auth_key),
        "--port", str(free_port()), *extra,
    ]
    if node_config:
        cmd += ["--node-config", node_config]
    return demo.netns.wrap(i, cmd) if (demo.netns and i is not None) else cmd


def start_supernodes(demo: Demo) -> None:
    for i in range(demo.nodes):
        kit = demo.kits[f"node-{i}"]
        cfg = f"partition-id={i} num-partitions={demo.nodes} kit-dir='{kit}'"
        if demo.serve is not None and i == 0:
            cfg += f" cache-dir='{demo.serve.cache_dir}'"
        cmd = _supernode_cmd(demo, i, kit / "ca.crt", kit / "supernode-auth.key", cfg)
        demo.procs.start(f"supernode-{i}", cmd, demo.logs / f"supernode-{i}.log", {**demo.env, **demo.node_env})
    def ids_in_logs() -> set[int]:
        found = set()
        for i in range(demo.nodes):
            m = re.search(r"SuperNode ID: (\d+)", _tail(demo.logs / f"supernode-{i}.log", 100_000))
            if m:
                found.add(int(m.group(1)))
        return found

    _wait_for(lambda: set(demo.node_ids) <= ids_in_logs(), 90, f"{demo.nodes} SuperNodes to connect")
    online = online_nodes(demo, "online")
    if not set(demo.node_ids) <= online:
        raise RuntimeError(f"SuperLink lists {len(online)} online node(s), expected {demo.nodes}")
    pids = [demo.procs.roots[f"supernode-{i}"].pid for i in range(demo.nodes)]
    demo.isolated_nodes = sum(_net_ns(p) not in (None, _net_ns(os.getpid())) for p in pids)
    say(f"{demo.nodes} SuperNodes online (pids {pids}; {demo.isolated_nodes} in their own network namespace)")


REFUSAL_MARKERS = {
    "unregistered": ("Failed to activate SuperNode", "Exit Code: 305"),
    "bad-cert": ("CERTIFICATE_VERIFY_FAILED", "Exit Code: 305"),
}


def start_refusal_probes(demo: Demo) -> dict[str, subprocess.Popen]:
    """Start an unregistered SuperNode and one with a foreign root CA; both must be turned away.

    Refused = the process exits by itself within 60 s, non-zero, and its log names the cause
    (the SuperLink's activation refusal / a TLS verification failure) with Flower's exit code
    305 (connection refused). The bad-cert node uses a registered key, so only TLS stops it."""
    rogue_key, other_ca = demo.work / "rogue" / "supernode-auth.key", demo.work / "rogue" / "other-ca.crt"
    rogue_key.parent.mkdir(exist_ok=True, mode=0o700)
    priv, _ = make_auth_key()  # a fresh key nobody registered
    fd = os.open(rogue_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(priv)
    other_ca.write_bytes(make_tls(["localhost"], "unrelated CA")[0])
    node0 = demo.kits["node-0"]
    retry = ["--max-retries", "2", "--max-wait-time", "20"]
    cmds = {
        "unregistered": _supernode_cmd(demo, None, node0 / "ca.crt", rogue_key, "", retry),
        "bad-cert": _supernode_cmd(demo, None, other_ca, node0 / "supernode-auth.key", "", retry),
    }
    return {k: demo.procs.start(f"probe-{k}", c, demo.logs / f"probe-{k}.log", demo.env) for k, c in cmds.items()}


def refusal_results(demo: Demo, procs: dict[str, subprocess.Popen]) -> dict[str, bool]:
    result = {}
    for kind, proc in procs.items():
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.procs.stop(f"probe-{kind}")
            rc = None
        log = _tail(demo.logs / f"probe-{kind}.log", 100_000)
        result[kind] = rc not in (None, 0) and all(m in log for m in REFUSAL_MARKERS[kind])
        say(f"{kind} SuperNode: exit {rc}, refused={result[kind]}")
    return result


def _app_dir(dest: Path, ref: str | None) -> Path:
    """The app folder ``flwr run`` builds: the working tree, or ``git archive <ref>``."""
    if ref is None:
        return make_app_dir(dest)
    from federation.flwr_sandbox import PACKAGES, REPO

    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref, "pyproject.toml", *PACKAGES],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_config(demo: Demo, app: Path) -> str:
    values: dict[str, object] = {
        "num-server-rounds": demo.rounds, "task": demo.task, "results-dir": str(demo.work / "results"),
        "round-timeout": float(demo.round_timeout), "min-clients": 2,
    }
    if _accepts(app, "server-kit"):
        values["server-kit"] = str(demo.kits["server"])
    text = " ".join(f"{k}={_toml(v)}" for k, v in values.items())
    return f"{text} {demo.extra_run_config}".strip()


def _accepts(app: Path, key: str) -> bool:
    """Pass a new key only when both the RunConfig and the app's pyproject know it
    (flwr rejects run-config keys its pyproject lacks)."""
    from federation.config import RunConfig

    in_config = key.replace("-", "_") in {f.name for f in fields(RunConfig)}
    app_config = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"].get("config", {})
    return in_config and key in app_config


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"'{v}'" if isinstance(v, str) else str(v)


def _pump(proc: subprocess.Popen, lines: list[str], log: Path) -> None:
    with open(log, "a", errors="replace") as fh:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            lines.append(line)
            fh.write(line)
            fh.flush()


def _victim_got_train(demo: Demo, victim: int, nth: int) -> bool:
    return _tail(demo.logs / f"supernode-{victim}.log", 10_000_000).count("Receiving: train.fedkv") >= nth


def kill_round(rounds: int) -> int:
    """The round ``--kill-one`` kills a node in: the one before the last, so the key rotation
    that follows the departure is seen in the last round (round 1 of 1 or 2, R-1 of R)."""
    return max(1, rounds - 1)


def kill_plan(nodes: int, rounds: int) -> str:
    """What ``--kill-one`` will do, in words (said before the run starts)."""
    return (f"--kill-one: SuperNode partition {nodes - 1} is SIGKILLed mid round "
            f"{kill_round(rounds)} of {rounds}, once it received that round's train message")


def workdir_note(work: Path, removed: bool) -> str:
    """Where kits, logs and results are after the demo (or that they were removed, and how
    to keep them)."""
    if removed:
        return (f"kits, logs and results were in {work}, a temporary directory now removed "
                f"(--keep keeps it; --workdir DIR writes them to DIR and keeps them)")
    return f"kits, logs and results are kept in {work} (kits/, logs/, results/)"


def run_app(demo: Demo, timeout: float) -> RunOutcome:
    """``flwr run <app> fedkv-demo --stream``; with kill_one, SIGKILL the victim mid round
    ``kill_round(rounds)``."""
    app = _app_dir(demo.work / "app", demo.app_ref)
    cmd = [str(VENV_BIN / "flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", run_config(demo, app)]
    say(f"flwr run ... --run-config \"{cmd[-1]}\"")
    proc = demo.procs.start("flwr-run", cmd, demo.logs / "flwr-run.log", demo.env, cwd=app, pipe=True)
    lines: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc, lines, demo.logs / "flwr-run.log"), daemon=True)
    reader.start()
    victim, at_round = demo.nodes - 1, kill_round(demo.rounds)
    if demo.kill_one:
        say(kill_plan(demo.nodes, demo.rounds))
    killed, deadline = None, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if demo.kill_one and killed is None and _round_done(lines, at_round - 1) \
                and _victim_got_train(demo, victim, at_round):
            pids = demo.procs.kill(f"supernode-{victim}")
            killed = demo.killed = victim
            say(f"SIGKILLed SuperNode partition {victim} (pids {pids}) after it received its round-{at_round} train message")
        time.sleep(0.3)
    if proc.poll() is None:
        say(f"flwr run still running after {timeout:.0f}s; stopping it")
        demo.procs.stop("flwr-run")
    reader.join(timeout=10)
    return RunOutcome(proc.returncode, lines, killed, _results(lines))


def _round_done(lines: list[str], rnd: int) -> bool:
    return rnd <= 0 or any(re.search(rf"fedkv round {rnd}/\d+", line) for line in list(lines))


def _results(lines: list[str]) -> dict | None:
    found = re.findall(r"FEDKV_RESULTS (\S+)", "".join(lines))
    if not found:
        return None
    try:
        return json.loads(Path(found[-1]).read_text())
    except (OSError, ValueError):
        return None


def summary(demo: Demo, leftovers: int, wall_s: float) -> dict[str, object]:
    outcome, refused = demo.outcome, demo.refused
    res = (outcome.results if outcome else None) or {}
    link_log = _tail(demo.logs / "superlink.log", 10_000_000)
    return {
        "tls": "Uvicorn running on https://" in link_log,
        "node_auth": bool(demo.node_ids) and refused.get("unregistered", False),
        "rounds_completed": len(res.get("rounds", [])),
        "status": res.get("status"),
        "killed_node": demo.killed,
        "key_rotations": res.get("key_rotations", 0),
        "refused_unregistered": refused.get("unregistered", False),
        "refused_bad_cert": refused.get("bad-cert", False),
        "server_key_origin": res.get("key_origin"),
        "kv_blocks_on_disk_per_round": [r.get("kv_blocks_on_disk", 0) for r in res.get("rounds", [])],
        "serving_per_round": [r.get("serving", {}) for r in res.get("rounds", [])],
        "serve_agent": demo.serve.report() if demo.serve is not None else None,
        "leftover_processes": leftovers,
        "wall_s": round(wall_s, 1),
        "nodes": demo.nodes,
        "netns": demo.netns is not None,
        "nodes_in_own_netns": demo.isolated_nodes,
        "sealed_kits": demo.seal_kits,
        "workdir": str(demo.work),
    }


def demo_main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    own_work = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="fedkv-demo-")) if own_work else Path(args.workdir).resolve()
    demo = Demo(work, args.nodes, args.rounds, args.task, args.round_timeout, args.kill_one, args.run_config)
    demo.app_ref, demo.seal_kits = args.app_ref, args.seal_kits
    if args.serve:
        demo.serve = ServeProbe(work, work / "serve-node-0" / "kv-cache")
    if args.netns:
        demo.netns = Netns(f"{os.getpid() % 10000}")
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    error: BaseException | None = None
    try:
        _demo_steps(demo, args)
    except (Exception, KeyboardInterrupt, SystemExit) as exc:
        error = exc
        say(f"demo failed: {type(exc).__name__}: {exc}")
    finally:
        leftovers = _cleanup(demo, previous)
    remove_work = own_work and not args.keep
    out = _report(demo, error, leftovers, time.monotonic() - t0, remove_work=remove_work)
    say(workdir_note(work, removed=remove_work))
    print(json.dumps(out), flush=True)
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return 130
    return 0 if error is None and out["rounds_completed"] == args.rounds else 1


def _cleanup(demo: Demo, handlers: dict[int, object]) -> int:
    """Stop every process by pid, remove namespaces; returns how many processes survived."""
    for sig in handlers:  # a second Ctrl-C must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    try:
        say("stopping every process started, by pid")
        leftovers = demo.procs.stop_all()
        if demo.netns:
            demo.netns.remove()
            if demo.netns.leftovers():
                say(f"could not remove {demo.netns.leftovers()}")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return leftovers


def _report(demo: Demo, error: BaseException | None, leftovers: int, wall_s: float, remove_work: bool) -> dict:
    out = summary(demo, leftovers, wall_s)
    out["started_processes"] = len(demo.procs.seen)
    if demo.work.is_dir():  # for whoever checks afterwards that none of them is still alive
        (demo.work / "pids.json").write_text(json.dumps(demo.procs.started_pids()))
    if error is not None:
        out["error"] = f"{type(error).__name__}: {error}"
    if remove_work:
        shutil.rmtree(demo.work, ignore_errors=True)
        out["workdir"] = None
    return out


def _demo_steps(demo: Demo, args: argparse.Namespace) -> None:
    if args.nodes < 2 + int(args.kill_one):
        raise ValueError("need at least 2 surviving nodes (min-clients=2)")
    if args.serve and args.task != "lm":
        raise ValueError("--serve needs --task lm (the digits model does not generate text)")
    prepare(demo)
    start_superlink(demo)
    register_nodes(demo)
    probes = start_refusal_probes(demo)
    start_supernodes(demo)
    demo.refused = refusal_results(demo, probes)
    if demo.serve is not None:
        demo.serve.start(demo.procs, {**demo.env, **demo.node_env}, demo.logs / "serve-node-0.log", REPO)
    try:
        demo.outcome = run_app(demo, args.run_timeout)
    finally:
        if demo.serve is not None:
            demo.serve.stop()
    say(f"flwr run exited with {demo.outcome.returncode}; results status: "
        f"{(demo.outcome.results or {}).get('status')}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m federation.deploy", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="provision, start SuperLink + SuperNodes with TLS and auth, run, clean up")
    d.add_argument("--nodes", type=int, default=5)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--kill-one", action="store_true",
                   help="SIGKILL the highest partition's SuperNode mid round R-1 of R (the round before "
                        "the last, so the key rotation after it is seen; round 1 with --rounds 1 or 2)")
    d.add_argument("--netns", action="store_true", help="each SuperNode in its own network namespace (root)")
    d.add_argument("--workdir", default=None,
                   help="keep kits, logs and results here (default: a temp dir, removed unless --keep)")
    d.add_argument("--seal-kits", action="store_true",
                   help="seal node secrets with a random passphrase given to the SuperNodes only "
                        "(FEDKV_NODE_KEY_PASSPHRASE in their environment)")
    d.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    d.add_argument("--task", default="digits")
    d.add_argument("--round-timeout", type=float, default=60.0,
                   help="seconds the server waits per phase; a killed node is reported unavailable by the "
                        "SuperLink <= 60 s after its last heartbeat anyway, so a longer timeout costs little")
    d.add_argument("--run-timeout", type=float, default=420.0, help="stop flwr run after this many seconds")
    d.add_argument("--app-ref", default=None, help="run the app as committed at this git ref (default: working tree)")
    d.add_argument("--run-config", default="", help="extra run-config overrides, e.g. \"local-epochs=1\"")
    d.add_argument("--serve", action="store_true",
                   help="run a serving agent (python -m node.serve) beside SuperNode 0 on its cache "
                        "directory and ask it a chat turn every 0.5 s (--task lm)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
