"""Stand-ins for ``flower-superlink`` and ``flwr run`` (fast tests of who runs a run), and helpers
that stop what a test started, by pid.

The stand-in SuperLink is a small HTTP server that takes Flower's ``flower-superlink`` flags,
answers ``/health`` like the real one and, on ``/whoami``, says whose it is (its FLWR_HOME,
working directory, FEDKV_NODE_DIR, pid). The stand-in ``flwr run`` does what Flower 1.42's does
for a local connection: it hands the run to whatever answers on
``127.0.0.1:$FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` (default 39091) and writes, to
``$FAKE_FLWR_LANDED``, whose SuperLink that was.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from federation.deploy.flwr_sandbox import alive, descendants, stop_pids
from tests.hang_guard import HANG_GUARD_S

FAKE_SUPERLINK = """
import argparse, http.server, json, os
p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--log-file")
args, _ = p.parse_known_args()
who = {"flwr_home": os.environ.get("FLWR_HOME", ""), "cwd": os.getcwd(),
       "node_dir": os.environ.get("FEDKV_NODE_DIR", ""), "pid": os.getpid()}

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(who).encode() if self.path == "/whoami" else b"{}"
        self.send_response(200 if self.path in ("/health", "/whoami") else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
"""

FAKE_FLWR = """
import json, os, pathlib, sys, urllib.request
port = os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "39091")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(f"http://127.0.0.1:{port}/whoami", timeout=5) as reply:
        landed = json.loads(reply.read())
except OSError:  # nothing answers: the real flwr run starts its own SuperLink here
    landed = {"flwr_home": os.environ.get("FLWR_HOME", ""), "started_by_flwr": True}
landed["port"] = int(port)
pathlib.Path(os.environ["FAKE_FLWR_LANDED"]).write_text(json.dumps(landed))
results = pathlib.Path(os.environ["FAKE_FLWR_LANDED"]).with_name("results.json")
results.write_text(json.dumps({"status": "completed"}))
print(f"FEDKV_RESULTS {results}")
"""


def executable(path: Path, body: str) -> Path:
    """A Python script at ``path`` that runs with this interpreter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_superlink_exe(tmp: Path) -> Path:
    return executable(tmp / "bin" / "flower-superlink", FAKE_SUPERLINK)


def fake_flwr_exe(tmp: Path) -> Path:
    return executable(tmp / "flwr-bin" / "flwr", FAKE_FLWR)


def port_is_free(port: int) -> bool:
    """A server could listen on it (SO_REUSEADDR, as servers bind: closed connections in
    TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_foreign(exe: Path, flwr_home: Path, port: int, cwd: Path, node_dir: Path) -> subprocess.Popen:
    """Another FLWR_HOME's SuperLink on ``port``, started as ``flwr run`` starts one."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "FEDKV_NODE_DIR": str(node_dir)}
    proc = subprocess.Popen(
        [str(exe), "--insecure", "--simulation", "--host", "127.0.0.1", "--port", str(port),
         "--log-file", str(flwr_home / "local-superlink" / "superlink.log")],
        env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    wait_listening(port, proc)
    return proc


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while port_is_free(port):
        assert proc.poll() is None, f"stand-in exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"nothing listens on {port} after {timeout} s"
        time.sleep(0.05)


def recorded_pid(flwr_home: Path) -> int | None:
    """The pid fedkv recorded for ``flwr_home`` if that process still runs (same start time).
    Read raw, not through the code under test, so the test runs on code without a record."""
    try:
        raw = json.loads((flwr_home / "local-superlink" / "fedkv-superlink.json").read_text())
        pid, started = int(raw["pid"]), int(raw["start_time"])
        now = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return pid if now == started else None


def stop_all(pids: list[int], homes: list[Path]) -> None:
    """Stop, by pid, the given processes, what fedkv recorded for ``homes``, and their descendants."""
    roots = [p for p in [*pids, *(recorded_pid(h) for h in homes)] if p is not None and alive(p)]
    family = [d for p in roots for d in descendants(p)]
    stop_pids(roots, grace_s=5.0)
    stop_pids([p for p in family if alive(p)], grace_s=5.0)
