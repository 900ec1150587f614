"""The demo's processes: each started in its own session, tracked with its descendants by
(pid, start time), stopped by pid; a SIGINT/SIGTERM turns into an exception so cleanup runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from federation.deploy.flwr_sandbox import alive, descendants

__all__ = ["Tracker", "VENV_BIN", "interrupt", "net_ns", "say", "send_signal", "start_time"]

VENV_BIN = Path(sys.executable).parent


def say(msg: str) -> None:
    print(f"[deploy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None if gone): with the pid, it
    names one process (a pid alone can be recycled)."""
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
        st = start_time(pid)
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
        return alive(pid) and start_time(pid) == self.seen.get(pid)

    def family(self, name: str) -> list[int]:
        root = self.roots[name].pid
        self.scan()
        return [p for p in [root, *descendants(root)] if self._is_ours(p)]

    def kill(self, name: str) -> list[int]:
        """SIGKILL a process and its descendants at once (a crashed machine: no goodbye)."""
        pids = self.family(name)
        for pid in pids:
            send_signal(pid, signal.SIGKILL)
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
            send_signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self._is_ours(p) for p in pids):
            time.sleep(0.2)
        stubborn = [p for p in pids if self._is_ours(p)]
        for pid in stubborn:
            send_signal(pid, signal.SIGKILL)
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


def net_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def send_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def interrupt(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM -> an exception in the main thread, so the cleanup in ``finally`` runs
    (installed explicitly: a shell may start us with SIGINT ignored)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)
