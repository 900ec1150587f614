"""Quantized packing of update values into exact integers (BatchCrypt's idea on CKKS slots).

A CKKS slot part (the real or the imaginary half of a complex slot) carries an integer of up to
`CkksParams.slot_bits` bits *exactly* once the decryption noise (< 0.1 at the preset scales) is
rounded away. We cut that integer into `k` fields of `field_bits` bits; each field holds one
value quantized to `bits` bits plus `ceil(log2(max_clients))` bits of headroom, so the
homomorphic sum of up to `max_clients` contributions never carries from one field into the next.

Signed values use an offset rather than two's complement: client i sends
``q_i = stochastic_round((y_i + R) / step)`` in ``[0, 2^bits - 1]`` with ``step = 2R/(2^bits-1)``,
so every field sum is a non-negative integer below ``max_clients * (2^bits - 1) < 2^field_bits``
and the true sum is recovered as ``step * Q - R * contributions``. The number of contributions
travels encrypted in its own slot part, so the server needs no plaintext bookkeeping.

Relation to DP clipping (`crypto.dp.privacy.clip_update`): after L2 clipping to ``clip_norm`` C, no
single coordinate exceeds C, so ``clip_range = C`` never saturates without noise but is coarse for
large models; coordinates are typically ~C/sqrt(d). With distributed noise of std ``sigma*C/sqrt(n)``
per client, a heuristic ``clip_range`` is about 4-5 noise std plus the signal tail
(`suggest_clip_range`); under DP the range must make saturation improbable for *every* clipped
update, which ``crypto.dp.saturation.dp_clip_range`` sizes against a δ budget (``crypto.dp.privacy``,
the coupling bound). Values beyond the range are *saturated and counted* — never wrapped.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from crypto.errors import ParameterError

__all__ = [
    "PackingConfig",
    "pack_fields",
    "unpack_fields",
    "stochastic_quantize",
    "dequantize",
    "dithered_quantize",
    "saturate",
    "suggest_clip_range",
]

Mode = Literal["none", "packed"]


@dataclass(frozen=True)
class PackingConfig:
    """How update values are put into slots. Public: the server must hold the same config.

    mode:        "packed" (default) quantizes to `bits` and packs several values per slot part;
                 "none" sends each value as an approximate CKKS real (2 values per complex slot).
    bits:        quantization bits per value (packed mode). Default 8.
    clip_range:  R; values (after weight pre-scaling and any noise) are saturated to [-R, R] and
                 counted, in both modes. Default 1.0.
    max_clients: most contributions one aggregate may hold (clients + server noise shares);
                 sets the headroom bits. Default 32: with 8 bits this still packs 3 values per
                 40-bit slot part (13-bit fields), so it costs nothing over 10 clients.
    max_weight:  public upper bound on a client weight (e.g. the largest example count); each
                 client pre-scales by weight/max_weight in [0, 1]. Default 1.0.
    on_saturation: "count" (default) saturates and counts; "raise" raises SaturationError.
    """

    mode: Mode = "packed"
    bits: int = 8
    clip_range: float = 1.0
    max_clients: int = 32
    max_weight: float = 1.0
    on_saturation: Literal["count", "raise"] = "count"
    dither: bool = False
    """Subtractive dither instead of stochastic rounding (``crypto.dp.dither``): every client
    passes ``dither=`` to encrypt, every decoder the summands' ``dither_total``. For
    dp-mode distributed, where the rounding error must not depend on a client's data."""

    def __post_init__(self) -> None:
        if self.mode not in ("none", "packed"):
            raise ParameterError(f"packing mode must be 'none' or 'packed', not {self.mode!r}")
        if not (isinstance(self.bits, int) and 1 <= self.bits <= 24):
            raise ParameterError(f"bits must be an int in [1, 24], not {self.bits!r}")
        if not (math.isfinite(self.clip_range) and self.clip_range > 0):
            raise ParameterError(f"clip_range must be finite and > 0, not {self.clip_range!r}")
        if not (isinstance(self.max_clients, int) and self.max_clients >= 1):
            raise ParameterError(f"max_clients must be an int >= 1, not {self.max_clients!r}")
        if not (math.isfinite(self.max_weight) and self.max_weight > 0):
            raise ParameterError(f"max_weight must be finite and > 0, not {self.max_weight!r}")
        if self.on_saturation not in ("count", "raise"):
            raise ParameterError("on_saturation must be 'count' or 'raise'")

    @classmethod
    def dense(cls, slot_bits: int, max_clients: int, values_per_part: int = 5, **kwargs: object) -> PackingConfig:
        """The packing that puts `values_per_part` values in each `slot_bits`-bit slot part with
        headroom for exactly `max_clients` contributions: bits = slot_bits // values_per_part -
        headroom. Why: bytes per parameter are 8 / values_per_part (5: 1.6 B, 0.4x fp32); the
        coarser grid is paid back over rounds by error feedback (``UpdateEncryptor`` ``carry``)."""
        headroom = (max_clients - 1).bit_length()
        bits = slot_bits // values_per_part - headroom
        if bits < 1:
            raise ParameterError(f"{values_per_part} values of {headroom} headroom bits do not fit {slot_bits} bits")
        return cls(mode="packed", bits=bits, max_clients=max_clients, **kwargs)  # type: ignore[arg-type]

    # --- derived quantities ---
    @property
    def levels(self) -> int:
        """Largest quantized value L = 2^bits - 1 (values are integers in [0, L])."""
        return (1 << self.bits) - 1

    @property
    def step(self) -> float:
        """Quantization step 2R/L: the per-client grid in the pre-scaled domain."""
        return 2.0 * self.clip_range / self.levels

    @property
    def headroom_bits(self) -> int:
        """ceil(log2(max_clients)): bits that absorb the carries of the sum."""
        return (self.max_clients - 1).bit_length()

    @property
    def field_bits(self) -> int:
        return self.bits + self.headroom_bits

    def fields_per_part(self, slot_bits: int) -> int:
        """Values per slot part: 1 in mode none, floor(slot_bits / field_bits) when packed."""
        if self.mode == "none":
            return 1
        return slot_bits // self.field_bits

    def weight_frac_bits(self, slot_bits: int) -> int:
        """Fixed-point fraction bits of the encrypted weight (sum of max_clients fits exactly)."""
        return slot_bits - self.headroom_bits - 1

    def mean_error_bound(self, weight_sum: float, contributions: int, *, real_scale_bits: int = 40) -> float:
        """Documented worst-case |decrypted mean - plaintext weighted mean| (no saturation).

        packed: each contribution's stochastic rounding error is < step in the pre-scaled
        domain, so the mean is off by < step * contributions / weight_sum, where weights are the
        normalized weight/max_weight (equal full weights: < one step). Typical errors are far
        smaller (about step*sqrt(contributions/6)/weight_sum per coordinate). The CKKS noise
        itself is rounded away exactly.
        none: CKKS noise only; < 2^-(real_scale_bits-20) / weight_sum (~1e-6/W at 2^40;
        measured ~1e-8).

        With error feedback (each client passes its ``last_residual`` as the next ``carry``) the
        per-round error is the same, but it does not accumulate: what one round leaves out the
        next sends, so over any number of rounds the running sum of decrypted means differs from
        the running sum of true means by the clients' last residuals only — < step per client
        and coordinate without saturation, i.e. still < step * contributions / weight_sum
        (``tests/crypto/test_error_feedback.py``). With ``dither`` each client's error is
        uniform on one step (< step/2 in absolute value), independent of the value.
        """
        if weight_sum <= 0:
            return math.inf
        if self.mode == "packed":
            return self.step * contributions / weight_sum
        return 2.0 ** -(real_scale_bits - 20) / weight_sum

    def fingerprint(self) -> bytes:
        """8 bytes identifying everything that changes the encoding (embedded in ciphertexts)."""
        return _fingerprint(self)


@functools.lru_cache(maxsize=64)
def _fingerprint(cfg: PackingConfig) -> bytes:
    """Cached: every encrypt and every parse asks, and asdict + JSON + SHA-256 cost ~4 ms."""
    public = asdict(cfg)
    public.pop("on_saturation")  # a local policy; does not change the encoding
    blob = json.dumps(public, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"fedkv-packing-v1" + blob).digest()[:8]


def saturate(y: np.ndarray, bound: float) -> tuple[np.ndarray, int]:
    """Clip to [-bound, bound]; return the clipped array and how many values were outside."""
    over = int(np.count_nonzero(np.abs(y) > bound))
    if over:
        y = np.clip(y, -bound, bound)
    return y, over


def stochastic_quantize(
    y: np.ndarray, clip_range: float, levels: int, rng: np.random.Generator, contributions: int = 1
) -> np.ndarray:
    """Unbiased stochastic rounding of y (already within ±contributions*R) to integers.

    Returns q in [0, contributions*levels] with E[q] = (y + contributions*R) / step.
    """
    step = 2.0 * clip_range / levels
    u = (np.asarray(y, dtype=np.float64) + contributions * clip_range) / step
    fl = np.floor(u)
    q = fl + (rng.random(u.shape) < (u - fl))
    np.clip(q, 0, contributions * levels, out=q)  # float edge cases only: y was saturated first
    return q.astype(np.int64)


def dithered_quantize(
    y: np.ndarray, clip_range: float, levels: int, u: np.ndarray, contributions: int = 1
) -> np.ndarray:
    """``floor((y + m·R)/step + u)`` in [0, m·levels] for y within ±m·R (m = `contributions`,
    e.g. m noise shares sent as one summand): with u ~ U[0, 1) the error of ``q - u + 1/2`` is
    uniform and independent of y (``crypto.dp.dither``)."""
    step = 2.0 * clip_range / levels
    q = np.floor((np.asarray(y, dtype=np.float64) + contributions * clip_range) / step + u)
    np.clip(q, 0, contributions * levels, out=q)  # float edge cases only: y was saturated first
    return q.astype(np.int64)


def dequantize(q: np.ndarray, clip_range: float, levels: int, contributions: int = 1) -> np.ndarray:
    """The value a quantized integer stands for: ``q * step - contributions * R``."""
    return np.asarray(q, dtype=np.float64) * (2.0 * clip_range / levels) - contributions * clip_range


def pack_fields(q: np.ndarray, field_bits: int, k: int) -> np.ndarray:
    """Pack non-negative ints (each < 2^field_bits) k per integer: value i*k+j goes to field j."""
    if k * field_bits > 62:
        raise ParameterError("packed integer would not fit in int64")
    n_parts = -(-q.shape[0] // k)
    padded = np.zeros(n_parts * k, dtype=np.int64)
    padded[: q.shape[0]] = q
    shifts = np.arange(k, dtype=np.int64) * field_bits
    return (padded.reshape(n_parts, k) << shifts).sum(axis=1)


def unpack_fields(packed: np.ndarray, field_bits: int, k: int, n: int) -> np.ndarray:
    """Inverse of `pack_fields` for the first n values."""
    shifts = np.arange(k, dtype=np.int64) * field_bits
    mask = (1 << field_bits) - 1
    fields = (np.asarray(packed, dtype=np.int64)[:, None] >> shifts) & mask
    return fields.reshape(-1)[:n]


def suggest_clip_range(noise_std: float, clip_norm: float, dim: int, tail: float = 4.0) -> float:
    """A packing range that saturates rarely: tail * sqrt(noise_std^2 + (clip_norm/sqrt(dim))^2).

    Heuristic, documented rather than optimal: the signal of an update clipped to L2 norm C over
    `dim` coordinates has RMS C/sqrt(dim); independent Gaussian noise adds in quadrature.
    Saturations are counted by the encryptor, so a too-small range shows up in its report.
    """
    rms = math.sqrt(noise_std**2 + (clip_norm / math.sqrt(max(dim, 1))) ** 2)
    return tail * rms
