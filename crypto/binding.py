"""Aggregate binding: a node decrypts only an aggregate that is the sum of this round's tagged updates.

Why: a server that can hand a node any ciphertext and watch whether it is accepted (or how the
model it yields behaves) has a decryption oracle: the Li–Micciancio IND-CPA-D attack recovers
CKKS decryption noise, then the secret key, from such answers. Signatures do not help (the
server adds ciphertexts; the sum is signed by nobody), and TenSEAL has no verifiable computation.

How: a linear MAC over the ciphertext coefficients mod q0, keyed with ``CkksContext.mac_key``
(derived from the secret key, so every node has it and the server does not). For round ``rho``
each node tags each ciphertext vector it contributes:

    t_i = <r_rho, c_i> + p_(rho, i)   (mod q0)

with ``r_rho`` (one per tag word) and the pad ``p_(rho, i)`` drawn from SHAKE-256 of the key and
(run, round, epoch[, node, kind]). Addition of ciphertexts is addition of their coefficients mod
q0, so for the honest sum ``A = sum c_i``: ``<r_rho, A> = sum (t_i - p_(rho, i))``. The pads are
uniform and unknown to the server, so the tags it sees are independent of ``r_rho``; any other
ciphertext ``A' != A`` satisfies the check with probability <= 2^-56 per word (``WORDS`` = 2 words:
<= 2^-112), scalings and subsets of the round's updates included (a subset must be announced as
such in the manifest, and then it is the honest sum of that subset). The check runs before
decryption, so accept/reject never depends on the secret key's noise.

Cost: one pass over the coefficients per tag or check (2 x N values per ciphertext).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crypto.errors import NotACiphertextError

__all__ = ["WORDS", "KIND_UPDATE", "KIND_NOISE", "AggregateMac", "ManifestEntry", "Manifest"]

WORDS = 2
KIND_UPDATE, KIND_NOISE = 0, 1
_R_BITS = 56
_DOMAIN = b"fedkv-aggregate-mac-v1"


def coefficients(ciphertexts: Sequence[Any]) -> np.ndarray:
    """All coefficients of SEAL ciphertexts (each reduced mod q0), concatenated, as uint64.

    Read from SEAL's own serialization (``_raw_coefficients``): one pybind call per
    coefficient (``DynArray.at``) cost ~3 ms per ciphertext, 0.1 s per node per round on ``lm``.
    """
    out = [_raw_coefficients(ct) for ct in ciphertexts]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)


def _slow_coefficients(ct: Any) -> np.ndarray:
    arr = ct.dyn_array()
    return np.fromiter((arr.at(i) for i in range(arr.size())), dtype=np.uint64, count=arr.size())


_SEAL_MAGIC = b"\x5e\xa1"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_COMPR_NONE, _COMPR_ZSTD = 0, 2


def _raw_coefficients(ct: Any) -> np.ndarray:
    """A ciphertext's coefficients from ``seal_save`` bytes: SEAL ends a ciphertext with its data
    array, raw; zstd keeps incompressible (uniform mod q) data in raw blocks, which are read
    here without a zstd library. Any other layout (a compressed block) takes the slow path, and
    two sampled coefficients are compared with ``DynArray.at`` so a misread cannot pass."""
    from crypto.context import seal_save

    arr = ct.dyn_array()
    n = int(arr.size())
    body = _seal_body(seal_save(ct))
    if body is None or len(body) < 8 * n:
        return _slow_coefficients(ct)
    out = np.frombuffer(body, dtype="<u8", count=n, offset=len(body) - 8 * n).copy()
    for i in (0, n - 1):
        if int(out[i]) != int(arr.at(i)):
            return _slow_coefficients(ct)
    return out


def _seal_body(blob: bytes) -> bytes | None:
    """The uncompressed members of a SEAL-serialized object, or None when not readable here."""
    if len(blob) < 16 or blob[:2] != _SEAL_MAGIC:
        return None
    compr = blob[5]
    if compr == _COMPR_NONE:
        return blob[16:]
    if compr != _COMPR_ZSTD or blob[16:20] != _ZSTD_MAGIC:
        return None
    return _zstd_raw_frame(memoryview(blob)[20:])


def _zstd_raw_frame(frame: memoryview) -> bytes | None:
    """Content of a zstd frame made only of raw blocks (RFC 8878, 3.1.1); None otherwise."""
    if len(frame) < 1:
        return None
    fhd = frame[0]
    fcs_flag, single, checksum, dict_id = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    pos = 1 + (0 if single else 1) + (0, 1, 2, 4)[dict_id]
    pos += (1 if single else 0, 2, 4, 8)[fcs_flag]
    parts = []
    while True:
        if pos + 3 > len(frame):
            return None
        hdr = int.from_bytes(frame[pos : pos + 3], "little")
        last, btype, size = hdr & 1, (hdr >> 1) & 3, hdr >> 3
        pos += 3
        if btype != 0 or pos + size > len(frame):
            return None  # RLE or compressed block: not ours to decode
        parts.append(bytes(frame[pos : pos + size]))
        pos += size
        if last:
            break
    return b"".join(parts) if pos + 4 * checksum == len(frame) else None


def _mod_sum(x: np.ndarray, q: int) -> int:
    """sum(x) mod q for x < 2^60 and q < 2^60 without overflow: sums of 8 values < 2^60 stay
    below 2^63, reduced mod q and summed again until one value is left (vectorized: a Python loop over the
    partial sums cost ~10 ms per tag on ``lm``)."""
    qq = np.uint64(q)
    x = np.asarray(x, dtype=np.uint64)
    while x.shape[0] > 1:
        pad = (-x.shape[0]) % 8
        if pad:
            x = np.concatenate([x, np.zeros(pad, dtype=np.uint64)])
        x = x.reshape(-1, 8).sum(axis=1, dtype=np.uint64) % qq
    return int(x[0]) % q if x.shape[0] else 0


def _inner(c: np.ndarray, r: np.ndarray, q: int) -> int:
    """<c, r> mod q for c < 2^60, r < 2^56, by 30/28-bit halves (every product < 2^58)."""
    c_lo, c_hi = c & np.uint64((1 << 30) - 1), c >> np.uint64(30)
    r_lo, r_hi = r & np.uint64((1 << 28) - 1), r >> np.uint64(28)
    hh = _mod_sum(c_hi * r_hi, q)
    hl = _mod_sum(c_hi * r_lo, q)
    lh = _mod_sum(c_lo * r_hi, q)
    ll = _mod_sum(c_lo * r_lo, q)
    return (hh * (1 << 58) + hl * (1 << 30) + lh * (1 << 28) + ll) % q


@dataclass(frozen=True)
class ManifestEntry:
    """One summand of an aggregate: who made it, what it is, and its tag."""

    node_id: str
    kind: int
    tag: bytes


@dataclass(frozen=True)
class Manifest:
    """What the server says an aggregate sums: round, key epoch and one entry per summand."""

    run_id: int
    round: int
    epoch: int
    entries: tuple[ManifestEntry, ...]

    def to_bytes(self) -> bytes:
        out = [b"FKM\x01", struct.pack(">QQII", self.run_id, self.round, self.epoch, len(self.entries))]
        for e in self.entries:
            nid = e.node_id.encode()
            out.append(struct.pack(">HB", len(nid), e.kind) + nid + struct.pack(">H", len(e.tag)) + e.tag)
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            if data[:4] != b"FKM\x01":
                raise ValueError("bad magic")
            run_id, rnd, epoch, n = struct.unpack_from(">QQII", data, 4)
            if n > 4096:
                raise ValueError("too many entries")
            pos, entries = 28, []
            for _ in range(n):
                ln, kind = struct.unpack_from(">HB", data, pos)
                nid = data[pos + 3 : pos + 3 + ln].decode()
                pos += 3 + ln
                (tl,) = struct.unpack_from(">H", data, pos)
                tag = bytes(data[pos + 2 : pos + 2 + tl])
                if len(tag) != tl:
                    raise ValueError("truncated")
                pos += 2 + tl
                entries.append(ManifestEntry(nid, kind, tag))
            if pos != len(data):
                raise ValueError("trailing bytes")
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            raise NotACiphertextError("malformed aggregate manifest") from exc
        return cls(run_id, rnd, epoch, tuple(entries))


class AggregateMac:
    """Tags ciphertext vectors and checks aggregates against a manifest (see the module doc)."""

    def __init__(self, key: bytes, q: int) -> None:
        if len(key) != 32:
            raise ValueError("the MAC key is 32 bytes (CkksContext.mac_key)")
        self._key = key
        self.q = int(q)

    def _stream(self, label: bytes, nbytes: int) -> bytes:
        return hashlib.shake_256(_DOMAIN + self._key + label).digest(nbytes)

    def _r(self, run_id: int, rnd: int, epoch: int, word: int, n: int) -> np.ndarray:
        label = b"r" + struct.pack(">QQII", run_id, rnd, epoch, word)
        raw = np.frombuffer(self._stream(label, 8 * n), dtype=">u8").astype(np.uint64)
        return raw >> np.uint64(64 - _R_BITS)

    def _pad(self, run_id: int, rnd: int, epoch: int, node_id: str, kind: int, word: int) -> int:
        label = b"p" + struct.pack(">QQIIB", run_id, rnd, epoch, word, kind) + node_id.encode()
        return int.from_bytes(self._stream(label, 24), "big") % self.q  # 192 bits: bias < 2^-130

    def _inners(self, coeffs: np.ndarray, run_id: int, rnd: int, epoch: int) -> list[int]:
        return [_inner(coeffs, self._r(run_id, rnd, epoch, w, coeffs.shape[0]), self.q) for w in range(WORDS)]

    def tag(self, coeffs: np.ndarray, run_id: int, rnd: int, epoch: int, node_id: str, kind: int) -> bytes:
        """The tag of one contribution (its ciphertexts' ``coefficients``)."""
        inner = self._inners(coeffs, run_id, rnd, epoch)
        words = [(v + self._pad(run_id, rnd, epoch, node_id, kind, w)) % self.q for w, v in enumerate(inner)]
        return b"".join(struct.pack(">Q", v) for v in words)

    def check(self, coeffs: np.ndarray, manifest: Manifest) -> bool:
        """True iff ``coeffs`` (of an aggregate) is the sum of the manifest's tagged contributions."""
        want = [0] * WORDS
        for e in manifest.entries:
            if len(e.tag) != 8 * WORDS:
                return False
            for w in range(WORDS):
                (t,) = struct.unpack_from(">Q", e.tag, 8 * w)
                pad = self._pad(manifest.run_id, manifest.round, manifest.epoch, e.node_id, e.kind, w)
                want[w] = (want[w] + t - pad) % self.q
        return self._inners(coeffs, manifest.run_id, manifest.round, manifest.epoch) == want
