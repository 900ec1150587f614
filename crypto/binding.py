"""Aggregate binding: a node decrypts only an aggregate that is the sum of this round's tagged updates.

Why: a server that can hand a node any ciphertext and watch whether it is accepted (or how the
model it yields behaves) has a decryption oracle: the Li–Micciancio IND-CPA-D attack recovers
CKKS decryption noise, then the secret key, from such answers. Signatures do not help (the
server adds ciphertexts; the sum is signed by nobody), and TenSEAL has no verifiable computation.

How: a linear MAC over the ciphertext coefficients mod q0, keyed with ``CkksContext.mac_key``
(derived from the secret key, so every node has it and the server does not). For round ``rho``
each node tags each ciphertext vector ``c`` it contributes:

    t = <r_rho, c> + p(run, rho, epoch, node, kind, H(c))   (mod q0)

``r_rho`` (one per tag word, entries uniform in [0, 2^56)) and the pad ``p`` (uniform mod q0,
192 PRF bits reduced: bias < 2^-130) are SHAKE-256 of the key and a label: (run, round, epoch)
for ``r``, and for ``p`` also the node, the kind (update or noise share) and ``H(c)`` =
SHA-256 of the contribution's payload bytes, the digest its Ed25519 signature covers
(``SignedUpdate.digest``). The server copies (node, kind, H, tag) of every summand into the
aggregate's ``Manifest`` (wire format ``FKM\\x02``). Addition of ciphertexts is addition of their
coefficients mod q0, so the node checks an aggregate ``A`` against its manifest by

    <r_rho, A> == sum over entries (t_i - p(run, rho, epoch, node_i, kind_i, H_i))   (mod q0)

before it decrypts anything, and answers every failure with one text.

Why the pad must depend on the ciphertext (issue 20): with a pad of (run, round, epoch, node,
kind) alone, two tags t1, t2 of one node in one round (asked twice for the same round) share a
pad, and ``t2 + k(t1 - t2)`` is a valid tag of ``H + k(c1 - c2)`` for every k: the MAC passed up
to k = 2^48 and accept/reject read off decryption noise again. With ``H(c)`` in the pad's label,
a pad index (run, round, epoch, node, kind, H) is only ever used for one ``c`` (the payload bytes
determine the coefficients), so tagging the same ``c`` again gives the same tag, and tags of two
different ciphertexts carry independent pads: ``t1 - t2 = <r, c1 - c2> + p1 - p2`` says nothing
about ``r``. The node does not check the summands' signatures itself (it holds no roster of its
peers' signing keys in simulation), and need not: a digest no node tagged under (node, kind)
indexes a pad nobody computed, so the server must guess that entry's tag outright.

Forgery bound. Model SHAKE-256 as a PRF and SHA-256 as collision resistant. Every tag the server
sees is ``<r, c> + p`` with a pad used for no other ``c``, so its whole view is independent of
``r`` (up to 2^-130 per tag). Take any aggregate ``A`` with a manifest, and let ``d = A - sum
c_i`` over the ciphertexts the manifest's entries were tagged for. If an entry's index was never
tagged, its pad is uniform and unknown: the check holds with probability ``1/q0`` (<= the bound
below). Otherwise it holds iff ``<r, d> = s`` for a value ``s`` the server knows; for ``d != 0``
some coordinate ``d_j`` is invertible mod the prime q0, one residue of ``r_j`` satisfies it, and
at most ``ceil(2^56/q0)`` of the 2^56 values of ``r_j`` have that residue. Per tag word:

    eps_w <= ceil(2^56 / q0) / 2^56 + 2^-130    (2^-56 for a 60-bit q0, <= 2^-53 for the
                                                 54-bit q0 of fedkv-2048)

and the ``WORDS`` = 2 words use independent ``r`` and pads: ``eps <= eps_w^2`` (about 2^-112,
resp. 2^-106). A server asking Q times (adaptively, over any number of rounds, tags and nodes:
until the first forgery passes, every answer is one it could predict, a refusal or the acceptance
of an honest sum, so its queries are fixed in advance) makes some node accept an ``A`` other than
the sum of the manifest's tagged summands with probability at most ``Q * eps + Adv_PRF(SHAKE-256)
+ Adv_CR(SHA-256)``. Scalings and affine combinations of tagged updates, and a summand added or
left out under an unchanged manifest, are such ``A``; a subset announced as such in the manifest
is the honest sum of that subset, and the node's ``min-clients`` floor refuses small ones.
Accept/reject therefore never depends on the secret key's noise, except with that probability.

Independently, a node answers each round's train and noise request once
(``federation.node_store.NodeStore.answer_once``): a repeated request gets the byte-identical
reply, so a node hands out at most one tag per round and kind. The bound does not rely on it:
a node that lost its kept replies and tags a round again leaks ``t1 - t2``, masked by two
independent pads.

Cost: one pass over the coefficients per tag or check (2 x N values per ciphertext) plus a
SHA-256 of the payload, which the signature computes anyway.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crypto.errors import NotACiphertextError

__all__ = ["WORDS", "DIGEST_BYTES", "CONTRIBUTION_UPDATE", "CONTRIBUTION_NOISE", "AggregateMac", "ManifestEntry", "Manifest",
           "MANIFEST_MAGIC", "payload_digest", "tag_problem"]

WORDS = 2
# A contribution's kind (a node's update, or its reply of noise shares): in the MAC pad's label,
# the manifest entry, the signed update, the dither label and ``NodeStore.answer_once``. Not the
# envelope kind byte of ``crypto.wire`` (update or aggregate ciphertext).
CONTRIBUTION_UPDATE, CONTRIBUTION_NOISE = 0, 1
CONTRIBUTION_KINDS = (CONTRIBUTION_UPDATE, CONTRIBUTION_NOISE)
DIGEST_BYTES = 32
_R_BITS = 56
_DOMAIN = b"fedkv-aggregate-mac-v2"
MANIFEST_MAGIC = b"FKM\x02"
"""Manifest wire format 2: each entry carries its summand's payload digest (format 1 did not)."""
_MAX_ENTRIES = 4096
_MAX_NODE_ID = 1024


def payload_digest(payload: bytes) -> bytes:
    """H(c): SHA-256 of a contribution's payload bytes (= ``SignedUpdate.digest``, what the
    signature covers), the part of a pad's label that binds the pad to one ciphertext."""
    return hashlib.sha256(payload).digest()


def tag_problem(tag: bytes, q: int) -> str | None:
    """What makes ``tag`` no tag of this MAC (``WORDS`` big-endian words, each reduced mod q0), or
    None. The server checks it before a summand enters a manifest: a manifest holding a tag of
    another length does not parse on any node, so one signed update with a three-word tag made
    every node refuse every aggregate (issue 20)."""
    if len(tag) != 8 * WORDS:
        return f"has {len(tag)} bytes, a tag has {8 * WORDS} ({WORDS} words)"
    for w in range(WORDS):
        if int.from_bytes(tag[8 * w : 8 * w + 8], "big") >= q:
            return f"word {w} is not reduced mod q0"
    return None


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
    from crypto.seal_io import seal_save

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
    """One summand of an aggregate: who made it, what it is, its payload digest and its tag."""

    node_id: str
    kind: int
    digest: bytes
    tag: bytes


@dataclass(frozen=True)
class Manifest:
    """What the server says an aggregate sums: round, key epoch and one entry per summand.

    Wire format (big-endian): magic ``FKM\\x02`` | run u64 | round u64 | epoch u32 | n u32, then n
    x (node id length u16 | kind u8 | node id UTF-8 | digest 32 bytes | tag length u16 | tag).
    Parsing is strict: n <= 4096, node ids of 1..1024 bytes, kind update or noise, tags of
    ``WORDS`` words, exact length; anything else is ``NotACiphertextError``."""

    run_id: int
    round: int
    epoch: int
    entries: tuple[ManifestEntry, ...]

    def to_bytes(self) -> bytes:
        out = [MANIFEST_MAGIC, struct.pack(">QQII", self.run_id, self.round, self.epoch, len(self.entries))]
        for e in self.entries:
            nid = e.node_id.encode()
            out.append(struct.pack(">HB", len(nid), e.kind) + nid + e.digest + struct.pack(">H", len(e.tag)) + e.tag)
        return b"".join(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            data = bytes(data)
            if data[:4] != MANIFEST_MAGIC:
                raise ValueError("bad magic")
            run_id, rnd, epoch, n = struct.unpack_from(">QQII", data, 4)
            if n > _MAX_ENTRIES:
                raise ValueError("too many entries")
            pos, entries = 28, []
            for _ in range(n):
                ln, kind = struct.unpack_from(">HB", data, pos)
                pos += 3
                if not 1 <= ln <= _MAX_NODE_ID or kind not in CONTRIBUTION_KINDS or pos + ln + DIGEST_BYTES + 2 > len(data):
                    raise ValueError("bad entry")
                nid = data[pos : pos + ln].decode()
                digest = data[pos + ln : pos + ln + DIGEST_BYTES]
                pos += ln + DIGEST_BYTES
                (tl,) = struct.unpack_from(">H", data, pos)
                pos += 2
                if tl != 8 * WORDS or pos + tl > len(data):
                    raise ValueError("bad tag")
                entries.append(ManifestEntry(nid, kind, digest, data[pos : pos + tl]))
                pos += tl
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

    def _pad(self, run_id: int, rnd: int, epoch: int, node_id: str, kind: int, digest: bytes, word: int) -> int:
        """The pad of one summand: a function of its ciphertext's digest, so it masks one ``c`` only."""
        if len(digest) != DIGEST_BYTES:
            raise ValueError("a pad is bound to a 32-byte payload digest")
        label = b"p" + struct.pack(">QQIIB", run_id, rnd, epoch, word, kind) + digest + node_id.encode()
        return int.from_bytes(self._stream(label, 24), "big") % self.q  # 192 bits: bias < 2^-130

    def _inners(self, coeffs: np.ndarray, run_id: int, rnd: int, epoch: int) -> list[int]:
        return [_inner(coeffs, self._r(run_id, rnd, epoch, w, coeffs.shape[0]), self.q) for w in range(WORDS)]

    def tag(self, coeffs: np.ndarray, run_id: int, rnd: int, epoch: int, node_id: str, kind: int,
            digest: bytes) -> bytes:
        """The tag of one contribution: its ciphertexts' ``coefficients``, and ``digest`` =
        ``payload_digest`` of the payload they were read from (the server lists it in the manifest)."""
        inner = self._inners(coeffs, run_id, rnd, epoch)
        words = [(v + self._pad(run_id, rnd, epoch, node_id, kind, digest, w)) % self.q for w, v in enumerate(inner)]
        return b"".join(struct.pack(">Q", v) for v in words)

    def check(self, coeffs: np.ndarray, manifest: Manifest) -> bool:
        """True iff ``coeffs`` (of an aggregate) is the sum of the manifest's tagged contributions."""
        want = [0] * WORDS
        for e in manifest.entries:
            if len(e.tag) != 8 * WORDS or len(e.digest) != DIGEST_BYTES:
                return False
            for w in range(WORDS):
                (t,) = struct.unpack_from(">Q", e.tag, 8 * w)
                pad = self._pad(manifest.run_id, manifest.round, manifest.epoch, e.node_id, e.kind, e.digest, w)
                want[w] = (want[w] + t - pad) % self.q
        return self._inners(coeffs, manifest.run_id, manifest.round, manifest.epoch) == want
