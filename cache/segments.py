"""``SegmentStore``: the cold tier's crash-safe, checksummed, optionally encrypted block store.

The engine spills blocks here (``put``), makes them durable in batches (``commit``) and, after a
restart, restores them hottest first (``keys_hottest_first`` + ``get``). Everything lives in one
directory::

    seg-000001.bin     append-only segment files of records
    seg-000002.bin
    manifest.json      the committed state: per key its segment, offset, length, checksum, meta
                       (sealed with AES-256-GCM in an encrypted store)
    LOCK               flock()ed while a store has the directory open (one writer at a time)

**Permissions and the lock** (``cache/fsperm.py``). The directory is created 0700 and every
file 0600 whatever the umask; opening a directory that group/other can reach raises
``UnsafePermissionsError`` (``chmod 700`` it). Opening waits at most ``lock_timeout_s`` for a
``LOCK`` another process holds, then raises ``StoreLockedError`` naming the file.

**Durability model.** A record is *staged* when ``put`` appends it to the open segment and becomes
*committed* when ``commit`` returns. ``commit`` first ``fsync``s every segment written since the
last commit, then writes the whole manifest to ``manifest.json.tmp``, ``fsync``s it, ``rename``s it
over ``manifest.json`` and ``fsync``s the directory. ``rename`` is atomic, so a reader (or a process
restarting after ``kill -9`` or a power cut) sees either the old manifest or the new one, never a
mix; the segment ``fsync`` before it means the new manifest never points at bytes that are not on
disk; the directory ``fsync`` makes the rename itself (and the names of new segment files) durable,
without it the rename may be lost on power failure even though ``commit`` returned. Bytes appended
after the last commit are simply not referenced by the manifest: ``open`` truncates them away and
deletes segment files the manifest does not list (orphans of a crash or of an interrupted
``compact``), so nothing uncommitted is ever visible.

**Reads** see the committed state only (``get``, ``meta``, ``in``, ``len``, ``keys``); staged puts,
deletes and meta updates become visible at ``commit`` -- unless the store is opened with
``read_staged=True`` (read-your-writes: what a cache tier wants, a block demoted a moment ago
can be promoted before the next commit). ``close`` does not commit: staged work is dropped,
exactly as a crash would drop it.

**Integrity.** Every record carries a checksum over its header, key and payload (xxh3-64 when the
``xxhash`` package is installed, else BLAKE2b-64; the choice is fixed per store in the manifest),
and the manifest repeats it, so a flipped bit anywhere in the record, a record overwritten by
another one, or a segment cut short is detected on ``get`` (``CorruptBlockError``, counted in
``stats()["corrupt_records"]``); one bad record never makes the others unreadable. The manifest has
its own SHA-256 over its canonical JSON; a truncated or edited manifest raises
``CorruptManifestError`` on open (``SegmentStore.wipe(directory)`` then starts over).

**Encryption.** With ``key`` (32 bytes), payloads are sealed with AES-256-GCM: a fresh random
96-bit nonce per record, and the record key plus segment id as associated data, so a record cannot
be replayed under another key or moved to another segment unnoticed. The checksum is computed
over the ciphertext (it detects media corruption without the key; the GCM tag detects a wrong key
or tampering). Random nonces are safe for far fewer than 2**32 records per key.

Nothing on disk names a record key either (on-disk format version 2; issue 20): a record key
such as a K/V block's chained content hash is computable from a guessed prompt, so a readable
one would confirm the guess. A record's header carries ``HMAC-SHA256(id key, record key)``
instead, and the manifest's body (record keys, locations, sizes, meta) is sealed whole with
AES-256-GCM; both keys are derived from ``key`` with HKDF-SHA256. The record map is sealed
rather than keyed with HMAC because the store must list its keys on open (tensors, the warm
restart), which a one-way id cannot give back. The manifest keeps in the clear only its
format, version, a 16-byte key check (a wrong key raises ``WrongKeyError`` and wipes nothing;
a sealed body that fails its tag is corrupt) and its SHA-256. An older-format manifest raises
``OldFormatError`` (a ``CorruptManifestError``: a cache rebuilds the directory empty).

**Disk budget.** ``max_bytes`` caps segment files plus manifest; a ``put`` or ``commit`` that would
exceed it, or that hits a real ``ENOSPC``/``EDQUOT``, raises ``StoreFullError`` and leaves the
store usable with everything committed intact (a half-written record is truncated away). Space is
freed by ``delete``/``drop_where`` followed by ``compact``; ``compact`` may exceed ``max_bytes``
transiently by the live bytes it rewrites (it is the way back under the cap) but not the real disk.

**Errors.** ``StoreError`` (a ``CacheError``) is the base; ``CorruptBlockError``,
``CorruptManifestError`` (``OldFormatError``), ``WrongKeyError``, ``StoreLockedError`` (also a
``TimeoutError``), ``UnknownRecordError`` (also a ``KeyError``) and ``StoreFullError`` (also
an ``OSError`` with ``errno.ENOSPC``, so generic disk-full handling catches it) derive from it.

This module imports only the standard library, ``cryptography`` (when a key is given) and,
optionally, ``xxhash``; its only imports from ``cache`` are ``cache.errors`` and
``cache.fsperm``.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import json
import math
import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from cache.errors import CacheError
from cache.fsperm import LOCK_TIMEOUT_S, LockTimeoutError, lock_within, open_private, private_dir

try:  # optional: ~10x faster than BLAKE2b; recorded per store so a reader knows which one
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

__all__ = [
    "SegmentStore",
    "StoreError",
    "CorruptBlockError",
    "CorruptManifestError",
    "OldFormatError",
    "StoreFullError",
    "StoreLockedError",
    "WrongKeyError",
    "UnknownRecordError",
]


# --------------------------------------------------------------------------- errors


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
            where = f" in {_seg_name(segment)}" + (f" at offset {offset}" if offset is not None else "")
        super().__init__(f"corrupt record {_show_key(key)}{where}: {reason}")


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


# --------------------------------------------------------------------------- format

_MAGIC = b"FKVR"
_VERSION = 2  # 2: an encrypted store's record carries its keyed id, not its key
# magic, version, flags, checksum algorithm, reserved, key length, stored payload length, nonce
_HEADER = struct.Struct("<4sBBBBIQ12s")
_TRAILER = struct.Struct("<Q")  # 64-bit checksum over header + key + stored payload
_FLAG_ENCRYPTED = 1
_NONCE_LEN = 12
_TAG_LEN = 16
_ZERO_NONCE = bytes(_NONCE_LEN)
_MAX_KEY_LEN = 4096
_AAD_PREFIX = b"fedkv-seg-v1\0"

_MANIFEST = "manifest.json"
_MANIFEST_TMP = "manifest.json.tmp"
_LOCK = "LOCK"
_FORMAT = "fedkv-segments"
_MANIFEST_VERSION = 2  # 2: encrypted stores seal the record map, keyed record ids
_SUM_FIELD = "manifest_sha256"
_MANIFEST_AAD = b"fedkv-manifest-v2\0"
_KDF_INFO = b"fedkv-segments-v2 "
_ID_LEN = 32  # HMAC-SHA256
_SEG_RE = re.compile(r"^seg-(\d{6,})\.bin$")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

_ALGOS = {"xxh3_64": 1, "blake2b_64": 2}


def _seg_name(seg: int) -> str:
    return f"seg-{seg:06d}.bin"


def _show_key(key: bytes) -> str:
    h = key[:12].hex()
    return f"{h}{'...' if len(key) > 12 else ''} ({len(key)} bytes)"


class _Hasher:
    """The per-store record checksum: xxh3-64 or BLAKE2b-64, as an int."""

    def __init__(self, name: str) -> None:
        if name not in _ALGOS:
            raise StoreError(f"unknown record checksum {name!r} (known: {sorted(_ALGOS)})")
        if name == "xxh3_64" and xxhash is None:
            raise StoreError("this store's records use xxh3_64 checksums but the xxhash package "
                             "is not installed; install xxhash to read it")
        self.name = name
        self.algo_id = _ALGOS[name]

    def digest(self, *parts) -> int:
        if self.name == "xxh3_64":
            h = xxhash.xxh3_64()
        else:
            h = hashlib.blake2b(digest_size=8)
        for p in parts:
            h.update(p)
        return int.from_bytes(h.digest(), "big")


def _default_algo() -> str:
    return "xxh3_64" if xxhash is not None else "blake2b_64"


def _write_all(fd: int, data) -> None:
    """``os.write`` until everything is written (short writes happen near a full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - os.write raises instead on Linux
            raise OSError(errno.EIO, "short write")
        view = view[n:]


def _fsync_dir(directory: str) -> None:
    """fsync a directory so renames, creations and unlinks in it survive a power cut."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_bytes_view(payload) -> memoryview:
    mv = memoryview(payload)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")  # raises TypeError for a non-contiguous buffer
    return mv


def _check_meta(meta) -> dict:
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict of str -> int | str | float, got {type(meta).__name__}")
    out = {}
    for k, v in meta.items():
        if not isinstance(k, str):
            raise TypeError(f"meta keys must be str, got {k!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"meta[{k!r}] = {v!r}: only finite floats survive the JSON manifest")
        if not isinstance(v, (int, str, float)):
            raise TypeError(f"meta[{k!r}] must be int, str or float, got {type(v).__name__}")
        out[k] = v
    return out


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _os_error(exc: OSError, what: str) -> StoreError:
    """ENOSPC/EDQUOT -> StoreFullError; anything else -> StoreError (both chain ``exc``)."""
    if exc.errno in _FULL_ERRNOS:
        return StoreFullError(f"disk full while {what}: {os.strerror(exc.errno)}", exc.errno)
    return StoreError(f"I/O error while {what}: {exc}")


class _Keys:
    """What an encrypted store derives from its 32-byte key (HKDF-SHA256, one ``info`` each):
    the record AEAD (the key itself, as in version 1), the key of the record ids (HMAC-SHA256
    of a record key: what a segment's record header carries), the manifest's AEAD key, and a
    public key check (so a wrong key is told apart from a tampered manifest and wipes
    nothing)."""

    __slots__ = ("records", "manifest", "_id_key", "check")

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        def derive(purpose: bytes) -> bytes:
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                        info=_KDF_INFO + purpose).derive(key)

        self.records = AESGCM(key)
        self._id_key = derive(b"record id")
        self.manifest = AESGCM(derive(b"manifest"))
        self.check = derive(b"key check")[:16].hex()

    def record_id(self, key: bytes) -> bytes:
        return hmac.new(self._id_key, key, hashlib.sha256).digest()


def _encode_manifest(body: dict, keys: _Keys | None) -> bytes:
    """The manifest file: ``body`` in the clear (a plain store) or sealed with AES-256-GCM
    (an encrypted one: record keys, sizes and meta are unreadable without the key), plus a
    SHA-256 over the canonical JSON that detects damage without the key."""
    outer = {"format": _FORMAT, "version": _MANIFEST_VERSION, "encrypted": keys is not None}
    if keys is None:
        outer.update(body)
    else:
        nonce = os.urandom(_NONCE_LEN)
        sealed = keys.manifest.encrypt(nonce, _canonical(body),
                                       _MANIFEST_AAD + bytes.fromhex(keys.check))
        outer.update(key_check=keys.check, nonce=nonce.hex(),
                     sealed=base64.b64encode(sealed).decode("ascii"))
    outer[_SUM_FIELD] = hashlib.sha256(_canonical(outer)).hexdigest()
    return _canonical(outer)


def _decode_manifest(raw: bytes, keys: _Keys | None, path: str, directory: str) -> dict:
    """The manifest's body (checksum, generation, next_segment, segments, records)."""
    def bad(what: str, cls=CorruptManifestError) -> CorruptManifestError:
        return cls(f"{what}; the committed state cannot be trusted: call "
                   f"SegmentStore.wipe({directory!r}) to start over")

    if not raw:
        raise bad(f"{path} is empty (truncated)")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"{path} is not valid JSON ({len(raw)} bytes; truncated or "
                  f"overwritten?): {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT:
        raise bad(f"{path} is not a {_FORMAT} manifest")
    stored = obj.pop(_SUM_FIELD, None)
    if not isinstance(stored, str):
        raise bad(f"{path} has no {_SUM_FIELD} field")
    if hashlib.sha256(_canonical(obj)).hexdigest() != stored:
        raise bad(f"{path} fails its checksum: the content was modified or partially written")
    version = obj.get("version")
    if isinstance(version, int) and version < _MANIFEST_VERSION:
        raise bad(f"{path} is on-disk format version {version} (record ids and the record map "
                  f"readable without the key); this code writes version {_MANIFEST_VERSION}",
                  OldFormatError)
    if version != _MANIFEST_VERSION:
        raise StoreError(f"{path} has manifest version {version!r}; this code reads version "
                         f"{_MANIFEST_VERSION} (a newer fedkv wrote it?)")
    encrypted = obj.get("encrypted")
    if encrypted is True and keys is None:
        raise StoreError(f"the store in {directory} is encrypted: open it with its key")
    if encrypted is False and keys is not None:
        raise StoreError(f"the store in {directory} was created without encryption; "
                         f"open it without a key (or wipe it to start an encrypted one)")
    if not encrypted:
        return obj
    if obj.get("key_check") != keys.check:
        raise WrongKeyError(f"the store in {directory} is sealed with another key than the one "
                            f"given (its key check differs); nothing was read or changed")
    try:
        nonce = bytes.fromhex(obj["nonce"])
        sealed = base64.b64decode(obj["sealed"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"{path} passes its checksum but is malformed: {e!r}") from None
    from cryptography.exceptions import InvalidTag
    try:
        inner = keys.manifest.decrypt(nonce, sealed, _MANIFEST_AAD + bytes.fromhex(keys.check))
    except (InvalidTag, ValueError):
        raise bad(f"{path} fails authentication (sealed by this key, then altered)") from None
    try:
        body = json.loads(inner)
    except ValueError as e:  # pragma: no cover - authenticated bytes are what we wrote
        raise bad(f"{path} holds an unreadable record map: {e}") from None
    if not isinstance(body, dict):  # pragma: no cover - as above
        raise bad(f"{path} holds a record map that is not an object")
    return body


def read_manifest(directory: str | os.PathLike, key: bytes | None = None) -> dict:
    """The committed record map of the store in ``directory`` (diagnostics and tests; takes no
    lock): ``{"checksum", "generation", "next_segment", "segments", "records"}`` with records
    by key hex. An encrypted store's needs its key."""
    directory = os.fspath(directory)
    path = os.path.join(directory, _MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    return _decode_manifest(raw, _Keys(bytes(key)) if key is not None else None, path, directory)


@dataclass(slots=True)
class _Entry:
    seg: int
    off: int
    length: int
    csum: int
    meta: dict

    def to_json(self) -> dict:
        return {"seg": self.seg, "off": self.off, "len": self.length,
                "sum": f"{self.csum:016x}", "meta": self.meta}


class _Appender:
    """An open, append-only segment file."""

    __slots__ = ("seg", "fd", "size")

    def __init__(self, seg: int, fd: int) -> None:
        self.seg = seg
        self.fd = fd
        self.size = 0


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


# --------------------------------------------------------------------------- the store


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
        self._keys = _Keys(key) if key is not None else None
        del key  # keep no plain copy around beyond the derived keys
        self._lock = threading.RLock()
        self._closed = False
        self._committed: dict[bytes, _Entry] = {}
        self._staged: dict[bytes, _Entry | None] = {}  # None = staged delete
        self._seg_committed: dict[int, int] = {}  # segment -> committed length (manifest)
        self._seg_sizes: dict[int, int] = {}  # segment -> bytes in the file now
        self._dirty: dict[int, int] = {}  # segment -> fd written since the last commit
        self._new_files = False  # segment files created since the last directory fsync
        self._writer: _Appender | None = None
        self._readers: dict[int, _Reader] = {}
        self._next_seg = 1
        self._generation = 0
        self._manifest_size = 0
        self._staged_manifest_est = 0
        self._commits = 0
        self._corrupt: set[bytes] = set()
        self._truncated_at_open = 0
        self._compact_dropped = 0
        private_dir(self.directory)  # 0700, or refused when group/other can reach it
        self._lock_fd = _take_lock(self.directory, lock_timeout_s)
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
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            return
        private_dir(directory)
        lock_fd = _take_lock(directory, lock_timeout_s)
        try:
            for name in os.listdir(directory):
                if _SEG_RE.match(name) or name in (_MANIFEST, _MANIFEST_TMP):
                    os.unlink(os.path.join(directory, name))
            _fsync_dir(directory)
        finally:
            os.close(lock_fd)

    # ------------------------------------------------------------------ loading

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _load(self) -> None:
        names = os.listdir(self.directory)
        seg_files = {int(m.group(1)) for n in names if (m := _SEG_RE.match(n))}
        for n in names:  # files of an older version were 0644: owner-only from here on
            if _SEG_RE.match(n) or n == _MANIFEST:
                p = self._path(n)
                if os.stat(p).st_mode & 0o077:
                    os.chmod(p, 0o600)
        if _MANIFEST_TMP in names:  # a commit killed before its rename: never the truth
            os.unlink(self._path(_MANIFEST_TMP))
        if _MANIFEST not in names:
            if seg_files:
                raise self._bad_manifest(f"{self._path(_MANIFEST)} is missing but "
                                         f"{len(seg_files)} segment file(s) are present")
            self._hasher = _Hasher(_default_algo())
            late = self._write_manifest(self._manifest_bytes({}, {}, 0, self._next_seg))
            if late is not None:
                raise _os_error(late, "fsyncing the directory of a new store")
            return
        try:
            with open(self._path(_MANIFEST), "rb") as f:
                raw = f.read()
        except OSError as e:
            raise self._bad_manifest(f"cannot read {self._path(_MANIFEST)}: {e}") from e
        self._parse_manifest(raw)
        self._manifest_size = len(raw)
        # Reconcile the files with the manifest.
        removed = False
        for seg in sorted(seg_files - set(self._seg_committed)):
            os.unlink(self._path(_seg_name(seg)))  # orphan: uncommitted segment or old compact
            removed = True
        for seg, committed in self._seg_committed.items():
            try:
                size = os.stat(self._path(_seg_name(seg))).st_size
            except FileNotFoundError:
                size = 0
            if size > committed:  # uncommitted tail of a killed writer: unreferenced, drop it
                os.truncate(self._path(_seg_name(seg)), committed)
                size = committed
            self._seg_sizes[seg] = size
        if removed:
            _fsync_dir(self.directory)
        for key, e in self._committed.items():
            if e.off + e.length > self._seg_sizes.get(e.seg, 0):
                self._corrupt.add(key)
                self._truncated_at_open += 1

    def _bad_manifest(self, what: str) -> CorruptManifestError:
        return CorruptManifestError(f"{what}; the committed state cannot be trusted: call "
                                    f"SegmentStore.wipe({self.directory!r}) to start over")

    def _parse_manifest(self, raw: bytes) -> None:
        path = self._path(_MANIFEST)
        obj = _decode_manifest(raw, self._keys, path, self.directory)
        try:
            algo = obj["checksum"]
            generation = int(obj["generation"])
            next_seg = int(obj["next_segment"])
            segs = {int(s): int(n) for s, n in obj["segments"].items()}
            records = {}
            for khex, r in obj["records"].items():
                records[bytes.fromhex(khex)] = _Entry(int(r["seg"]), int(r["off"]), int(r["len"]),
                                                      int(r["sum"], 16), _check_meta(r["meta"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise self._bad_manifest(f"{path} passes its checksum but is malformed: {e!r}") from None
        self._hasher = _Hasher(algo)
        self._generation = generation
        self._next_seg = next_seg
        self._seg_committed = segs
        self._committed = records

    # ------------------------------------------------------------------ manifest

    def _manifest_bytes(self, records: dict[bytes, _Entry], segs: dict[int, int],
                        generation: int, next_seg: int) -> bytes:
        return _encode_manifest({
            "checksum": self._hasher.name,
            "generation": generation,
            "next_segment": next_seg,
            "segments": {str(s): n for s, n in segs.items()},
            "records": {k.hex(): e.to_json() for k, e in records.items()},
        }, self._keys)

    def _write_manifest(self, data: bytes) -> OSError | None:
        """temp file + fsync + rename + fsync(dir): the manifest is replaced atomically and durably.

        Raises (old manifest still in place) for a failure before the rename. A failure of the
        directory fsync after it is *returned*: the new manifest is already the one on disk, so
        the caller must publish the new state first and raise afterwards.
        """
        tmp = self._path(_MANIFEST_TMP)
        try:
            fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as e:
            raise _os_error(e, "creating the manifest") from e
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            _unlink_quiet(tmp)
            raise _os_error(e, "writing the manifest") from e
        os.close(fd)
        try:
            os.replace(tmp, self._path(_MANIFEST))
        except OSError as e:
            _unlink_quiet(tmp)
            raise _os_error(e, "renaming the manifest") from e
        self._manifest_size = len(data)
        try:
            _fsync_dir(self.directory)
        except OSError as e:  # the new manifest is in place; only its durability is in doubt
            return e
        return None

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the store in {self.directory} is closed")

    def _pending(self, key: bytes) -> _Entry | None:
        if key in self._staged:
            return self._staged[key]
        return self._committed.get(key)

    def _visible(self, key: bytes) -> _Entry | None:
        return self._pending(key) if self.read_staged else self._committed.get(key)

    def _visible_items(self) -> list[tuple[bytes, _Entry]]:
        return self._pending_items() if self.read_staged else list(self._committed.items())

    def _pending_items(self) -> list[tuple[bytes, _Entry]]:
        out = [(k, e) for k, e in self._committed.items() if k not in self._staged]
        out += [(k, e) for k, e in self._staged.items() if e is not None]
        return out

    def _disk_bytes(self) -> int:
        return sum(self._seg_sizes.values()) + self._manifest_size

    def _aad(self, seg: int, key: bytes) -> bytes:
        return _AAD_PREFIX + seg.to_bytes(8, "little") + key

    def _record_id(self, key: bytes) -> bytes:
        """What a record's header carries: its key (plain store) or HMAC(id key, key)."""
        return key if self._keys is None else self._keys.record_id(key)

    def _record_len(self, key: bytes, payload_len: int) -> int:
        if self._keys is None:
            return _HEADER.size + len(key) + payload_len + _TRAILER.size
        return _HEADER.size + _ID_LEN + payload_len + _TAG_LEN + _TRAILER.size

    def _build_record(self, seg: int, key: bytes, payload: memoryview) -> tuple[bytes, int]:
        rid = self._record_id(key)
        if self._keys is not None:
            nonce = os.urandom(_NONCE_LEN)
            body = self._keys.records.encrypt(nonce, payload, self._aad(seg, key))
            flags = _FLAG_ENCRYPTED
        else:
            nonce, body, flags = _ZERO_NONCE, payload, 0
        header = _HEADER.pack(_MAGIC, _VERSION, flags, self._hasher.algo_id, 0, len(rid),
                              len(body), nonce)
        csum = self._hasher.digest(header, rid, body)
        return b"".join((header, rid, body, _TRAILER.pack(csum))), csum

    def _new_appender(self) -> _Appender:
        seg = self._next_seg
        path = self._path(_seg_name(seg))
        try:
            # O_APPEND: after a rollback ftruncate the next write lands at the new end, no hole.
            fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        except OSError as e:
            raise _os_error(e, f"creating {_seg_name(seg)}") from e
        self._next_seg += 1
        self._new_files = True
        self._seg_sizes[seg] = 0
        return _Appender(seg, fd)

    def _append(self, app: _Appender, buf: bytes) -> int:
        """Append ``buf``; on failure truncate the partial record away. Returns its offset."""
        start = app.size
        try:
            _write_all(app.fd, buf)
        except OSError as e:
            try:
                os.ftruncate(app.fd, start)
            except OSError:
                # Cannot undo: the tail is garbage but unreferenced; never append here again.
                app.size = os.fstat(app.fd).st_size
                self._seg_sizes[app.seg] = app.size
                if self._writer is app:
                    self._writer = None
            raise _os_error(e, f"appending to {_seg_name(app.seg)}") from e
        app.size += len(buf)
        self._seg_sizes[app.seg] = app.size
        return start

    def _reader(self, seg: int) -> _Reader | None:
        r = self._readers.get(seg)
        if r is None:
            try:
                fd = os.open(self._path(_seg_name(seg)), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            r = self._readers[seg] = _Reader(fd)
        return r

    def _read(self, key: bytes, e: _Entry) -> bytes:
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
        rid = self._record_id(key)
        min_len = _HEADER.size + len(rid) + _TRAILER.size
        if e.length < min_len:
            raise bad("the manifest gives it an impossible length")
        with memoryview(r.mm) as mv:
            rec = mv[e.off:end]
            try:
                magic, version, flags, algo, _res, klen, blen, nonce = _HEADER.unpack_from(rec)
                if magic != _MAGIC or version != _VERSION:
                    raise bad("bad record header (magic/version)")
                if klen != len(rid) or _HEADER.size + klen + blen + _TRAILER.size != e.length:
                    raise bad("bad record header (lengths)")
                if algo != self._hasher.algo_id:
                    raise bad("bad record header (checksum algorithm)")
                body_end = _HEADER.size + klen + blen
                (stored,) = _TRAILER.unpack_from(rec, body_end)
                actual = self._hasher.digest(rec[:body_end])
                if actual != stored or stored != e.csum:
                    raise bad("checksum mismatch")
                if rec[_HEADER.size:_HEADER.size + klen] != rid:
                    raise bad("the record holds another key")
                body = rec[_HEADER.size + klen:body_end]
                encrypted = bool(flags & _FLAG_ENCRYPTED)
                if encrypted != (self._keys is not None):
                    raise bad("encryption flag does not match the store")
                if self._keys is None:
                    return bytes(body)
                from cryptography.exceptions import InvalidTag
                try:
                    return self._keys.records.decrypt(nonce, body, self._aad(e.seg, key))
                except InvalidTag:
                    raise bad("authentication failed (wrong key, or the record was tampered "
                              "with)") from None
            finally:
                rec.release()

    def _get_verified(self, key: bytes, e: _Entry) -> bytes:
        try:
            return self._read(key, e)
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
        if not 0 < len(key) <= _MAX_KEY_LEN:
            raise ValueError(f"key must be 1..{_MAX_KEY_LEN} bytes, got {len(key)}")
        body = _as_bytes_view(payload)
        meta = _check_meta(meta)
        with self._lock:
            self._check_open()
            rec_len = self._record_len(key, body.nbytes)
            est = 2 * len(key) + len(_canonical(meta)) + 96  # its manifest entry, roughly
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
            self._staged[key] = _Entry(w.seg, off, len(buf), csum, meta)
            self._staged_manifest_est += est

    def delete(self, key: bytes) -> None:
        """Stage the removal of ``key``: dropped from the manifest at the next commit."""
        key = bytes(key)
        with self._lock:
            self._check_open()
            if self._pending(key) is None:
                raise UnknownRecordError(f"no record {_show_key(key)} to delete")
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
        changes = _check_meta(changes)
        with self._lock:
            self._check_open()
            e = self._pending(key)
            if e is None:
                raise UnknownRecordError(f"no record {_show_key(key)} to update")
            self._staged[key] = _Entry(e.seg, e.off, e.length, e.csum, {**e.meta, **changes})

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
                raise _os_error(e, "fsyncing segments (staged puts were dropped)") from e
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
                    _fsync_dir(self.directory)
                except OSError as e:
                    raise _os_error(e, "fsyncing the directory") from e
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
                raise _os_error(late, "fsyncing the directory after the manifest rename") from late

    def _drop_staged_puts(self) -> None:
        """Forget staged records whose bytes are not known durable (meta updates of committed
        bytes and deletes stay staged)."""
        def durable(e: _Entry) -> bool:
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
            live = self._pending_items()
            new_apps: list[_Appender] = []
            records: dict[bytes, _Entry] = {}
            dropped = 0
            seg_sizes_before = dict(self._seg_sizes)
            try:
                app = None
                for key, e in live:
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
                    records[key] = _Entry(app.seg, off, len(buf), csum, e.meta)
                for a in new_apps:
                    os.fsync(a.fd)
                _fsync_dir(self.directory)
                segs = {a.seg: a.size for a in new_apps}
                late = self._write_manifest(self._manifest_bytes(
                    records, segs, self._generation + 1, self._next_seg))
            except BaseException as exc:
                for a in new_apps:
                    os.close(a.fd)
                    _unlink_quiet(self._path(_seg_name(a.seg)))
                self._seg_sizes = seg_sizes_before
                if isinstance(exc, OSError) and not isinstance(exc, StoreError):
                    raise _os_error(exc, "compacting") from exc
                raise
            # The new manifest is on disk: publish it, then the old segments are garbage.
            for a in new_apps:
                os.close(a.fd)
            old = set(self._seg_sizes) - set(segs)
            for r in self._readers.values():
                r.close()
            self._readers.clear()
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
            if late is not None:
                raise _os_error(late, "fsyncing the directory after compaction") from late
            try:
                for seg in old:
                    _unlink_quiet(self._path(_seg_name(seg)))
                _fsync_dir(self.directory)
            except OSError:
                pass  # harmless: open() deletes segments the manifest does not list

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
                raise UnknownRecordError(f"no record {_show_key(key)}")
            return self._get_verified(key, e)

    def meta(self, key: bytes) -> dict:
        """A copy of the meta of ``key``."""
        key = bytes(key)
        with self._lock:
            self._check_open()
            e = self._visible(key)
            if e is None:
                raise UnknownRecordError(f"no record {_show_key(key)}")
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
        for r in self._readers.values():
            r.close()
        self._readers.clear()
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


def _take_lock(directory: str, timeout_s: float) -> int:
    """flock the directory's LOCK file (0600): two stores appending to one directory would
    corrupt it. Waits at most ``timeout_s`` for another holder (a process of the node that
    is still finishing), then ``StoreLockedError``.

    The kernel drops the lock when the holder dies (kill -9 included), so no stale lock files.
    """
    try:
        return lock_within(os.path.join(directory, _LOCK), timeout_s, "the cache store")
    except LockTimeoutError as e:
        raise StoreLockedError(f"{directory} is in use by another SegmentStore: {e}") from None


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
