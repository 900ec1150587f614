"""The store's directory: its file names, the writes that must survive a power cut (a full
``write``, a directory ``fsync``), its lock (one store at a time), wiping it, and on open
bringing the files in line with the manifest (orphan segments deleted, uncommitted tails
truncated, a half-written manifest dropped, owner-only modes)."""

from __future__ import annotations

import errno
import os
import re

from cache.fsperm import LockTimeoutError, lock_within, private_dir
from cache.segments.errors import StoreLockedError

__all__ = ["LOCK_FILE", "MANIFEST", "MANIFEST_TMP", "SEG_RE", "fsync_dir", "reconcile", "scan", "seg_name",
           "take_lock", "unlink_quiet", "wipe", "write_all"]

MANIFEST = "manifest.json"
MANIFEST_TMP = "manifest.json.tmp"
LOCK_FILE = "LOCK"
SEG_RE = re.compile(r"^seg-(\d{6,})\.bin$")


def seg_name(seg: int) -> str:
    return f"seg-{seg:06d}.bin"


def write_all(fd: int, data) -> None:
    """``os.write`` until everything is written (short writes happen near a full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - os.write raises instead on Linux
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def fsync_dir(directory: str) -> None:
    """fsync a directory so renames, creations and unlinks in it survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def take_lock(directory: str, timeout_s: float) -> int:
    """flock the directory's LOCK file (0600): two stores appending to one directory would
    corrupt it. Waits at most ``timeout_s`` for another holder (a process of the node that
    is still finishing), then ``StoreLockedError``.

    The kernel drops the lock when the holder dies (kill -9 included), so no stale lock files.
    """
    try:
        return lock_within(os.path.join(directory, LOCK_FILE), timeout_s, "the cache store")
    except LockTimeoutError as e:
        raise StoreLockedError(f"{directory} is in use by another SegmentStore: {e}") from None


def wipe(directory: str | os.PathLike, lock_timeout_s: float) -> None:
    """``SegmentStore.wipe``: delete the segments and manifest, under the lock."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return
    private_dir(directory)
    lock_fd = take_lock(directory, lock_timeout_s)
    try:
        for name in os.listdir(directory):
            if SEG_RE.match(name) or name in (MANIFEST, MANIFEST_TMP):
                os.unlink(os.path.join(directory, name))
        fsync_dir(directory)
    finally:
        os.close(lock_fd)


def scan(directory: str) -> tuple[set[int], bool]:
    """The segment numbers present and whether a manifest is; on the way, the store's files
    made owner-only and a leftover ``manifest.json.tmp`` deleted."""
    names = os.listdir(directory)
    seg_files = {int(m.group(1)) for n in names if (m := SEG_RE.match(n))}
    for n in names:  # files of an older version were 0644: owner-only from here on
        if SEG_RE.match(n) or n == MANIFEST:
            p = os.path.join(directory, n)
            if os.stat(p).st_mode & 0o077:
                os.chmod(p, 0o600)
    if MANIFEST_TMP in names:  # a commit killed before its rename: never the truth
        os.unlink(os.path.join(directory, MANIFEST_TMP))
    return seg_files, MANIFEST in names


def reconcile(directory: str, seg_files: set[int], committed: dict[int, int]) -> dict[int, int]:
    """Reconcile the files with the manifest's segments (``committed``: segment -> committed
    length): orphans deleted, longer files truncated. Returns segment -> size now."""
    def path(seg: int) -> str:
        return os.path.join(directory, seg_name(seg))

    sizes: dict[int, int] = {}
    removed = False
    for seg in sorted(seg_files - set(committed)):
        os.unlink(path(seg))  # orphan: uncommitted segment or old compact
        removed = True
    for seg, length in committed.items():
        try:
            size = os.stat(path(seg)).st_size
        except FileNotFoundError:
            size = 0
        if size > length:  # uncommitted tail of a killed writer: unreferenced, drop it
            os.truncate(path(seg), length)
            size = length
        sizes[seg] = size
    if removed:
        fsync_dir(directory)
    return sizes
