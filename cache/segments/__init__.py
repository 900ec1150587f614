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

The package, one responsibility a module: ``directory.py`` (file names, durable-write helpers,
the lock, wiping, reconciling the files with the manifest on open), ``errors.py``, ``record.py``
(the record format: header, checksum, sealing, the derived keys; verified mmap reads),
``manifest.py`` (the manifest's encoding, sealing and atomic replacement) and ``store.py``
(``SegmentStore``: staging, commit, compaction, reads). It imports
only the standard library, ``cryptography`` (when a key is given) and, optionally, ``xxhash``;
its only imports from ``cache`` outside it are ``cache.errors`` and ``cache.fsperm``.
"""

from cache.segments.errors import (
    CorruptBlockError, CorruptManifestError, OldFormatError, StoreError, StoreFullError,
    StoreLockedError, UnknownRecordError, WrongKeyError,
)
from cache.segments.manifest import read_manifest
from cache.segments.store import SegmentStore

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
    "read_manifest",
]
