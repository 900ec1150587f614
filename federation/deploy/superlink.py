"""The SuperLink (TLS + SuperNode auth), the registered SuperNodes, and the two SuperNodes that
must be refused (an unregistered key, a foreign root certificate)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from federation.deploy.demo import CONNECTION, Demo, exited, listening, tail, wait_for
from federation.deploy.processes import VENV_BIN, net_ns, say
from federation.deploy.flwr_sandbox import free_port
from federation.deploy.provisioning import make_auth_key, make_tls

__all__ = ["REFUSAL_MARKERS", "online_nodes", "refusal_results", "register_nodes", "start_refusal_probes",
           "start_superlink", "start_supernodes", "supernode_cmd"]


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
    wait_for(lambda: listening(demo.link_host, demo.port) and "Uvicorn running on https://" in tail(log, 100_000),
              60, "the SuperLink to listen", abort=exited(proc, log))
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


def supernode_cmd(demo: Demo, i: int) -> list[str]:
    """The command line of SuperNode ``i`` (partition i, its kit); the same one restarts it."""
    kit = demo.kits[f"node-{i}"]
    cfg = f"partition-id={i} num-partitions={demo.nodes} kit-dir='{kit}'"
    if demo.serve is not None and i == 0:
        cfg += f" cache-dir='{demo.serve.cache_dir}'"
    return _supernode_cmd(demo, i, kit / "ca.crt", kit / "supernode-auth.key", cfg)


def start_supernodes(demo: Demo) -> None:
    for i in range(demo.nodes):
        demo.procs.start(f"supernode-{i}", supernode_cmd(demo, i), demo.logs / f"supernode-{i}.log",
                         {**demo.env, **demo.node_env})
    def ids_in_logs() -> set[int]:
        found = set()
        for i in range(demo.nodes):
            m = re.search(r"SuperNode ID: (\d+)", tail(demo.logs / f"supernode-{i}.log", 100_000))
            if m:
                found.add(int(m.group(1)))
        return found

    wait_for(lambda: set(demo.node_ids) <= ids_in_logs(), 90, f"{demo.nodes} SuperNodes to connect")
    online = online_nodes(demo, "online")
    if not set(demo.node_ids) <= online:
        raise RuntimeError(f"SuperLink lists {len(online)} online node(s), expected {demo.nodes}")
    pids = [demo.procs.roots[f"supernode-{i}"].pid for i in range(demo.nodes)]
    demo.isolated_nodes = sum(net_ns(p) not in (None, net_ns(os.getpid())) for p in pids)
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
        log = tail(demo.logs / f"probe-{kind}.log", 100_000)
        result[kind] = rc not in (None, 0) and all(m in log for m in REFUSAL_MARKERS[kind])
        say(f"{kind} SuperNode: exit {rc}, refused={result[kind]}")
    return result
