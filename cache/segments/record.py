"""The on-disk record: ``header | record id | stored payload | checksum``.

The header (``HEADER``) holds magic, version, flags, checksum algorithm, a reserved byte, the
record id's length, the stored payload's length and the nonce. The record id is the record key
in a plain store and ``HMAC-SHA256(id key, record key)`` in an encrypted one, whose payload is
sealed with AES-256-GCM (a fresh nonce; the record key and segment id as associated data). The
trailing 64-bit checksum (xxh3-64 or BLAKE2b-64, fixed per store) covers everything before it.
``Keys`` derives the record, record-id and manifest keys from the store's key (HKDF-SHA256).
``SegmentReaders`` reads records back, verified, through one mmap per segment.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import mmap
import os
import struct
from dataclasses import dataclass

from cache.segments.directory import seg_name
from cache.segments.errors import CorruptBlockError, StoreError

try:  # optional: ~10x faster than BLAKE2b; recorded per store so a reader knows which one
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

__all__ = ["Entry", "Hasher", "Keys", "MAX_KEY_LEN", "SegmentReaders", "as_bytes_view", "build_record",
           "check_meta", "default_algo", "parse_record", "record_len"]

MAGIC = b"FKVR"
VERSION = 2  # 2: an encrypted store's record carries its keyed id, not its key
# magic, version, flags, checksum algorithm, reserved, key length, stored payload length, nonce
HEADER = struct.Struct("<4sBBBBIQ12s")
TRAILER = struct.Struct("<Q")  # 64-bit checksum over header + key + stored payload
FLAG_ENCRYPTED = 1
NONCE_LEN = 12
TAG_LEN = 16
ZERO_NONCE = bytes(NONCE_LEN)
MAX_KEY_LEN = 4096
AAD_PREFIX = b"fedkv-seg-v1\0"
KDF_INFO = b"fedkv-segments-v2 "
ID_LEN = 32  # HMAC-SHA256

ALGOS = {"xxh3_64": 1, "blake2b_64": 2}


class Hasher:
    """The per-store record checksum: xxh3-64 or BLAKE2b-64, as an int."""

    def __init__(self, name: str) -> None:
        if name not in ALGOS:
            raise StoreError(f"unknown record checksum {name!r} (known: {sorted(ALGOS)})")
        if name == "xxh3_64" and xxhash is None:
            raise StoreError("this store's records use xxh3_64 checksums but the xxhash package "
                             "is not installed; install xxhash to read it")
        self.name = name
        self.algo_id = ALGOS[name]

    def digest(self, *parts) -> int:
        if self.name == "xxh3_64":
            h = xxhash.xxh3_64()
        else:
            h = hashlib.blake2b(digest_size=8)
        for p in parts:
            h.update(p)
        return int.from_bytes(h.digest(), "big")


def default_algo() -> str:
    return "xxh3_64" if xxhash is not None else "blake2b_64"


def as_bytes_view(payload) -> memoryview:
    mv = memoryview(payload)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")  # raises TypeError for a non-contiguous buffer
    return mv


def check_meta(meta) -> dict:
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


class Keys:
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
                        info=KDF_INFO + purpose).derive(key)

        self.records = AESGCM(key)
        self._id_key = derive(b"record id")
        self.manifest = AESGCM(derive(b"manifest"))
        self.check = derive(b"key check")[:16].hex()

    def record_id(self, key: bytes) -> bytes:
        return hmac.new(self._id_key, key, hashlib.sha256).digest()


@dataclass(slots=True)
class Entry:
    seg: int
    off: int
    length: int
    csum: int
    meta: dict

    def to_json(self) -> dict:
        return {"seg": self.seg, "off": self.off, "len": self.length,
                "sum": f"{self.csum:016x}", "meta": self.meta}


def record_len(keys: Keys | None, key: bytes, payload_len: int) -> int:
    """Bytes a record of ``payload_len`` payload bytes under ``key`` takes in its segment."""
    if keys is None:
        return HEADER.size + len(key) + payload_len + TRAILER.size
    return HEADER.size + ID_LEN + payload_len + TAG_LEN + TRAILER.size


def record_id(keys: Keys | None, key: bytes) -> bytes:
    """What a record's header carries: its key (plain store) or HMAC(id key, key)."""
    return key if keys is None else keys.record_id(key)


def record_aad(seg: int, key: bytes) -> bytes:
    return AAD_PREFIX + seg.to_bytes(8, "little") + key


def build_record(keys: Keys | None, hasher: Hasher, seg: int, key: bytes,
                 payload: memoryview) -> tuple[bytes, int]:
    """The record's bytes for segment ``seg`` and its checksum."""
    rid = record_id(keys, key)
    if keys is not None:
        nonce = os.urandom(NONCE_LEN)
        body = keys.records.encrypt(nonce, payload, record_aad(seg, key))
        flags = FLAG_ENCRYPTED
    else:
        nonce, body, flags = ZERO_NONCE, payload, 0
    header = HEADER.pack(MAGIC, VERSION, flags, hasher.algo_id, 0, len(rid), len(body), nonce)
    csum = hasher.digest(header, rid, body)
    return b"".join((header, rid, body, TRAILER.pack(csum))), csum


def parse_record(rec: memoryview, key: bytes, e: Entry, keys: Keys | None, hasher: Hasher) -> bytes:
    """Verify the record ``rec`` (the ``e.length`` bytes at ``e.off`` of segment ``e.seg``) as
    the one ``e`` names for ``key`` and return its payload; ``CorruptBlockError`` otherwise."""
    def bad(reason: str) -> CorruptBlockError:
        return CorruptBlockError(key, reason, segment=e.seg, offset=e.off)

    rid = record_id(keys, key)
    magic, version, flags, algo, _res, klen, blen, nonce = HEADER.unpack_from(rec)
    if magic != MAGIC or version != VERSION:
        raise bad("bad record header (magic/version)")
    if klen != len(rid) or HEADER.size + klen + blen + TRAILER.size != e.length:
        raise bad("bad record header (lengths)")
    if algo != hasher.algo_id:
        raise bad("bad record header (checksum algorithm)")
    body_end = HEADER.size + klen + blen
    (stored,) = TRAILER.unpack_from(rec, body_end)
    actual = hasher.digest(rec[:body_end])
    if actual != stored or stored != e.csum:
        raise bad("checksum mismatch")
    if rec[HEADER.size:HEADER.size + klen] != rid:
        raise bad("the record holds another key")
    body = rec[HEADER.size + klen:body_end]
    encrypted = bool(flags & FLAG_ENCRYPTED)
    if encrypted != (keys is not None):
        raise bad("encryption flag does not match the store")
    if keys is None:
        return bytes(body)
    from cryptography.exceptions import InvalidTag
    try:
        return keys.records.decrypt(nonce, body, record_aad(e.seg, key))
    except InvalidTag:
        raise bad("authentication failed (wrong key, or the record was tampered with)") from None


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
