"""Owner-only directories and files, and file locks with a bounded wait (issue 20).

A node's cache directory and its ``coherence/`` directory hold the encrypted store, its
manifest and the lock files every process of the node takes. They are made ``0700`` and every
file in them ``0600`` whatever the umask; a directory that group or others can reach is refused
(``UnsafePermissionsError``, as ``crypto.at_rest.read_secret_file`` refuses a key others can
read): another local user could read what it holds or take its locks and stall the node. A
lock wait is bounded (``LockTimeoutError``) so a lock held elsewhere -- another process of the
node that hangs, or anything that opened the lock file -- is a clear error, not a hang.

Standard library only; ``cache`` knows nothing of ``crypto``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from cache.errors import CacheError

DIR_MODE = 0o700
FILE_MODE = 0o600
LOCK_TIMEOUT_S = 30.0
"""Default longest wait for a cache or coherence directory's lock."""


class UnsafePermissionsError(CacheError):
    """A cache or coherence directory (or a file in it) that group or others can reach."""


class LockTimeoutError(CacheError, TimeoutError):
    """A directory's lock file stayed locked by another process past the wait's bound."""


def private_dir(path: str | os.PathLike) -> str:
    """Create ``path`` ``0700`` (parents as usual), or check that an existing one is a
    directory that only its owner can reach; returns it as a str."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
            os.chmod(path, DIR_MODE)  # the umask may have taken owner bits too
            return path
        except FileExistsError:  # created meanwhile by another process: check it
            st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    check_mode(path, st.st_mode, DIR_MODE)
    return path


def check_mode(path: str, mode: int, wanted: int) -> None:
    mode &= 0o777
    if mode & 0o077:
        kind = "directory" if wanted == DIR_MODE else "file"
        raise UnsafePermissionsError(
            f"{path} is a cache {kind} that group/other can reach (mode {mode:o}); refusing: "
            f"another local user could read it or hold its locks. Fix it with "
            f"`chmod {wanted:o} {path}` (the cache makes its directories {DIR_MODE:o} and its "
            f"files {FILE_MODE:o})")


def open_private(path: str | os.PathLike, flags: int) -> int:
    """``os.open`` a file of a private directory: created ``0600`` whatever the umask, and an
    existing one narrowed to ``0600`` (files of an older version were ``0644``)."""
    fd = os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_within(path: str | os.PathLike, timeout_s: float, what: str) -> int:
    """An fd holding ``flock(LOCK_EX)`` on ``path`` (created ``0600``), waiting at most
    ``timeout_s`` for another holder; ``LockTimeoutError`` names the file and the wait.

    The kernel drops the lock when its holder dies (kill -9 included): no stale lock files.
    """
    path = os.fspath(path)
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + max(0.0, float(timeout_s))
    pause = 0.0002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            pass
        except BaseException:
            os.close(fd)
            raise
        left = deadline - time.monotonic()
        if left <= 0:
            os.close(fd)
            raise LockTimeoutError(
                f"{path} is locked by another process: waited {timeout_s:g} s for {what}; "
                f"find the holder with `fuser -v {path}` (another process of this node still "
                f"running, or something else that opened the file)")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)
