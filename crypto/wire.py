"""Byte format of an encrypted update / aggregate.

    header (60 bytes, big-endian)
      magic "FKV\\x01" | kind u8 (1 update, 2 aggregate) | mode u8 (0 none, 1 packed) | flags u16 (0)
      key_id 16s | packing fingerprint 8s | layout digest 8s (zeros: none given)
      n_values u64 | n_updates u32 | n_ciphertexts u32
    then n_ciphertexts x (length u32 | SEAL ciphertext bytes)

n_updates is, in an update, the contributions it carries (1; m for a node's reply of m noise
shares, so the server's headroom check counts them) and, in an aggregate, the updates summed.
Everything the server may learn is in the header; weights, counts and values are encrypted.
Parsing is strict (exact length, bounded counts) so truncated, padded or random bytes are
refused before SEAL sees them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from crypto.errors import NotACiphertextError

__all__ = ["Envelope", "ENVELOPE_UPDATE", "ENVELOPE_AGGREGATE", "MODE_CODES", "pack_envelope", "parse_envelope"]

MAGIC = b"FKV\x01"
# The envelope's kind byte: what the ciphertext bytes are (one node's update, or the server's sum).
# Not the contribution kinds of ``crypto.binding`` (update or noise share), which label MACs and
# signatures; those are other numbers for another fact.
ENVELOPE_UPDATE = 1
ENVELOPE_AGGREGATE = 2
MODE_CODES = {"none": 0, "packed": 1}
_HDR = struct.Struct(">4sBBH16s8s8sQII")
_LEN = struct.Struct(">I")
NO_LAYOUT = b"\x00" * 8


@dataclass(frozen=True)
class Envelope:
    kind: int
    mode: int
    key_id: bytes
    packing_fp: bytes
    layout_fp: bytes
    n_values: int
    n_updates: int
    ciphertexts: tuple[bytes, ...]


def pack_envelope(env: Envelope) -> bytes:
    out = [
        _HDR.pack(
            MAGIC,
            env.kind,
            env.mode,
            0,
            env.key_id,
            env.packing_fp,
            env.layout_fp,
            env.n_values,
            env.n_updates,
            len(env.ciphertexts),
        )
    ]
    for ct in env.ciphertexts:
        out.append(_LEN.pack(len(ct)))
        out.append(ct)
    return b"".join(out)


def parse_envelope(data: bytes, *, max_ciphertext_bytes: int) -> Envelope:
    """Strictly parse; NotACiphertextError on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise NotACiphertextError(f"expected bytes, got {type(data).__name__}")
    data = memoryview(data)
    if len(data) < _HDR.size:
        raise NotACiphertextError(f"too short for a fedkv ciphertext ({len(data)} bytes)")
    magic, kind, mode, flags, key_id, pfp, lfp, n_values, n_updates, n_ct = _HDR.unpack_from(data, 0)
    if magic != MAGIC:
        raise NotACiphertextError("not a fedkv ciphertext (bad magic)")
    if kind not in (ENVELOPE_UPDATE, ENVELOPE_AGGREGATE) or mode not in MODE_CODES.values() or flags != 0:
        raise NotACiphertextError(f"bad header fields (kind={kind}, mode={mode}, flags={flags})")
    if n_ct == 0 or n_ct > (len(data) - _HDR.size) // (_LEN.size + 1):
        raise NotACiphertextError(f"ciphertext count {n_ct} does not fit the {len(data)} bytes given")
    pos = _HDR.size
    cts = []
    for i in range(n_ct):
        if pos + _LEN.size > len(data):
            raise NotACiphertextError(f"truncated before ciphertext {i}")
        (ln,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if ln == 0 or ln > max_ciphertext_bytes or pos + ln > len(data):
            raise NotACiphertextError(f"ciphertext {i}: bad length {ln} (truncated or oversized)")
        cts.append(bytes(data[pos : pos + ln]))
        pos += ln
    if pos != len(data):
        raise NotACiphertextError(f"{len(data) - pos} trailing bytes after the last ciphertext")
    return Envelope(kind, mode, bytes(key_id), bytes(pfp), bytes(lfp), n_values, n_updates, tuple(cts))
