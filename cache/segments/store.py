"""``SegmentStore``: staging (``put``, ``delete``, ``update_meta``), ``commit``, ``compact`` and
verified reads over the directory's segment files and manifest (see the package docstring for
the durability model)."""

from __future__ import annotations

import math
import os
import threading
from typing import Callable, Iterator

from cache.fsperm import LOCK_TIMEOUT_S, open_private, private_dir
from cache.segments.directory import (
    MANIFEST, fsync_dir, reconcile, scan, seg_name, take_lock, unlink_quiet, write_all,
)
from cache.segments.directory import wipe as wipe_directory
from cache.segments.errors import (
    CorruptBlockError, CorruptManifestError, StoreError, StoreFullError, UnknownRecordError, os_error,
    show_key,
)
from cache.segments.manifest import (
    bad_manifest, canonical, manifest_bytes, parse_manifest, write_manifest,
)
from cache.segments.record import (
    MAX_KEY_LEN, Entry, Hasher, Keys, SegmentReaders, as_bytes_view, build_record, check_meta,
    default_algo, record_len,
)

__all__ = ["SegmentStore"]


class _Appender:
    """An open, append-only segment file."""

    __slots__ = ("seg", "fd", "size")

    def __init__(self, seg: int, fd: int) -> None:
        self.seg = seg
        self.fd = fd
        self.size = 0


class SegmentStore:
    """A directory of append-only segment files plus an atomically replaced manifest.

    ``key``: 32-byte AES-256-GCM key, or None for plain (still checksummed) records. A store
    created with a key must always be opened with one (and vice versa). ``max_bytes``: disk
    budget for segments + manifest (None = only the disk's own limit). ``segment_bytes``: a
    segment is closed for appends once it would grow past this (a single larger record gets a
    segment of its own). ``read_staged``: False (default) = reads see the committed state only;
    True = reads also see this process's staged puts/deletes/meta updates (read-your-writes, what
    a cache tier that demotes a block and may promote it before the next commit wants).
    Durability is the same either way: only committed work survives a restart.
    """

    def __init__(self, directory: str | os.PathLike, *, key: bytes | None = None,
                 max_bytes: int | None = None, segment_bytes: int = 4 << 20,
                 read_staged: bool = False, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        if key is not None:
            key = bytes(key)
            if len(key) != 32:
                raise ValueError(f"key must be 32 bytes (AES-256-GCM), got {len(key)} bytes")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self.directory = os.fspath(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.read_staged = bool(read_staged)
        self._keys = Keys(key) if key is not None else None
        del key  # keep no plain copy around beyond the derived keys
        self._lock = threading.RLock()
        self._closed = False
        self._committed: dict[bytes, Entry] = {}
        self._staged: dict[bytes, Entry | None] = {}  # None = staged delete
        self._seg_committed: dict[int, int] = {}  # segment -> committed length (manifest)
        self._seg_sizes: dict[int, int] = {}  # segment -> bytes in the file now
        self._dirty: dict[int, int] = {}  # segment -> fd written since the last commit
        self._new_files = False  # segment files created since the last directory fsync
        self._writer: _Appender | None = None
        self._readers = SegmentReaders(self.directory)
        self._next_seg = 1
        self._generation = 0
        self._manifest_size = 0
        self._staged_manifest_est = 0
        self._commits = 0
        self._corrupt: set[bytes] = set()
        self._truncated_at_open = 0
        self._compact_dropped = 0
        private_dir(self.directory)  # 0700, or refused when group/other can reach it
        self._lock_fd = take_lock(self.directory, lock_timeout_s)
        try:
            self._load()
        except BaseException:
            self._release()
            raise

    @classmethod
    def open(cls, directory: str | os.PathLike, *, key: bytes | None = None,
             max_bytes: int | None = None, segment_bytes: int = 4 << 20,
             read_staged: bool = False, lock_timeout_s: float = LOCK_TIMEOUT_S
             ) -> "SegmentStore":
        """Open (or create) the store in ``directory``; same as the constructor."""
        return cls(directory, key=key, max_bytes=max_bytes, segment_bytes=segment_bytes,
                   read_staged=read_staged, lock_timeout_s=lock_timeout_s)

    @staticmethod
    def wipe(directory: str | os.PathLike, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        """Delete the store's files (segments, manifest) in ``directory``; other files stay.

        For rebuilding after ``CorruptManifestError`` (``OldFormatError`` included). Refuses
        while a store has it open (after waiting up to ``lock_timeout_s``), and refuses a
        directory group/other can reach as opening does.
        """
        wipe_directory(directory, lock_timeout_s)

    # ------------------------------------------------------------------ loading

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _load(self) -> None:
        seg_files, has_manifest = scan(self.directory)
        if not has_manifest:
            if seg_files:
                raise self._bad_manifest(f"{self._path(MANIFEST)} is missing but "
                                         f"{len(seg_files)} segment file(s) are present")
            self._hasher = Hasher(default_algo())
            late = self._write_manifest(self._manifest_bytes({}, {}, 0, self._next_seg))
            if late is not None:
                raise os_error(late, "fsyncing the directory of a new store")
            return
        try:
            with open(self._path(MANIFEST), "rb") as f:
                raw = f.read()
        except OSError as e:
            raise self._bad_manifest(f"cannot read {self._path(MANIFEST)}: {e}") from e
        self._parse_manifest(raw)
        self._manifest_size = len(raw)
        self._seg_sizes = reconcile(self.directory, seg_files, self._seg_committed)
        for key, e in self._committed.items():
            if e.off + e.length > self._seg_sizes.get(e.seg, 0):
                self._corrupt.add(key)
                self._truncated_at_open += 1

    def _bad_manifest(self, what: str) -> CorruptManifestError:
        return bad_manifest(what, self.directory)

    def _parse_manifest(self, raw: bytes) -> None:
        m = parse_manifest(raw, self._keys, self._path(MANIFEST), self.directory)
        self._hasher = Hasher(m.checksum)
        self._generation = m.generation
        self._next_seg = m.next_segment
        self._seg_committed = m.segments
        self._committed = m.records

    # ------------------------------------------------------------------ manifest

    def _manifest_bytes(self, records: dict[bytes, Entry], segs: dict[int, int],
                        generation: int, next_seg: int) -> bytes:
        return manifest_bytes(self._hasher.name, records, segs, generation, next_seg, self._keys)

    def _write_manifest(self, data: bytes) -> OSError | None:
        """Replace the manifest (``manifest.write_manifest``: raises before the rename, returns
        a failed directory fsync after it) and count its size."""
        late = write_manifest(self.directory, data)
        self._manifest_size = len(data)
        return late

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the store in {self.directory} is closed")

    def _pending(self, key: bytes) -> Entry | None:
        if key in self._staged:
            return self._staged[key]
        return self._committed.get(key)

    def _visible(self, key: bytes) -> Entry | None:
        return self._pending(key) if self.read_staged else self._committed.get(key)

    def _visible_items(self) -> list[tuple[bytes, Entry]]:
        return self._pending_items() if self.read_staged else list(self._committed.items())

    def _pending_items(self) -> list[tuple[bytes, Entry]]:
        out = [(k, e) for k, e in self._committed.items() if k not in self._staged]
        out += [(k, e) for k, e in self._staged.items() if e is not None]
        return out

    def _disk_bytes(self) -> int:
        return sum(self._seg_sizes.values()) + self._manifest_size

    def _record_len(self, key: bytes, payload_len: int) -> int:
        return record_len(self._keys, key, payload_len)

    def _build_record(self, seg: int, key: bytes, payload: memoryview) -> tuple[bytes, int]:
        return build_record(self._keys, self._hasher, seg, key, payload)

    def _new_appender(self) -> _Appender:
        seg = self._next_seg
        path = self._path(seg_name(seg))
        try:
            # O_APPEND: after a rollback ftruncate the next write lands at the new end, no hole.
            fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        except OSError as e:
            raise os_error(e, f"creating {seg_name(seg)}") from e
        self._next_seg += 1
        self._new_files = True
        self._seg_sizes[seg] = 0
        return _Appender(seg, fd)

    def _append(self, app: _Appender, buf: bytes) -> int:
        """Append ``buf``; on failure truncate the partial record away. Returns its offset."""
        start = app.size
        try:
            write_all(app.fd, buf)
        except OSError as e:
            try:
                os.ftruncate(app.fd, start)
            except OSError:
                # Cannot undo: the tail is garbage but unreferenced; never append here again.
                app.size = os.fstat(app.fd).st_size
                self._seg_sizes[app.seg] = app.size
                if self._writer is app:
                    self._writer = None
            raise os_error(e, f"appending to {seg_name(app.seg)}") from e
        app.size += len(buf)
        self._seg_sizes[app.seg] = app.size
        return start

    def _get_verified(self, key: bytes, e: Entry) -> bytes:
        try:
            return self._readers.read(key, e, self._keys, self._hasher)
        except CorruptBlockError:
            self._corrupt.add(key)
            raise

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, payload, meta: dict[str, int | str | float]) -> None:
        """Stage ``payload`` (bytes-like) under ``key``; it becomes visible and durable at commit().

        Re-putting a key replaces it at the next commit (the old bytes are dead until compact).
        Raises ``StoreFullError`` (nothing staged) when the budget or the disk has no room.
        """
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        key = bytes(key)
        if not 0 < len(key) <= MAX_KEY_LEN:
            raise ValueError(f"key must be 1..{MAX_KEY_LEN} bytes, got {len(key)}")
        body = as_bytes_view(payload)
        meta = check_meta(meta)
        with self._lock:
            self._check_open()
            rec_len = self._record_len(key, body.nbytes)
            est = 2 * len(key) + len(canonical(meta)) + 96  # its manifest entry, roughly
            if self._keys is not None:
                est = est * 4 // 3 + 4  # sealed and base64-encoded
            if self.max_bytes is not None:
                need = self._disk_bytes() + self._staged_manifest_est + est + rec_len
                if need > self.max_bytes:
                    raise StoreFullError(
                        f"put of {rec_len} bytes would exceed max_bytes={self.max_bytes} "
                        f"({self._disk_bytes()} bytes on disk); delete and compact() to free space")
            w = self._writer
            if w is not None and w.size > 0 and w.size + rec_len > self.segment_bytes:
                if w.seg not in self._dirty:  # else it stays open until the commit fsyncs it
                    os.close(w.fd)
                self._writer = w = None
            if w is None:
                w = self._writer = self._new_appender()
                self._dirty[w.seg] = w.fd
            buf, csum = self._build_record(w.seg, key, body)
            self._dirty.setdefault(w.seg, w.fd)
            off = self._append(w, buf)
            self._staged[key] = Entry(w.seg, off, len(buf), csum, meta)
            self._staged_manifest_est += est

    def delete(self, key: bytes) -> None:
        """Stage the removal of ``key``: dropped from the manifest at the next commit."""
        key = bytes(key)
        with self._lock:
            self._check_open()
            if self._pending(key) is None:
                raise UnknownRecordError(f"no record {show_key(key)} to delete")
            if key in self._committed:
                self._staged[key] = None
            else:
                del self._staged[key]  # put and deleted before any commit: nothing to record

    def drop_where(self, pred: Callable[[dict], bool]) -> int:
        """Stage the removal of every (pending) record whose meta satisfies ``pred``; the count."""
        with self._lock:
            self._check_open()
            victims = [k for k, e in self._pending_items() if pred(dict(e.meta))]
            for k in victims:
                self.delete(k)
            return len(victims)

    def update_meta(self, key: bytes, changes: dict[str, int | str | float]) -> None:
        """Stage a meta update (merged into the record's meta; e.g. ``last_access`` on a hit)."""
        key = bytes(key)
        changes = check_meta(changes)
        with self._lock:
            self._check_open()
            e = self._pending(key)
            if e is None:
                raise UnknownRecordError(f"no record {show_key(key)} to update")
            self._staged[key] = Entry(e.seg, e.off, e.length, e.csum, {**e.meta, **changes})

    def commit(self) -> None:
        """Make every staged put/delete/meta update durable and visible, atomically.

        Order: fsync the written segments, (fsync the directory for new segment files), then the
        manifest via temp + fsync + rename + fsync(dir). After a ``StoreFullError`` the committed
        state is unchanged; staged work is kept (retry after freeing space) unless a segment
        fsync failed, in which case its staged puts are dropped (the kernel may have discarded
        their pages, so a retried fsync would lie) and must be put again.
        """
        with self._lock:
            self._check_open()
            if not self._staged and not self._dirty:
                return  # nothing to make durable
            try:
                for fd in self._dirty.values():
                    os.fsync(fd)
            except OSError as e:
                self._drop_staged_puts()
                raise os_error(e, "fsyncing segments (staged puts were dropped)") from e
            records = dict(self._committed)
            for k, e in self._staged.items():
                if e is None:
                    records.pop(k, None)
                else:
                    records[k] = e
            segs = dict(self._seg_committed)
            for seg in self._dirty:
                segs[seg] = self._seg_sizes[seg]
            data = self._manifest_bytes(records, segs, self._generation + 1, self._next_seg)
            if self.max_bytes is not None:
                total = sum(self._seg_sizes.values()) + len(data)
                if total > self.max_bytes:
                    raise StoreFullError(
                        f"commit needs {total} bytes on disk, over max_bytes={self.max_bytes}; "
                        f"delete and compact() to free space (staged work is kept)")
            if self._new_files:
                try:
                    fsync_dir(self.directory)
                except OSError as e:
                    raise os_error(e, "fsyncing the directory") from e
                self._new_files = False
            late = self._write_manifest(data)  # raises with the old manifest in place
            self._committed = records
            self._seg_committed = segs
            self._staged.clear()
            self._staged_manifest_est = 0
            self._generation += 1
            self._commits += 1
            for seg, fd in self._dirty.items():
                if self._writer is None or seg != self._writer.seg:
                    os.close(fd)
            self._dirty.clear()
            if late is not None:
                raise os_error(late, "fsyncing the directory after the manifest rename") from late

    def _drop_staged_puts(self) -> None:
        """Forget staged records whose bytes are not known durable (meta updates of committed
        bytes and deletes stay staged)."""
        def durable(e: Entry) -> bool:
            return e.off + e.length <= self._seg_committed.get(e.seg, -1)

        for k in [k for k, e in self._staged.items() if e is not None and not durable(e)]:
            del self._staged[k]
        self._staged_manifest_est = 0
        # Never append to these segments again; open() truncates them to their committed length.
        self._close_writers()

    def _close_writers(self) -> None:
        w = self._writer
        if w is not None and w.seg not in self._dirty:
            os.close(w.fd)
        for fd in self._dirty.values():
            os.close(fd)
        self._dirty.clear()
        self._writer = None

    def compact(self) -> None:
        """Rewrite every live (pending) record into fresh segments and delete the old ones.

        Also commits staged work. Each record is verified (and, encrypted, re-sealed under its new
        segment id); corrupt ones are dropped (``stats()["compact_dropped"]``). Atomic: the new
        segments are fsynced and named in a new manifest before any old segment is deleted; a
        crash or ENOSPC before the rename leaves the old state, and open() deletes the orphans.
        """
        with self._lock:
            self._check_open()
            new_apps, records, dropped, late = self._rewrite_live()
            # The new manifest is on disk: publish it, then the old segments are garbage.
            old = self._publish_compacted(new_apps, records, dropped)
            if late is not None:
                raise os_error(late, "fsyncing the directory after compaction") from late
            try:
                for seg in old:
                    unlink_quiet(self._path(seg_name(seg)))
                fsync_dir(self.directory)
            except OSError:
                pass  # harmless: open() deletes segments the manifest does not list

    def _rewrite_live(self) -> tuple[list[_Appender], dict[bytes, Entry], int, OSError | None]:
        """Compaction's first half: the live records verified and appended to new segments,
        fsynced, and a manifest naming only them written. Returns the new segments, the
        records, the count of corrupt ones dropped and a late directory-fsync error (see
        ``_write_manifest``). On any failure the new segments are deleted and the store is as
        before."""
        new_apps: list[_Appender] = []
        records: dict[bytes, Entry] = {}
        dropped = 0
        seg_sizes_before = dict(self._seg_sizes)
        try:
            app = None
            for key, e in self._pending_items():
                try:
                    payload = self._get_verified(key, e)
                except CorruptBlockError:
                    dropped += 1
                    continue
                rec_len = self._record_len(key, len(payload))
                if app is None or (app.size > 0 and app.size + rec_len > self.segment_bytes):
                    app = self._new_appender()
                    new_apps.append(app)
                buf, csum = self._build_record(app.seg, key, memoryview(payload))
                off = self._append(app, buf)
                records[key] = Entry(app.seg, off, len(buf), csum, e.meta)
            for a in new_apps:
                os.fsync(a.fd)
            fsync_dir(self.directory)
            segs = {a.seg: a.size for a in new_apps}
            late = self._write_manifest(self._manifest_bytes(
                records, segs, self._generation + 1, self._next_seg))
        except BaseException as exc:
            for a in new_apps:
                os.close(a.fd)
                unlink_quiet(self._path(seg_name(a.seg)))
            self._seg_sizes = seg_sizes_before
            if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                raise os_error(exc, "compacting") from exc
            raise
        return new_apps, records, dropped, late

    def _publish_compacted(self, new_apps: list[_Appender], records: dict[bytes, Entry],
                           dropped: int) -> set[int]:
        """Compaction's second half, once its manifest is on disk: the new segments become the
        committed state (staged work included); returns the old segments, now garbage."""
        segs = {a.seg: a.size for a in new_apps}
        for a in new_apps:
            os.close(a.fd)
        old = set(self._seg_sizes) - set(segs)
        self._readers.close()
        self._close_writers()
        self._new_files = False
        self._committed = records
        self._seg_committed = segs
        self._seg_sizes = dict(segs)
        self._staged.clear()
        self._staged_manifest_est = 0
        self._generation += 1
        self._commits += 1
        self._compact_dropped += dropped
        self._corrupt &= set(records)  # dropped ones are gone, not corrupt any more
        return old

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> bytes:
        """The payload of ``key``, read through mmap and verified (committed state, or with
        ``read_staged`` the pending one).

        Raises ``UnknownRecordError`` for a key not visible, ``CorruptBlockError`` when the
        record fails its checksum, header, length or GCM check (counted in ``stats()``).
        """
        key = bytes(key)
        with self._lock:
            self._check_open()
            e = self._visible(key)
            if e is None:
                raise UnknownRecordError(f"no record {show_key(key)}")
            return self._get_verified(key, e)

    def meta(self, key: bytes) -> dict:
        """A copy of the meta of ``key``."""
        key = bytes(key)
        with self._lock:
            self._check_open()
            e = self._visible(key)
            if e is None:
                raise UnknownRecordError(f"no record {show_key(key)}")
            return dict(e.meta)

    def __contains__(self, key) -> bool:
        with self._lock:
            return self._visible(bytes(key)) is not None

    def __len__(self) -> int:
        with self._lock:
            if not self.read_staged:
                return len(self._committed)
            return len(self._pending_items())

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    def keys(self) -> list[bytes]:
        with self._lock:
            return [k for k, _ in self._visible_items()]

    def keys_hottest_first(self) -> list[bytes]:
        """Keys by ``meta["last_access"]`` descending (records without it last): the order a
        warm restart restores them in."""
        def heat(item):
            v = item[1].meta.get("last_access")
            return v if isinstance(v, (int, float)) else -math.inf

        with self._lock:
            return [k for k, _ in sorted(self._visible_items(), key=heat, reverse=True)]

    def verify(self) -> list[bytes]:
        """Read and verify every visible record; the keys that fail (also counted)."""
        bad = []
        with self._lock:
            self._check_open()
            for k, e in self._visible_items():
                try:
                    self._get_verified(k, e)
                except CorruptBlockError:
                    bad.append(k)
        return bad

    def stats(self) -> dict:
        with self._lock:
            return {
                "records": len(self._committed),
                "live_bytes": sum(e.length for e in self._committed.values()),
                "bytes_on_disk": self._disk_bytes(),
                "segments": len(self._seg_sizes),
                "corrupt_records": len(self._corrupt),
                "truncated_records": self._truncated_at_open,
                "compact_dropped": self._compact_dropped,
                "commits": self._commits,
                "generation": self._generation,
                "staged_puts": sum(e is not None for e in self._staged.values()),
                "staged_deletes": sum(e is None for e in self._staged.values()),
                "encrypted": self._keys is not None,
                "checksum": self._hasher.name,
                "max_bytes": self.max_bytes,
            }

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Release files and the directory lock. Does not commit: staged work is dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    def _release(self) -> None:
        self._readers.close()
        self._close_writers()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "SegmentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._committed)} records"
        return f"SegmentStore({self.directory!r}, {state})"
