"""Verified reads of a store's records: one read-only descriptor and mmap per segment."""

from __future__ import annotations

import mmap
import os

from cache.segments.errors import CorruptBlockError
from cache.segments.files import seg_name
from cache.segments.record import HEADER, TRAILER, Entry, Hasher, Keys, parse_record, record_id

__all__ = ["SegmentReaders"]


class _Reader:
    __slots__ = ("fd", "mm", "mapped")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.mm: mmap.mmap | None = None
        self.mapped = 0

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive; unmapped when it is collected
                pass
            self.mm = None
        os.close(self.fd)


class SegmentReaders:
    """The open segments of one store's directory, for reading."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._open: dict[int, _Reader] = {}

    def _reader(self, seg: int) -> _Reader | None:
        r = self._open.get(seg)
        if r is None:
            try:
                fd = os.open(os.path.join(self.directory, seg_name(seg)), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            r = self._open[seg] = _Reader(fd)
        return r

    def read(self, key: bytes, e: Entry, keys: Keys | None, hasher: Hasher) -> bytes:
        """Verify and return the payload of record ``e`` through an mmap of its segment."""
        def bad(reason: str) -> CorruptBlockError:
            return CorruptBlockError(key, reason, segment=e.seg, offset=e.off)

        end = e.off + e.length
        r = self._reader(e.seg)
        if r is None:
            raise bad("its segment file is missing")
        # Check the size first: touching an mmap past the end of a cut file is SIGBUS, not an error.
        size = os.fstat(r.fd).st_size
        if size < end:
            raise bad(f"the segment is truncated ({size} bytes, the record ends at {end})")
        if r.mm is None or r.mapped < end:
            # The old map (if any) is not closed here: a view of it may still be alive (e.g. in
            # a traceback); dropping the reference unmaps it once the last view is gone.
            r.mm = mmap.mmap(r.fd, size, prot=mmap.PROT_READ)
            r.mapped = size
        if e.length < HEADER.size + len(record_id(keys, key)) + TRAILER.size:
            raise bad("the manifest gives it an impossible length")
        with memoryview(r.mm) as mv:
            rec = mv[e.off:end]
            try:
                return parse_record(rec, key, e, keys, hasher)
            finally:
                rec.release()

    def close(self) -> None:
        """Close every open segment (reopened on the next read)."""
        for r in self._open.values():
            r.close()
        self._open.clear()
