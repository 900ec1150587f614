"""Opaque update codecs: what clients put on the wire and what the server adds up.

The server only ever sees ``bytes`` and an ``Aggregator`` built from public material,
so swapping the plaintext codec for CKKS (``crypto``) changes nothing in the Flower
glue. The contract every codec keeps:

* client: ``encode(vec, weight) -> bytes`` (a weighted update), ``decode_mean(bytes) -> vec``
* server: ``Aggregator.add(bytes)`` (raises ``CodecError`` and stays unchanged when it
  rejects the bytes), ``.result() -> bytes``, ``.count``.

``decode_mean`` returns Σ wᵢ·Δᵢ / Σ wᵢ, i.e. the weighted FedAvg of the updates.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np

MAGIC = b"FKV1"
_UPDATE, _AGGREGATE = b"U", b"A"
# magic(4) kind(1) pad(3) dim(u32) weight(f64) count(u32) pad(4)
_HEADER = struct.Struct("<4sc3xIdI4x")
HEADER_BYTES = _HEADER.size  # 28
MAX_BYTES_DEFAULT = 256 * 1024 * 1024


class CodecError(ValueError):
    """Bytes that a codec refuses: malformed, foreign, wrong shape, NaN/Inf, too big."""


class ClientCodec(Protocol):
    def encode(self, vec: np.ndarray, weight: float) -> bytes: ...
    def decode_mean(self, blob: bytes) -> np.ndarray: ...


class Aggregator(Protocol):
    """crypto.CkksAggregator(public_context_bytes, packing) satisfies this too."""

    count: int

    def add(self, blob: bytes) -> None: ...
    def add_noise(self, std: float, shares: int = 1, rng: np.random.Generator | None = None) -> int: ...
    def result(self) -> bytes: ...


@dataclass
class PlainClientCodec:
    """float32 weighted update + weight, no protection: the plaintext FedAvg baseline."""

    dim: int

    def encode(self, vec: np.ndarray, weight: float) -> bytes:
        vec = np.asarray(vec, dtype=np.float32)
        if vec.shape != (self.dim,):
            raise CodecError(f"update has shape {vec.shape}, expected ({self.dim},)")
        if not (np.isfinite(weight) and weight > 0):
            raise CodecError(f"weight must be finite and > 0, got {weight}")
        payload = (vec * np.float32(weight)).astype("<f4")
        if not np.all(np.isfinite(payload)):
            raise CodecError("update contains NaN/Inf")
        return _HEADER.pack(MAGIC, _UPDATE, self.dim, float(weight), 1) + payload.tobytes()

    def decode_mean(self, blob: bytes) -> np.ndarray:
        dim, total_w, _count, payload = _parse(blob, _AGGREGATE, self.dim, MAX_BYTES_DEFAULT)
        if total_w <= 0:
            raise CodecError("aggregate has no weight")
        return (payload.astype(np.float64) / total_w).astype(np.float32)


@dataclass
class PlainAggregator:
    """Sums weighted plaintext updates in float64; validates each blob before touching state."""

    dim: int
    max_bytes: int = MAX_BYTES_DEFAULT

    def __post_init__(self) -> None:
        self._sum = np.zeros(self.dim, dtype=np.float64)
        self._weight = 0.0
        self.count = 0

    def add(self, blob: bytes) -> None:
        _dim, weight, _count, payload = _parse(blob, _UPDATE, self.dim, self.max_bytes)
        if not (np.isfinite(weight) and weight > 0):
            raise CodecError(f"update weight must be finite and > 0, got {weight}")
        self._sum += payload
        self._weight += weight
        self.count += 1

    def add_noise(self, std: float, shares: int = 1, rng: np.random.Generator | None = None) -> int:
        """Gaussian noise N(0, std²) on the sum (for clients that dropped in distributed DP).

        Same signature as crypto.CkksAggregator.add_noise; ``shares`` only matters there.
        """
        rng = rng or np.random.default_rng()
        self._sum += rng.normal(0.0, std, size=self.dim)
        return shares

    def result(self) -> bytes:
        if self.count == 0:
            raise CodecError("no updates were added")
        payload = self._sum.astype("<f4").tobytes()
        return _HEADER.pack(MAGIC, _AGGREGATE, self.dim, self._weight, self.count) + payload


def _parse(blob: bytes, kind: bytes, dim: int, max_bytes: int) -> tuple[int, float, int, np.ndarray]:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(blob).__name__}")
    if len(blob) > max_bytes:
        raise CodecError(f"{len(blob)} bytes exceeds the {max_bytes}-byte limit")
    if len(blob) < _HEADER.size:
        raise CodecError(f"{len(blob)} bytes is shorter than the header")
    magic, got_kind, got_dim, weight, count = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}: not a plaintext fedkv blob (foreign codec?)")
    if got_kind != kind:
        raise CodecError(f"blob kind {got_kind!r}, expected {kind!r}")
    if got_dim != dim:
        raise CodecError(f"blob dim {got_dim} does not match expected {dim}")
    if len(blob) != _HEADER.size + 4 * dim:
        raise CodecError(f"blob length {len(blob)} inconsistent with dim {dim}")
    payload = np.frombuffer(blob, dtype="<f4", offset=_HEADER.size).astype(np.float64)
    if not np.all(np.isfinite(payload)):
        raise CodecError("payload contains NaN/Inf")
    return got_dim, weight, count, payload


def make_client_codec(he: bool, dim: int, packing: int = 1) -> ClientCodec:
    """The client half. ``he=True`` will wrap crypto's UpdateEncryptor/AggregateDecryptor."""
    if he:
        raise NotImplementedError(
            "he=true needs crypto.UpdateEncryptor/AggregateDecryptor, which are not merged yet; "
            "run with --run-config 'he=false'"
        )
    return PlainClientCodec(dim)


def make_aggregator(he: bool, dim: int, packing: int = 1, public_context: bytes | None = None) -> Aggregator:
    """The server half, from public material only. ``he=True`` will be crypto.CkksAggregator."""
    if he:
        raise NotImplementedError(
            "he=true needs crypto.CkksAggregator(public_context_bytes, packing), not merged yet"
        )
    return PlainAggregator(dim)
