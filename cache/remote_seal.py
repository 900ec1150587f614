"""Records for a store outside the node (the Redis tier, ``cache/redis_store.py``): keyed ids
and sealed values, the sibling of the segment store's at-rest format (``cache/segments/record.py``).

Why keyed: a block's record key is its chained content hash (``cache/prefix.py``), computable
from a guessed prompt, so a store whose operator saw it could confirm the guess. Here the
store's key of a record is ``HMAC-SHA256(id key, namespace digest | record key)`` and its value
``MAGIC | version | nonce | AES-256-GCM(meta length | meta JSON | payload)`` with
``AAD = prefix | namespace digest | record key``: a value moved to another key, another
namespace (model, adapter, node) or sealed by another node fails its tag. Both keys come from
the node's 32-byte cache key by HKDF-SHA256 (infos of their own, unlike the local store's), so
a record id of this tier never equals one of the node's disk.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct

MAGIC = b"FKVS"
VERSION = 1
HEAD = struct.Struct("<4sB12s")  # magic, version, nonce
META_LEN = struct.Struct("<I")
NONCE_LEN = 12
AAD_PREFIX = b"fedkv-remote-v1\0"
KDF_INFO = b"fedkv-remote-v1 "


class RecordRejected(ValueError):
    """A value that is not this node's record for this key: corrupt, moved or foreign. The
    message carries no key material and no secret-dependent number."""


class RemoteKeys:
    """What the Redis tier derives from the node's key for one ``namespace``."""

    __slots__ = ("_aead", "_id_key", "_ns")

    def __init__(self, key: bytes, namespace: bytes) -> None:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        key = bytes(key)
        if len(key) != 32:
            raise ValueError(f"the Redis tier needs the node's 32-byte cache key, got {len(key)} bytes")
        if not namespace:
            raise ValueError("the Redis tier needs a namespace (node, model, adapter version): "
                             "records of different weights must never meet")

        def derive(purpose: bytes) -> bytes:
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                        info=KDF_INFO + purpose).derive(key)

        self._aead = AESGCM(derive(b"record"))
        self._id_key = derive(b"record id")
        self._ns = hashlib.sha256(b"fedkv-remote-ns\0" + bytes(namespace)).digest()

    def record_id(self, key: bytes) -> bytes:
        """The store's key of record ``key``: one-way without the node's key."""
        return hmac.new(self._id_key, self._ns + key, hashlib.sha256).digest()

    def _aad(self, key: bytes) -> bytes:
        return AAD_PREFIX + self._ns + key

    def seal(self, key: bytes, payload: bytes, meta: dict) -> bytes:
        m = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        nonce = os.urandom(NONCE_LEN)
        body = self._aead.encrypt(nonce, META_LEN.pack(len(m)) + m + bytes(payload), self._aad(key))
        return HEAD.pack(MAGIC, VERSION, nonce) + body

    def open(self, key: bytes, value: bytes) -> tuple[bytes, dict]:
        """(payload, meta) of the value stored for ``key``; ``RecordRejected`` otherwise."""
        from cryptography.exceptions import InvalidTag
        if len(value) < HEAD.size + 16:
            raise RecordRejected("a Redis record is too short to be one of this node's")
        magic, version, nonce = HEAD.unpack_from(value)
        if magic != MAGIC or version != VERSION:
            raise RecordRejected("a Redis record has an unknown header (not this tier's format)")
        try:
            plain = self._aead.decrypt(nonce, value[HEAD.size:], self._aad(key))
        except InvalidTag:
            raise RecordRejected("a Redis record failed authentication (corrupt, moved to "
                                 "another key, or sealed with another node's key)") from None
        (n,) = META_LEN.unpack_from(plain)
        meta = json.loads(plain[META_LEN.size:META_LEN.size + n])
        return plain[META_LEN.size + n:], meta
