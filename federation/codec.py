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

The public encoding parameters (``packing_for``), identical on every node and the server
because they are a function of the run config and the model size only:

* mode = ``packing``, bits = ``packing-bits``, max_clients = ``max-clients``; dither under
  dp-mode distributed (``crypto.dither``: the rounding error does not depend on the data);
* max_weight = 1 under DP (every client has weight 1: the sensitivity analysis assumes
  equal weights), ``max-weight`` with dp-mode=none (weight = min(num_examples, max-weight));
* clip_range R = ``packing-range`` if > 0, else derived from C = ``clip-norm`` (updates are
  L2-clipped to C, always with he=true, so no coordinate exceeds C) and s, the largest
  per-contribution noise std a round can use (``contribution_std``: σC local, σC/√min-clients
  distributed, since a round has >= min-clients clients; 0 without DP):

  - under DP (local, distributed, σ > 0): R = ``crypto.dp_clip_range(C, s, dim, max-clients,
    num-server-rounds, budget)``, the smallest range whose saturation bound δ_sat (the
    probability that any coordinate of any contribution in any round saturates,
    ``crypto.saturation``) is at most budget = ``crypto.saturation_budget(target-delta)`` =
    0.01·δ / (1 + e^MEANINGFUL_EPSILON). That makes the premise of the coupling bound in
    ``crypto.privacy`` true: what runs is (ε, δ + (1 + e^ε)·δ_sat)-DP, and δ_sat adds at most
    1 % to δ at any ε a run may claim (``run_saturation_delta``, reported per round as
    ``saturation_delta`` / ``delta_total``). An explicit packing-range under DP is kept; its
    δ_sat is whatever it is, and reported.
  - dp-mode none: the heuristic R = sqrt((4·s)² + (12·C/√dim)²) (= 12·C/√dim at s = 0),
    capped at C + 4·s. This is ``crypto.suggest_clip_range`` with a 3x wider allowance for
    the signal: trained updates are heavy-tailed (digits: max |coordinate| ≈ 10x RMS); at
    4·C/√dim 1 % of the values saturated and 10 digits rounds lost 0.4 accuracy points vs the
    plaintext codec, at 12·C/√dim none saturated and accuracy matched to 3 decimals (5 nodes,
    dp-mode local σ=0).

  Rounded *up* to 6 significant digits (the range is in the packing fingerprint; up, so the
  bound still holds). Values outside ±R are saturated and counted (``saturated`` in the reply
  metrics), never wrapped.

  What the bound costs (computed by ``tests/federation/test_codec.py``): the digits experiment
  (dim 4810, C = 1, σ = 1.33, 32 clients per round = min = max-clients, 25 rounds, δ = 1e-5,
  8 bits, distributed) gets R = 3.05457 (the heuristic gave 0.956236 < C, which saturated the
  worst-case update in 2 trials of 3) with δ_sat = 4.54e-12, step 0.02396; the dithered
  rounding of the 32-contribution sum has per-coordinate std step·√(32/12) = 0.0391 = 2.9 % of
  the DP noise std σC = 1.33 (0.09 % of its variance). The main job's defaults (lm, dim
  141,056, σ = 0.02, min-clients 2, max-clients 32, 5 rounds, 5 nodes) get R = 1.12638 instead
  of 0.0649682: step 0.00883, rounding std of the 5-node sum 0.0057 = 29 % of σC = 0.02, and
  the per-node step is 3.3x a clipped coordinate's RMS (C/√dim = 0.0027), where the heuristic
  range resolved it: the guarantee at that σ costs that much resolution.
* adaptive clipping under dp-mode distributed (``adaptive_clipping_for``): a contribution is
  ``wire_dim`` = dim + 1 values, the update divided by the nodes' current norm and the
  clipped-count coordinate ±a/2 (``crypto.adaptive_clipping``), so the rules above run with C
  replaced by the coordinate bound max(1, a/2) (``coordinate_bound``) and σ by σ_Δ
  (``wire_noise``). The encoding never depends on the adapted norm, which the server never holds.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # crypto (tenseal) is imported lazily: he=false runs do not need it
    from crypto import AdaptiveClipping, CkksContext, PackingConfig
    from crypto.aggregate_bound import MeanBound

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


RANGE_NOISE_TAIL = 4.0
"""Noise standard deviations covered by the derived packing range."""
RANGE_SIGNAL_TAIL = 12.0
"""Multiples of the clipped signal's coordinate RMS (C/√dim) covered by the derived range."""


def adaptive_clipping_for(cfg: RunConfig) -> AdaptiveClipping | None:
    """fedkv's adaptive clipping under HE (``crypto.adaptive_clipping``), or None (fixed norm, or
    Flower's own wrapper under flower-central). σ_b = 0 means max(max-clients/20, σ)."""
    if not (cfg.adaptive_clipping and cfg.dp_mode == "distributed"):
        return None
    from crypto import AdaptiveClipping

    count_std = cfg.clipped_count_stddev or max(cfg.max_clients / 20, cfg.noise_multiplier)
    return AdaptiveClipping(cfg.noise_multiplier, count_std, cfg.target_clipped_quantile, cfg.clip_norm_lr)


def wire_dim(cfg: RunConfig, model_dim: int) -> int:
    """Values per contribution: the model's, plus the clipped-count coordinate under adaptive clipping."""
    return model_dim + 1 if adaptive_clipping_for(cfg) is not None else model_dim


def wire_noise(cfg: RunConfig) -> tuple[float, float]:
    """(clip norm, noise multiplier) of what is encoded: (C, σ), or under adaptive clipping
    (1, σ_Δ), since updates travel divided by the nodes' current norm."""
    adaptive = adaptive_clipping_for(cfg)
    if adaptive is None:
        return cfg.clip_norm, cfg.noise_multiplier
    return 1.0, adaptive.update_noise_multiplier


def coordinate_bound(cfg: RunConfig) -> float:
    """The largest |value| a contribution holds before noise: C (no coordinate of an update
    clipped to C exceeds it), or under adaptive clipping max(1, a/2) (Δ/C and the count)."""
    adaptive = adaptive_clipping_for(cfg)
    if adaptive is None:
        return cfg.clip_norm
    return max(1.0, adaptive.count_scale / 2)


def contribution_std(cfg: RunConfig) -> float:
    """The largest per-contribution noise std a round can use: σC (local), σC/√min-clients
    (distributed: a round has >= min-clients clients, so its share is at most this), 0 (none);
    with (C, σ) as encoded (``wire_noise``)."""
    c, sigma = wire_noise(cfg)
    if cfg.dp_mode == "local":
        return sigma * c
    if cfg.dp_mode == "distributed":
        return sigma * c / math.sqrt(max(cfg.min_clients, 1))
    return 0.0


def _round_up_6(x: float) -> float:
    """x rounded *up* to 6 significant digits: the range goes into the packing fingerprint every
    ciphertext carries, so a last-bit libm difference between machines must not split the run;
    up, so the saturation bound computed at the unrounded range still holds."""
    r = float(f"{x:.6g}")
    if r >= x:
        return r
    exp10 = math.floor(math.log10(x)) - 5
    return float(f"{r + 10.0**exp10:.6g}")


def _derived_range(cfg: RunConfig, dim: int, s: float) -> float:
    """R for packing-range = 0: ``dp_clip_range`` under DP (δ_sat <= ``saturation_budget``),
    the saturation heuristic without DP (module docstring)."""
    from crypto import dp_clip_range, saturation_budget

    c = coordinate_bound(cfg)
    if cfg.dp_mode in ("local", "distributed") and s > 0:
        return _round_up_6(dp_clip_range(c, s, max(dim, 1), cfg.max_clients, cfg.num_server_rounds,
                                         saturation_budget(cfg.target_delta)))
    signal_rms = c / math.sqrt(max(dim, 1))
    heuristic = min(math.hypot(RANGE_NOISE_TAIL * s, RANGE_SIGNAL_TAIL * signal_rms), c + RANGE_NOISE_TAIL * s)
    adaptive = adaptive_clipping_for(cfg)
    if adaptive is not None:  # σ = 0: the clipped-count coordinate is ±a/2 exactly and must not saturate
        heuristic = max(heuristic, adaptive.count_scale / 2)
    return float(f"{heuristic:.6g}")


def packing_for(cfg: RunConfig, dim: int) -> PackingConfig:
    """The public ``PackingConfig`` of a run (same on every node and the server).

    A pure function of the run config and the number of values encoded (``wire_dim``); see
    the module docstring for the rule. Raises ``ValueError`` when crypto rejects the
    resulting parameters.
    """
    from crypto import PackingConfig
    from crypto.errors import ParameterError

    try:
        clip_range = cfg.packing_range if cfg.packing_range > 0 else _derived_range(cfg, dim, contribution_std(cfg))
        return PackingConfig(
            mode=cfg.packing,
            bits=cfg.packing_bits,
            clip_range=float(clip_range),
            max_clients=cfg.max_clients,
            max_weight=client_max_weight(cfg),
            dither=cfg.dp_mode == "distributed",  # rounding independent of the data (crypto.dither)
        )
    except ParameterError as err:
        raise ValueError(f"bad run config: packing parameters rejected by crypto: {err}") from None


def run_saturation_delta(cfg: RunConfig, dim: int) -> float:
    """δ_sat of the run (``crypto.saturation``): the probability bound that some contribution
    saturates, at the run's packing range, rounds and max-clients. 0 where saturation is not
    part of the analysis: he=false (nothing is saturated), dp-mode none / flower-central, and
    dp-mode local (each node's noisy update is its release; saturating it is post-processing,
    ``crypto.privacy``)."""
    from crypto import saturation_delta

    s = contribution_std(cfg)
    if not cfg.he or cfg.dp_mode != "distributed" or s <= 0:
        return 0.0
    clip_range = packing_for(cfg, dim).clip_range
    return saturation_delta(clip_range, coordinate_bound(cfg), s, max(dim, 1), cfg.max_clients, cfg.num_server_rounds)


def uses_error_feedback(cfg: RunConfig) -> bool:
    """Error feedback runs with he=true, packed, and not under distributed DP (crypto.privacy)."""
    return cfg.he and cfg.packing == "packed" and cfg.error_feedback and cfg.dp_mode != "distributed"


def wire_clip_norm(cfg: RunConfig) -> float:
    """The L2 bound of one encoded update's signal: C, or under adaptive clipping the norm of
    [Δ/C_t, a·(b - ½)], at most √(1 + a²/4)."""
    adaptive = adaptive_clipping_for(cfg)
    if adaptive is None:
        return cfg.clip_norm
    return math.hypot(1.0, adaptive.count_scale / 2)


def mean_bound_for(cfg: RunConfig, dim: int, real_scale_bits: int = 40) -> MeanBound:
    """The public bound a decrypted mean must respect (``crypto.aggregate_bound``), for he=true:
    C = ``wire_clip_norm``; noise (σC)² per update (local) or per sum (distributed) with (C, σ) of
    ``wire_noise``; rounding step²/12 per summand with a dither, step²/4 with stochastic
    rounding, plus step²/4 per update for the error-feedback carry; in mode none CKKS' error
    2^-(real_scale_bits - 20) (``real_scale_bits`` of the node's CKKS parameters) instead."""
    from crypto.aggregate_bound import MeanBound

    packing = packing_for(cfg, dim)
    c, sigma = wire_noise(cfg)
    noise_var = (sigma * c) ** 2
    packed = packing.mode == "packed"
    step2 = packing.step**2 if packed else 0.0
    return MeanBound(
        dim=dim,
        clip_norm=wire_clip_norm(cfg),
        update_noise_var=noise_var if cfg.dp_mode == "local" else 0.0,
        shared_noise_var=noise_var if cfg.dp_mode == "distributed" else 0.0,
        rounding_proxy=step2 / 12 if packing.dither else step2 / 4,
        carry_proxy=step2 / 4 if uses_error_feedback(cfg) else 0.0,
        ckks_error=0.0 if packed else 2.0 ** -(real_scale_bits - 20),
        unit_weights=cfg.dp_mode != "none",
        max_weight=client_max_weight(cfg),
        noise_replies=cfg.dp_mode == "distributed",
        max_clients=cfg.max_clients,
    )


def ckks_preset_for(cfg: RunConfig, dim: int) -> str:
    """The run's CKKS preset: ``ckks-preset``, or with "auto" the ring whose updates of ``dim``
    values are smallest under the run's packing (``crypto.preset_for``). Server-side only: the
    key-making node is told the resolved name."""
    if cfg.ckks_preset != "auto":
        return cfg.ckks_preset
    from crypto import AUTO_PRESETS, PQ_AUTO_PRESETS, preset_for

    names = PQ_AUTO_PRESETS if cfg.he_security == "post-quantum" else AUTO_PRESETS
    return preset_for(dim, packing_for(cfg, dim), names)


def client_max_weight(cfg: RunConfig) -> float:
    """Public bound on a client weight: 1 under DP (equal weights), else ``max-weight``."""
    return cfg.max_weight if cfg.dp_mode == "none" else 1.0


def client_weight(cfg: RunConfig, num_examples: int) -> tuple[float, bool]:
    """(FedAvg weight, was it capped). Equal weights under DP: the sensitivity analysis
    assumes each client counts once; example counts capped at ``max-weight`` otherwise."""
    if cfg.dp_mode != "none":
        return 1.0, False
    w = float(num_examples)
    return (cfg.max_weight, True) if w > cfg.max_weight else (w, False)


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
        ``dither`` this contribution's ``crypto.dither.dither`` when the packing is dithered;
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
