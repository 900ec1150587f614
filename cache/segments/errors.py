"""The segment store's errors: ``StoreError`` (a ``CacheError``) and what derives from it."""

from __future__ import annotations

import errno
import os

from cache.errors import CacheError
from cache.fsperm import LockTimeoutError

__all__ = ["CorruptBlockError", "CorruptManifestError", "OldFormatError", "StoreError", "StoreFullError",
           "StoreLockedError", "UnknownRecordError", "WrongKeyError", "os_error", "show_key"]

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def show_key(key: bytes) -> str:
    """A record key as messages show it: its first 12 bytes in hex and its length."""
    h = key[:12].hex()
    return f"{h}{'...' if len(key) > 12 else ''} ({len(key)} bytes)"


class StoreError(CacheError):
    """Base class of every error the segment store raises."""


class UnknownRecordError(StoreError, KeyError):
    """A key the committed state (or, for ``delete``/``update_meta``, the pending state) lacks."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown record"


class CorruptBlockError(StoreError):
    """A committed record whose bytes fail verification: checksum, header, truncation or GCM tag.

    The message names the record key (shortened), segment, offset and what failed, never a
    checksum value or anything derived from the encryption key. ``.key`` holds the record key.
    """

    def __init__(self, key: bytes, reason: str, *, segment: int | None = None,
                 offset: int | None = None) -> None:
        self.key = key
        self.reason = reason
        self.segment = segment
        self.offset = offset
        where = ""
        if segment is not None:
            where = f" in seg-{segment:06d}.bin"  # the name directory.seg_name gives it
            where += f" at offset {offset}" if offset is not None else ""
        super().__init__(f"corrupt record {show_key(key)}{where}: {reason}")


class CorruptManifestError(StoreError):
    """``manifest.json`` is missing, truncated, not JSON, or fails its checksum."""


class OldFormatError(CorruptManifestError):
    """``manifest.json`` is an older on-disk format than this code writes. A cache rebuilds such
    a directory empty (``SegmentStore.wipe``) rather than misread it: version 1 kept record ids
    (the unkeyed content hashes) and the record map readable without the key."""


class WrongKeyError(StoreError):
    """An encrypted store opened with another key than the one it was sealed with (nothing is
    wiped: the right key opens it)."""


class StoreLockedError(StoreError, LockTimeoutError):
    """The directory's ``LOCK`` stayed held by another process for the whole bounded wait."""


class StoreFullError(StoreError, OSError):
    """The disk budget (``max_bytes``) or the disk itself (ENOSPC/EDQUOT) has no room.

    Also an ``OSError`` whose ``errno`` is ``ENOSPC`` (or the ``errno`` the disk reported).
    """

    def __init__(self, message: str, err: int = errno.ENOSPC) -> None:
        OSError.__init__(self, err, message)

    def __str__(self) -> str:
        return str(self.strerror)


def os_error(exc: OSError, what: str) -> StoreError:
    """ENOSPC/EDQUOT -> StoreFullError; anything else -> StoreError (both chain ``exc``)."""
    if exc.errno in FULL_ERRNOS:
        return StoreFullError(f"disk full while {what}: {os.strerror(exc.errno)}", exc.errno)
    return StoreError(f"I/O error while {what}: {exc}")
