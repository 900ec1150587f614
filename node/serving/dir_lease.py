"""A process's lease on a directory it uses, so that retention never removes it underneath.

Why: a serving process (``node.serving.openai_api --cache-dir``, ``node.serving.serve``) may serve a run's
fine-tuned parameters from ``<root>/run-<id>/node-<id>/kv-cache`` long after the run ended, and
a node of a run in progress may write nothing for a long while; retention
(``federation.run_retention``) must not take either directory away (issue 30).

A lease is a file ``<purpose>-<pid>-<random>.lease`` in the directory, mode 0600, holding
``{"pid", "purpose", "since"}`` and ``flock(LOCK_EX)``'ed by its holder for as long as it uses
the directory. Liveness is the lock, not the pid: the kernel drops it when the holder dies
(``kill -9`` included), so a lease left behind by a dead process is stale and pins nothing,
and a reused pid is never mistaken for the holder. The file is locked before it gets its
``.lease`` name (a temporary name, then ``os.replace``), so a checker never sees a live lease
unlocked. Standard library only: retention and the operator's ``clean`` command import this.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

LEASE_SUFFIX = ".lease"
_PURPOSE = re.compile(r"[a-z][a-z0-9_.]{0,39}")


@dataclass(frozen=True)
class Holder:
    """A live lease found under a directory: its file, the holder's pid and purpose (pid 0 and
    purpose "unreadable" for a held lease this process cannot read: it is kept all the same)."""

    path: Path
    pid: int
    purpose: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.purpose})" if self.pid else f"{self.path} ({self.purpose})"


class Lease:
    """A held lease; ``release`` (or leaving the ``with`` block) removes the file and unlocks.
    A forked child that inherited it releases nothing of its parent's."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd, self._pid = path, fd, os.getpid()

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        if self._fd < 0:
            return
        if os.getpid() == self._pid:
            self.path.unlink(missing_ok=True)  # before the unlock: a checker never sees it unlocked
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take(directory: str | os.PathLike, purpose: str) -> Lease:
    """Hold a new lease on ``directory`` (which must exist) until ``release`` or process exit.
    ``purpose``: a short lowercase word or dotted name (``serving.node.openai_api``, ``node``)."""
    if not _PURPOSE.fullmatch(purpose):
        raise ValueError(f"lease purpose {purpose!r}: lowercase letters, digits, '_' and '.', at most 40")
    directory = Path(directory)
    pid = os.getpid()
    name = f"{purpose}-{pid}-{secrets.token_hex(4)}"
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
        os.write(fd, json.dumps({"pid": pid, "purpose": purpose, "since": time.time()}).encode())
        final = directory / f"{name}{LEASE_SUFFIX}"
        os.replace(tmp, final)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return Lease(final, fd)


def _holder(path: Path) -> Holder | None:
    """The live holder of the lease file ``path``, None when it is stale (or gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:  # another user's, or not a file: cannot tell, so it counts as held
        return Holder(path, 0, "unreadable")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: its process is gone
        except BlockingIOError:
            pass
        try:
            rec = json.loads(os.read(fd, 4096))
            return Holder(path, int(rec["pid"]), str(rec["purpose"])[:40])
        except (OSError, ValueError, TypeError, KeyError):
            return Holder(path, 0, "unreadable")
    finally:
        os.close(fd)


def holders(tree: str | os.PathLike) -> list[Holder]:
    """Live leases anywhere under ``tree`` (symlinks are not followed), by path."""
    found = []
    for top, _dirs, files in os.walk(tree, followlinks=False):
        for name in files:
            if name.endswith(LEASE_SUFFIX):
                holder = _holder(Path(top) / name)
                if holder is not None:
                    found.append(holder)
    return sorted(found, key=lambda h: str(h.path))
