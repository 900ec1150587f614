"""Byte framing shared by fedkv's signed formats: length-prefixed fields and a strict reader.

Used by ``crypto.signing`` (node key files, signed updates) and ``crypto.key_wrap`` (key
bundles, signed public contexts): every field is length-prefixed, so concatenations are
unambiguous, and a reader refuses truncated, oversized or trailing bytes with the caller's error.
"""

from __future__ import annotations

import struct

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

__all__ = ["Reader", "lp", "pub_raw"]

_RAW = serialization.Encoding.Raw
_RAW_PUB = serialization.PublicFormat.Raw


def pub_raw(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    return key.public_bytes(_RAW, _RAW_PUB)


def lp(b: bytes) -> bytes:
    """Length-prefixed field, so concatenated fields are unambiguous."""
    return struct.pack(">I", len(b)) + b


class Reader:
    """Reads length-prefixed fields of one `what`; raises `error` on truncated, oversized or trailing bytes."""

    def __init__(self, data: bytes, what: str, error: type[Exception]) -> None:
        self.data, self.pos, self.what, self.error = memoryview(data), 0, what, error

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.error(f"truncated {self.what}")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def lp(self, limit: int = 1 << 31) -> bytes:
        (n,) = self.unpack(">I")
        if n > limit:
            raise self.error(f"oversized field in {self.what}")
        return self.take(n)

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.error(f"trailing bytes after {self.what}")
