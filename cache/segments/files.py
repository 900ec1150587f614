"""The segment store's directory: its file names, and the writes that must survive a power cut
(a full ``write``, a directory ``fsync``)."""

from __future__ import annotations

import errno
import os
import re

__all__ = ["LOCK_FILE", "MANIFEST", "MANIFEST_TMP", "SEG_RE", "fsync_dir", "seg_name", "show_key",
           "unlink_quiet", "write_all"]

MANIFEST = "manifest.json"
MANIFEST_TMP = "manifest.json.tmp"
LOCK_FILE = "LOCK"
SEG_RE = re.compile(r"^seg-(\d{6,})\.bin$")


def seg_name(seg: int) -> str:
    return f"seg-{seg:06d}.bin"


def show_key(key: bytes) -> str:
    h = key[:12].hex()
    return f"{h}{'...' if len(key) > 12 else ''} ({len(key)} bytes)"


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
