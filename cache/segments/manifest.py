"""The segment store's manifest: the committed state (per record key its segment, offset,
length, checksum and meta; the segments' committed lengths; the generation), as canonical JSON
with its own SHA-256, the record map sealed with AES-256-GCM in an encrypted store, and replaced
atomically and durably (temp file + fsync + rename + directory fsync)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass

from cache.fsperm import open_private
from cache.segments.directory import MANIFEST, MANIFEST_TMP, fsync_dir, unlink_quiet, write_all
from cache.segments.errors import CorruptManifestError, OldFormatError, StoreError, WrongKeyError, os_error
from cache.segments.record import NONCE_LEN, Entry, Keys, check_meta

__all__ = ["Manifest", "bad_manifest", "canonical", "decode_manifest", "encode_manifest",
           "manifest_bytes", "parse_manifest", "read_manifest", "write_manifest"]

FORMAT = "fedkv-segments"
MANIFEST_VERSION = 2  # 2: encrypted stores seal the record map, keyed record ids
SUM_FIELD = "manifest_sha256"
MANIFEST_AAD = b"fedkv-manifest-v2\0"


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def bad_manifest(what: str, directory: str, cls: type[CorruptManifestError] = CorruptManifestError
                 ) -> CorruptManifestError:
    return cls(f"{what}; the committed state cannot be trusted: call "
               f"SegmentStore.wipe({directory!r}) to start over")


def encode_manifest(body: dict, keys: Keys | None) -> bytes:
    """The manifest file: ``body`` in the clear (a plain store) or sealed with AES-256-GCM
    (an encrypted one: record keys, sizes and meta are unreadable without the key), plus a
    SHA-256 over the canonical JSON that detects damage without the key."""
    outer = {"format": FORMAT, "version": MANIFEST_VERSION, "encrypted": keys is not None}
    if keys is None:
        outer.update(body)
    else:
        nonce = os.urandom(NONCE_LEN)
        sealed = keys.manifest.encrypt(nonce, canonical(body),
                                       MANIFEST_AAD + bytes.fromhex(keys.check))
        outer.update(key_check=keys.check, nonce=nonce.hex(),
                     sealed=base64.b64encode(sealed).decode("ascii"))
    outer[SUM_FIELD] = hashlib.sha256(canonical(outer)).hexdigest()
    return canonical(outer)


def decode_manifest(raw: bytes, keys: Keys | None, path: str, directory: str) -> dict:
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
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise bad(f"{path} is not a {FORMAT} manifest")
    stored = obj.pop(SUM_FIELD, None)
    if not isinstance(stored, str):
        raise bad(f"{path} has no {SUM_FIELD} field")
    if hashlib.sha256(canonical(obj)).hexdigest() != stored:
        raise bad(f"{path} fails its checksum: the content was modified or partially written")
    version = obj.get("version")
    if isinstance(version, int) and version < MANIFEST_VERSION:
        raise bad(f"{path} is on-disk format version {version} (record ids and the record map "
                  f"readable without the key); this code writes version {MANIFEST_VERSION}",
                  OldFormatError)
    if version != MANIFEST_VERSION:
        raise StoreError(f"{path} has manifest version {version!r}; this code reads version "
                         f"{MANIFEST_VERSION} (a newer fedkv wrote it?)")
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
        inner = keys.manifest.decrypt(nonce, sealed, MANIFEST_AAD + bytes.fromhex(keys.check))
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
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    return decode_manifest(raw, Keys(bytes(key)) if key is not None else None, path, directory)


@dataclass
class Manifest:
    """A manifest's body, parsed."""

    checksum: str
    generation: int
    next_segment: int
    segments: dict[int, int]
    """Segment -> committed length."""
    records: dict[bytes, Entry]


def parse_manifest(raw: bytes, keys: Keys | None, path: str, directory: str) -> Manifest:
    """Decode and check the manifest file's bytes (``CorruptManifestError`` and kin)."""
    obj = decode_manifest(raw, keys, path, directory)
    try:
        algo = obj["checksum"]
        generation = int(obj["generation"])
        next_seg = int(obj["next_segment"])
        segs = {int(s): int(n) for s, n in obj["segments"].items()}
        records = {}
        for khex, r in obj["records"].items():
            records[bytes.fromhex(khex)] = Entry(int(r["seg"]), int(r["off"]), int(r["len"]),
                                                 int(r["sum"], 16), check_meta(r["meta"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise bad_manifest(f"{path} passes its checksum but is malformed: {e!r}", directory) from None
    return Manifest(algo, generation, next_seg, segs, records)


def manifest_bytes(checksum: str, records: dict[bytes, Entry], segs: dict[int, int],
                   generation: int, next_seg: int, keys: Keys | None) -> bytes:
    return encode_manifest({
        "checksum": checksum,
        "generation": generation,
        "next_segment": next_seg,
        "segments": {str(s): n for s, n in segs.items()},
        "records": {k.hex(): e.to_json() for k, e in records.items()},
    }, keys)


def write_manifest(directory: str, data: bytes) -> OSError | None:
    """temp file + fsync + rename + fsync(dir): the manifest is replaced atomically and durably.

    Raises (old manifest still in place) for a failure before the rename. A failure of the
    directory fsync after it is *returned*: the new manifest is already the one on disk, so
    the caller must publish the new state first and raise afterwards.
    """
    tmp = os.path.join(directory, MANIFEST_TMP)
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    except OSError as e:
        raise os_error(e, "creating the manifest") from e
    try:
        write_all(fd, data)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        unlink_quiet(tmp)
        raise os_error(e, "writing the manifest") from e
    os.close(fd)
    try:
        os.replace(tmp, os.path.join(directory, MANIFEST))
    except OSError as e:
        unlink_quiet(tmp)
        raise os_error(e, "renaming the manifest") from e
    try:
        fsync_dir(directory)
    except OSError as e:  # the new manifest is in place; only its durability is in doubt
        return e
    return None
