"""Who listens on a local TCP port: the socket's owner (uid, from ``/proc/net/tcp*``) and, when
the socket belongs to one of this user's processes, that process's pid (from its ``/proc/<pid>/fd``).

Why: a health probe only says that *something* answers on a port; before a run is handed to
"the local SuperLink" we must know that the one answering is the process we started
(``federation.deploy.local_superlink``). Linux only, like the rest of ``federation.deploy``.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Listener", "describe", "listeners", "process_uid"]

_LISTEN = "0A"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket on a local port."""

    port: int
    uid: int
    inode: int
    pid: int | None
    """The process holding it; None when it is not one this user may inspect (another user's)."""


def _table_rows(port: int) -> list[tuple[int, int]]:
    """(uid, inode) of every LISTEN socket bound to ``port`` (any local address)."""
    rows = []
    for table in _TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != _LISTEN:
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                rows.append((int(cols[7]), int(cols[9])))
    return rows


def _pid_of_socket(inode: int) -> int | None:
    target = f"socket:[{inode}]"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") == target:
                    return int(entry)
            except OSError:
                continue
    return None


def listeners(port: int) -> list[Listener]:
    """Every socket listening on ``port``, with its owner uid and (if ours to see) its pid."""
    return [Listener(port, uid, inode, _pid_of_socket(inode)) for uid, inode in _table_rows(port)]


def process_uid(pid: int) -> int | None:
    """The real uid of a running process (None if it is gone)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def describe(found: list[Listener]) -> str:
    """``pid 123 of user alice`` / ``a process of user bob`` for a message (no secrets: ids only)."""
    parts = []
    for one in found:
        who = f"user {_user(one.uid)}" + (" (you)" if one.uid == os.getuid() else "")
        parts.append(f"pid {one.pid} of {who}" if one.pid is not None else f"a process of {who}")
    return ", ".join(dict.fromkeys(parts)) or "nothing"
