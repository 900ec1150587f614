"""Opaque update codecs: what clients put on the wire and what the server adds up.

The server only ever sees ``bytes`` and an ``Aggregator`` built from public material,
so the plaintext codec and CKKS (``crypto``) are interchangeable in the Flower glue.
The contract every codec keeps:

* client: ``encode(vec, weight) -> bytes`` (a weighted update), ``decode_mean(bytes) -> vec``
* server: ``Aggregator.add(bytes)`` (raises ``CodecError`` and stays unchanged when it
  rejects the bytes), ``.add_noise(std, shares)``, ``.result() -> bytes``, ``.count``.

``decode_mean`` returns Σ wᵢ·Δᵢ / Σ wᵢ, i.e. the weighted FedAvg of the updates (plus any
DP noise, which carries no weight).

he=true (``CkksClientCodec`` / ``CkksAggregatorCodec``): ``crypto.UpdateEncryptor`` +
``AggregateDecryptor`` with the node's *secret* context on the client;
``crypto.CkksAggregator(public_context_bytes, packing, expected_values=dim)`` on the server,
which refuses a context holding a secret key. Every ``crypto.CryptoError`` becomes a
``CodecError`` (the strategy leaves that client out).

The public encoding parameters (``packing_for``: packing mode, bits, range, dither, weights)
are the policy of ``crypto.dp.encoding_policy``, a function of the run config and the model size
only, so identical on every node and the server. The functions here of that name take the
``RunConfig`` and pass its ``encoding_params`` on (crypto never imports federation).
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field, fields
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # crypto (tenseal) is imported lazily: he=false runs do not need it
    from crypto import AdaptiveClipping, CkksContext, PackingConfig
    from crypto.aggregate_bound import MeanBound
    from crypto.dp.encoding_policy import EncodingParams

    from federation.config import RunConfig

MAGIC = b"FKV1"
_UPDATE, _AGGREGATE = b"U", b"A"
# magic(4) kind(1) pad(3) dim(u32) weight(f64) count(u32) pad(4)
_HEADER = struct.Struct("<4sc3xIdI4x")
HEADER_BYTES = _HEADER.size  # 28
MAX_BYTES_DEFAULT = 256 * 1024 * 1024
AGGREGATOR_PHASES = ("parse", "deserialize", "add", "serialize")
"""Server-side phases every aggregator times (``seconds``); = ``crypto.ckks.AGGREGATOR_PHASES``."""


class CodecError(ValueError):
    """Bytes that a codec refuses: malformed, foreign, wrong shape, NaN/Inf, too big."""


class ClientCodec(Protocol):
    saturated: int
    """Values saturated by the last ``encode`` (0 for the plaintext codec)."""

    def encode(self, vec: np.ndarray, weight: float) -> bytes: ...
    def decode_mean(self, blob: bytes) -> np.ndarray: ...


class Aggregator(Protocol):
    """crypto.CkksAggregator(public_context_bytes, packing) satisfies this too."""

    count: int
    seconds: dict[str, float]
    """Time spent per phase of ``AGGREGATOR_PHASES``, summed over calls."""

    def add(self, blob: bytes) -> None: ...
    def add_noise(self, std: float, shares: int = 1, rng: np.random.Generator | None = None) -> int: ...
    def result(self) -> bytes: ...


@dataclass
class PlainClientCodec:
    """float32 weighted update + weight, no protection: the plaintext FedAvg baseline."""

    dim: int
    saturated: int = 0

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
        return self.decode(blob).mean.astype(np.float32)

    def decode(self, blob: bytes) -> PlainAggregate:
        """``decode_mean`` with the header the server wrote (weight sum, update count), for the
        node's bound on the mean (``crypto.MeanBound.admits``). A weight sum that is not finite
        and > 0, or a mean that is not finite, is refused here."""
        _dim, total_w, count, payload = _parse(blob, _AGGREGATE, self.dim, MAX_BYTES_DEFAULT)
        if not (math.isfinite(total_w) and total_w > 0):
            raise CodecError("aggregate weight sum must be finite and > 0")
        with np.errstate(over="ignore"):
            mean = payload / total_w
        if not np.all(np.isfinite(mean)):
            raise CodecError("aggregate mean contains NaN/Inf")
        return PlainAggregate(mean, float(total_w), int(count))


@dataclass(frozen=True)
class PlainAggregate:
    """A decoded plaintext aggregate: what its header claims, as the server wrote it."""

    mean: np.ndarray
    """Σ wᵢ·Δᵢ / Σ wᵢ, float64."""
    weight_sum: float
    """Σ wᵢ in weight units (example counts with dp-mode none, 1 per update under DP)."""
    count: int
    """Updates summed (the server's top-up noise shares are not counted)."""


@dataclass
class PlainAggregator:
    """Sums weighted plaintext updates in float64; validates each blob before touching state."""

    dim: int
    max_bytes: int = MAX_BYTES_DEFAULT

    def __post_init__(self) -> None:
        self._sum = np.zeros(self.dim, dtype=np.float64)
        self._weight = 0.0
        self.count = 0
        self.noise_shares = 0
        self.seconds = dict.fromkeys(AGGREGATOR_PHASES, 0.0)
        """Same phases as ``crypto.CkksAggregator.seconds`` (deserialize = parse the floats)."""

    def add(self, blob: bytes) -> None:
        t0 = time.perf_counter()
        _dim, weight, _count, payload = _parse(blob, _UPDATE, self.dim, self.max_bytes)
        if not (np.isfinite(weight) and weight > 0):
            raise CodecError(f"update weight must be finite and > 0, got {weight}")
        t1 = time.perf_counter()
        self._sum += payload
        self._weight += weight
        self.count += 1
        self.seconds["deserialize"] += t1 - t0
        self.seconds["add"] += time.perf_counter() - t1

    def add_noise(self, std: float, shares: int = 1, rng: np.random.Generator | None = None) -> int:
        """Gaussian noise for ``shares`` missing clients, each share N(0, std²): the sum gets
        N(0, shares·std²). Same semantics as crypto.CkksAggregator.add_noise; returns the
        number of saturated values (always 0 here)."""
        if not (isinstance(shares, int) and shares >= 1):
            raise ValueError(f"shares must be a positive int, not {shares!r}")
        if not (math.isfinite(std) and std >= 0):
            raise CodecError(f"noise std must be finite and >= 0, not {std}")
        rng = rng or np.random.default_rng()
        self._sum += rng.normal(0.0, std * math.sqrt(shares), size=self.dim)
        self.noise_shares += shares
        return 0

    def result(self) -> bytes:
        if self.count == 0:
            raise CodecError("no updates were added")
        t0 = time.perf_counter()
        payload = self._sum.astype("<f4").tobytes()
        out = _HEADER.pack(MAGIC, _AGGREGATE, self.dim, self._weight, self.count) + payload
        self.seconds["serialize"] += time.perf_counter() - t0
        return out


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


def plain_update_count(blob: bytes, dim: int) -> int:
    """Updates summed in a plaintext aggregate (its header count; noise shares not included)."""
    return _parse(blob, _AGGREGATE, dim, MAX_BYTES_DEFAULT)[2]


# --- CKKS (crypto/) --------------------------------------------------------------------


def encoding_params(cfg: RunConfig) -> EncodingParams:
    """The run config's fields the encoding policy reads (``crypto.dp.encoding_policy``)."""
    from crypto.dp.encoding_policy import EncodingParams

    return EncodingParams(**{f.name: getattr(cfg, f.name) for f in fields(EncodingParams)})


def _policy() -> Any:
    from crypto.dp import encoding_policy  # lazily: he=false runs do not need crypto (tenseal)

    return encoding_policy


# crypto.dp.encoding_policy on a RunConfig (its docstrings say what each returns)
def adaptive_clipping_for(cfg: RunConfig) -> AdaptiveClipping | None:
    return _policy().adaptive_clipping_for(encoding_params(cfg))


def wire_dim(cfg: RunConfig, model_dim: int) -> int:
    return _policy().wire_dim(encoding_params(cfg), model_dim)


def wire_noise(cfg: RunConfig) -> tuple[float, float]:
    return _policy().wire_noise(encoding_params(cfg))


def packing_for(cfg: RunConfig, dim: int) -> PackingConfig:
    return _policy().packing_for(encoding_params(cfg), dim)


def run_saturation_delta(cfg: RunConfig, dim: int) -> float:
    return _policy().run_saturation_delta(encoding_params(cfg), dim)


def uses_error_feedback(cfg: RunConfig) -> bool:
    return _policy().uses_error_feedback(encoding_params(cfg))


def mean_bound_for(cfg: RunConfig, dim: int, real_scale_bits: int = 40) -> MeanBound:
    return _policy().mean_bound_for(encoding_params(cfg), dim, real_scale_bits)


def client_weight(cfg: RunConfig, num_examples: int) -> tuple[float, bool]:
    return _policy().client_weight(encoding_params(cfg), num_examples)


def ckks_preset_for(cfg: RunConfig, dim: int) -> str:
    """The run's CKKS preset: ``ckks-preset``, or with "auto" the ring whose updates of ``dim``
    values are smallest under the run's packing (``crypto.preset_for``). Server-side only: the
    key-making node is told the resolved name."""
    if cfg.ckks_preset != "auto":
        return cfg.ckks_preset
    from crypto import AUTO_PRESETS, PQ_AUTO_PRESETS, preset_for

    names = PQ_AUTO_PRESETS if cfg.he_security == "post-quantum" else AUTO_PRESETS
    return preset_for(dim, packing_for(cfg, dim), names)


def _codec_error(err: Exception) -> CodecError:
    return CodecError(f"{type(err).__name__}: {err}")


@dataclass
class CkksClientCodec:
    """Node side under HE: encrypt with the node's secret context, decrypt aggregates."""

    dim: int
    context: CkksContext = field(repr=False)
    packing: PackingConfig
    saturated: int = 0
    residual: np.ndarray | None = field(default=None, repr=False)
    """What the last ``encode`` did not send (rounding + saturation, pre-scaled domain)."""

    def __post_init__(self) -> None:
        from crypto import AggregateDecryptor, UpdateEncryptor
        from crypto.errors import CryptoError

        if not self.context.is_private:
            raise CodecError("the client codec needs the node's secret CKKS context")
        try:
            self._enc = UpdateEncryptor(self.context, self.packing)
            self._dec = AggregateDecryptor(self.context, self.packing)
        except CryptoError as err:
            raise _codec_error(err) from err

    def encode(self, vec: np.ndarray, weight: float, noise: np.ndarray | None = None,
               carry: np.ndarray | None = None, dither: np.ndarray | None = None,
               contributions: int = 1) -> bytes:
        """Encrypt ``vec`` with FedAvg weight ``weight`` (<= packing.max_weight).

        ``noise`` is added after the weight pre-scale (crypto's place for distributed-DP
        shares under unequal weights); unused while DP runs use equal weights. ``carry`` is the
        error-feedback residual of this node's previous update (``residual`` after the call);
        ``dither`` this contribution's ``crypto.dp.dither.dither`` when the packing is dithered;
        ``contributions`` m > 1 sends m noise shares (weight 0) as one summand of range ±m·R.
        """
        from crypto.errors import CryptoError

        vec = np.asarray(vec)
        if vec.shape != (self.dim,):
            raise CodecError(f"update has shape {vec.shape}, expected ({self.dim},)")
        try:
            blob = self._enc.encrypt(vec, weight, noise=noise, carry=carry, dither=dither,
                                     contributions=contributions)
        except CryptoError as err:
            raise _codec_error(err) from err
        self.residual = self._enc.last_residual
        report = self._enc.last_report
        self.saturated = int(report.saturated) if report is not None else 0
        return blob

    def decode_mean(self, blob: bytes, accept: Callable[[np.ndarray], bool] | None = None,
                    dither_total: np.ndarray | None = None) -> np.ndarray:
        """The weighted mean of an aggregate; `accept` checks its ciphertext coefficients first
        (``crypto.AggregateMac.check``), on the ciphertexts decryption then uses; a dithered
        packing needs the summands' ``dither_total``."""
        return self.decode(blob, accept, dither_total).mean.astype(np.float32)

    def decode(self, blob: bytes, accept: Callable[[np.ndarray], bool] | None = None,
               dither_total: np.ndarray | None = None) -> Any:
        """``decode_mean`` with the decrypted header: a ``crypto.AggregateResult`` (mean float64,
        weight sum in weight units, contribution count), for ``crypto.MeanBound.admits``."""
        from crypto.errors import CryptoError

        try:
            result = self._dec.decrypt(bytes(blob), accept=accept, dither_total=dither_total)
        except CryptoError as err:
            raise _codec_error(err) from err
        if result.mean.shape != (self.dim,):
            raise CodecError(f"aggregate holds {result.mean.shape[0]} values, expected {self.dim}")
        if not np.all(np.isfinite(result.mean)):
            raise CodecError("decrypted aggregate contains NaN/Inf")
        return result


class CkksAggregatorCodec:
    """Server side under HE: ``crypto.CkksAggregator`` over the *public* context only."""

    def __init__(self, dim: int, packing: PackingConfig, public_context: bytes) -> None:
        from crypto import CkksAggregator, load_context
        from crypto.errors import CryptoError

        ctx = _PUBLIC_CONTEXTS.get(bytes(public_context))
        if ctx is None:
            try:
                ctx = load_context(public_context)
            except CryptoError as err:
                raise _codec_error(err) from err
            if not ctx.is_private:
                _PUBLIC_CONTEXTS.clear()  # one key epoch at a time
                _PUBLIC_CONTEXTS[bytes(public_context)] = ctx
        if ctx.is_private:
            raise CodecError("refusing a CKKS context with a secret key on the server side")
        self.dim = dim
        self.packing = packing
        self._agg = CkksAggregator(ctx, packing, expected_values=dim)

    @property
    def count(self) -> int:
        return self._agg.count

    @property
    def noise_shares(self) -> int:
        return self._agg.noise_shares

    @property
    def seconds(self) -> dict[str, float]:
        return self._agg.seconds

    @property
    def context(self) -> Any:
        """The aggregator's (public) CkksContext, for inspection."""
        return self._agg.context

    def add(self, blob: bytes) -> None:
        from crypto.errors import CryptoError

        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise CodecError(f"expected bytes, got {type(blob).__name__}")
        try:
            self._agg.add(bytes(blob))
        except CryptoError as err:
            raise _codec_error(err) from err

    def add_noise(self, std: float, shares: int = 1, rng: np.random.Generator | None = None) -> int:
        from crypto.errors import CryptoError

        try:
            return self._agg.add_noise(std, shares=shares, rng=rng)
        except CryptoError as err:
            raise _codec_error(err) from err

    def result(self) -> bytes:
        from crypto.errors import CryptoError

        try:
            return self._agg.result()
        except CryptoError as err:
            raise _codec_error(err) from err


def make_client_codec(
    he: bool, dim: int, packing: PackingConfig | None = None, context: CkksContext | None = None
) -> ClientCodec:
    """The client half: plaintext, or CKKS with the node's secret context + public packing."""
    if not he:
        return PlainClientCodec(dim)
    if context is None or packing is None:
        raise CodecError("he=true needs the node's secret CKKS context and the run's packing")
    key = (dim, context.key_id, packing)
    codec = _CLIENT_CODECS.get(key)
    if codec is None or codec.context is not context:
        codec = CkksClientCodec(dim, context, packing)
        _CLIENT_CODECS[key] = codec
        while len(_CLIENT_CODECS) > _CACHE_SIZE:
            _CLIENT_CODECS.pop(next(iter(_CLIENT_CODECS)))
    return codec


_CACHE_SIZE = 16
_CLIENT_CODECS: dict[tuple[int, bytes, PackingConfig], CkksClientCodec] = {}
"""Per process: a codec (SEAL encoder, encryptors, evaluator) per (dim, key, packing), built once."""
_PUBLIC_CONTEXTS: dict[bytes, Any] = {}
"""Per process: public contexts by their bytes, parsed once (the server builds one aggregator per round)."""


def make_aggregator(
    he: bool, dim: int, packing: PackingConfig | None = None, public_context: bytes | None = None
) -> Aggregator:
    """The server half, from public material only (a context with a secret key is refused)."""
    if not he:
        return PlainAggregator(dim)
    if public_context is None or packing is None:
        raise CodecError("he=true needs the public CKKS context and the run's packing")
    return CkksAggregatorCodec(dim, packing, public_context)
