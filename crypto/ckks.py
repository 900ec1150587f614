"""Weighted aggregation of updates under CKKS that the server cannot read.

Round trip (every party holds the same public `PackingConfig`):

1. client: ``UpdateEncryptor(secret_ctx, packing).encrypt(vec, weight)`` pre-scales the flat
   update by its normalized weight w = weight/max_weight, saturates to the packing range,
   quantizes (stochastic rounding, or subtractive dither) and packs, puts w and a contribution
   count (1; m for a node's m noise shares, ``contributions=m``) into two reserved slot parts, and encrypts every ciphertext *symmetrically with a seed at the last
   modulus level* — one 60-bit limb, one polynomial plus a 64-byte seed.
2. server: ``CkksAggregator(public_ctx_bytes, packing)`` checks each update is a ciphertext of
   its context/config/layout and adds it; it never sees a weight, a count or a value.
   ``add_noise`` tops up encrypted Gaussian noise for clients that dropped out.
3. clients: ``AggregateDecryptor(secret_ctx, packing).decrypt_mean(agg, layout)`` decrypts,
   rounds packed sums to their exact integers, unpacks, subtracts the offsets and divides by the
   decrypted weight sum.

Why it is small: a seeded last-level ciphertext at N=4096 is 32,972 bytes for 2,048 complex
slots = 4,096 slot parts of 40 exact bits. Packed with headroom for 32 contributions, each part
holds three 13-bit fields (8-bit value + 5 bits): 2.69 bytes/param (0.67x fp32). With headroom
sized to the real contributors and 5 values per part (``PackingConfig.dense``: 5 nodes, 5-bit
values + 3 bits) it is 1.61 bytes/param (0.40x), the coarser grid paid back over rounds by error
feedback (`carry`). A model that fits one N=2048 ciphertext (``preset_for``: one 54-bit prime,
16.5 KB, 2,048 parts of 35 bits) uploads less than its fp32 plaintext. Mode "none" carries one
real per part: 8.07 bytes/param.

Around it: ``crypto.slot_plan`` (the slot layout and the ring choice, ``preset_for``),
``crypto.seal_ops`` (SEAL driven through `tenseal.sealapi`: the high-level `ckks_vector` neither
exposes complex slots nor keeps the symmetric seed) and ``crypto.header_check`` (the public
envelope checked against the round's encoding).

Threat model, briefly: the server is honest-but-curious and never holds the secret key; all
nodes share one secret key (TenSEAL has no threshold decryption), so a node can read another
node's update if it intercepts it — signatures and transport encryption are the guard there.
CKKS decryptions carry key-dependent noise (Li-Micciancio, IND-CPA-D): in mode "packed" the
result is rounded to exact integers, so nothing of that noise is revealed; in mode "none" the
decrypted mean must not be shown to the server in raw form. A key holder can encrypt values no
honest encoder would (any field, weight or count): nothing here proves a range, so nodes check the
decrypted mean against a public bound (``crypto.aggregate_bound``) and the server checks every
public header field of a summand before it adds it (``update_header_problem``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from crypto.context import (
    DEFAULT_PRESET,
    PRESETS,
    CkksContext,
    CkksParams,
    SecretContext,
    load_context,
    make_secret_context,
    public_context_bytes,
)
from crypto.errors import (
    AggregateRejectedError,
    DecryptionError,
    EmptyAggregateError,
    HeadroomError,
    LayoutMismatchError,
    NoSecretKeyError,
    NonFiniteUpdateError,
    NotACiphertextError,
    ParameterError,
    SaturationError,
    SecretKeyPresentError,
    WeightRangeError,
)
from crypto.layout import Layout, flatten, to_numpy
from crypto.header_check import parse_for
from crypto.packing import PackingConfig, saturate, unpack_fields
from crypto.seal_io import seal_save
from crypto.seal_ops import SealOps
from crypto.slot_plan import HEADER_PARTS, Packer, SlotPlan
from crypto.wire import (
    ENVELOPE_AGGREGATE,
    ENVELOPE_UPDATE,
    MODE_CODES,
    NO_LAYOUT,
    Envelope,
    pack_envelope,
)

__all__ = [
    "CkksParams",
    "PRESETS",
    "DEFAULT_PRESET",
    "PackingConfig",
    "CkksContext",
    "SecretContext",
    "make_secret_context",
    "public_context_bytes",
    "load_context",
    "Layout",
    "flatten",
    "EncryptReport",
    "AggregateResult",
    "RawAggregate",
    "UpdateEncryptor",
    "CkksAggregator",
    "AggregateDecryptor",
    "ciphertext_coefficients",
    "last_modulus",
]

AGGREGATOR_PHASES = ("parse", "deserialize", "add", "serialize")
_NOISE_MARGIN = 0.3  # max |decoded - nearest integer| accepted for packed parts (measured < 0.1)


@dataclass(frozen=True)
class EncryptReport:
    """What the last `encrypt` did: sizes and how many values were saturated."""

    n_values: int
    n_ciphertexts: int
    nbytes: int
    saturated: int
    weight: float  # the normalized weight actually used (after fixed-point rounding when packed)


@dataclass(frozen=True)
class RawAggregate:
    sums: np.ndarray  # packed: exact int64 sums of the quantized fields; none: real sums
    weight_sum: float  # normalized (sum of weight/max_weight)
    contributions: int
    n_updates: int


@dataclass(frozen=True)
class AggregateResult:
    mean: np.ndarray  # weighted mean, float64, flat
    weight_sum: float  # sum of client weights, in the caller's units (normalized * max_weight)
    contributions: int  # clients + server noise shares summed into this aggregate
    n_updates: int  # client updates the server says it added


def _as_vector(update: Any, layout: Layout | None) -> tuple[np.ndarray, Layout | None]:
    if isinstance(update, Mapping):
        if layout is not None:
            vec = layout.flatten(update)
            if not np.isfinite(vec).all():
                raise NonFiniteUpdateError("update contains NaN or Inf; refused before encryption")
            return vec, layout
        return flatten(update)
    vec = to_numpy(update)
    if vec.ndim != 1:
        raise LayoutMismatchError(f"expected a flat vector, got shape {vec.shape}; use crypto.flatten")
    if layout is not None and vec.shape[0] != layout.size:
        raise LayoutMismatchError(f"vector of {vec.shape[0]} values does not fit layout of size {layout.size}")
    if not np.issubdtype(vec.dtype, np.number):
        raise LayoutMismatchError(f"update dtype {vec.dtype} is not numeric")
    vec = vec.astype(np.float64, copy=False)
    if not np.isfinite(vec).all():
        raise NonFiniteUpdateError(
            f"update contains {int(np.count_nonzero(~np.isfinite(vec)))} NaN/Inf values; refused before encryption"
        )
    return vec, layout


def _checked_carry(carry: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    carry = np.asarray(carry, dtype=np.float64)
    if carry.shape != shape:
        raise LayoutMismatchError(f"carry shape {carry.shape} != update shape {shape}")
    if not np.isfinite(carry).all():
        raise NonFiniteUpdateError("carry (error-feedback residual) contains NaN or Inf")
    return carry


class UpdateEncryptor:
    """Client side: encrypt one flat update (pre-scaled by its weight) into bytes.

    With a secret context (every node has one) ciphertexts are seeded symmetric encryptions;
    with a public-only context it falls back to public-key encryption (twice the size).
    `rng` drives stochastic rounding; default: fresh OS entropy.
    """

    def __init__(
        self,
        context: CkksContext,
        packing: PackingConfig | None = None,
        *,
        rng: np.random.Generator | None = None,
    ) -> None:
        self.context = context
        self.packing = packing or PackingConfig()
        self._plan = SlotPlan(context.params, self.packing)
        self._ops = SealOps(context)
        self._packer = Packer(self._plan, rng if rng is not None else np.random.default_rng())
        self.last_report: EncryptReport | None = None
        self.total_saturated = 0
        self.last_residual: np.ndarray | None = None
        """What the last `encrypt` did not send (pre-scaled domain): the value it was to encode
        minus the value its ciphertext stands for (rounding + saturation). Error feedback passes
        it as the next round's `carry`."""

    def encrypt(
        self,
        update: np.ndarray | Mapping[str, Any],
        weight: float = 1.0,
        *,
        layout: Layout | None = None,
        noise: np.ndarray | None = None,
        carry: np.ndarray | None = None,
        dither: np.ndarray | None = None,
        contributions: int = 1,
    ) -> bytes:
        """Encrypt `update` (flat vector or dict of tensors) with client weight `weight`.

        `noise` (same length) is added *after* the weight pre-scale, before quantization: the
        right place for distributed-DP shares when weights differ, because noise added to the
        update itself would be scaled down with the weight. `carry` (error feedback: the
        previous round's `last_residual`) is added after the noise. Values then outside the
        packing range are saturated and counted in `last_report.saturated`; what rounding and
        saturation leave out is `last_residual`. `dither` (``crypto.dp.dither``, values in [0, 1))
        is required exactly when the packing says ``dither=True``.

        `contributions` m > 1 sends m noise shares as one summand (weight 0, `noise` their sum
        of std s·√m): range ±m·R and offset m·R, as ``CkksAggregator.add_noise`` encodes, so it
        saturates far less often than one contribution of range R would (``crypto.dp.saturation``).
        The envelope's count field carries m, so the server's headroom check counts m.
        """
        plan, pk = self._plan, self.packing
        vec, layout = _as_vector(update, layout)
        w = self._normalized_weight(weight)
        m = self._checked_contributions(contributions, w)
        if plan.packed:  # fixed-point weight: the value pre-scaled here is exactly the one summed
            w_int = float(np.rint(w * 2.0**plan.wfrac))
            w = w_int / 2.0**plan.wfrac
            header = (w_int, float(m))
        else:
            header = (w, float(m))
        wanted = self._to_encode(vec, w, noise, carry)
        y, saturated = saturate(wanted, m * pk.clip_range)
        if saturated and pk.on_saturation == "raise":
            raise SaturationError(f"{saturated} values outside ±{m * pk.clip_range}")
        data, sent = self._packer.quantize(y, contributions=m, u=self._checked_dither(dither, vec.shape))
        parts = self._packer.assemble(header, data, vec.shape[0])
        blobs = self._ops.encrypt_parts(parts, plan.scale, symmetric=self.context.is_private)
        env = Envelope(ENVELOPE_UPDATE, MODE_CODES[pk.mode], self.context.key_id, pk.fingerprint(),
                       layout.digest() if layout is not None else NO_LAYOUT, vec.shape[0], m, tuple(blobs))
        out = pack_envelope(env)
        self.last_report = EncryptReport(vec.shape[0], len(blobs), len(out), saturated, w)
        self.total_saturated += saturated
        self.last_residual = wanted - sent
        return out

    @staticmethod
    def _to_encode(vec: np.ndarray, w: float, noise: np.ndarray | None, carry: np.ndarray | None) -> np.ndarray:
        """The weighted update plus the noise share and the carried residual, in that order."""
        y = vec * w
        if noise is not None:
            noise = np.asarray(noise, dtype=np.float64)
            if noise.shape != vec.shape:
                raise LayoutMismatchError(f"noise shape {noise.shape} != update shape {vec.shape}")
            if not np.isfinite(noise).all():
                raise NonFiniteUpdateError("noise contains NaN or Inf")
            y = y + noise
        if carry is not None:
            y = y + _checked_carry(carry, vec.shape)
        return y

    def _checked_contributions(self, contributions: int, w: float) -> int:
        if not (isinstance(contributions, (int, np.integer)) and not isinstance(contributions, bool)
                and 1 <= contributions <= self.packing.max_clients):
            raise ParameterError(f"contributions must be an int in [1, max_clients={self.packing.max_clients}], "
                                 f"not {contributions!r}")
        if contributions > 1 and w != 0:
            raise ParameterError("contributions > 1 stands for noise shares: the weight must be 0")
        return int(contributions)

    def _checked_dither(self, u: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | None:
        if not (self.packing.dither and self._plan.packed):
            if u is not None:
                raise ParameterError("a dither was given but this packing does not use one")
            return None
        if u is None:
            raise ParameterError("this packing is dithered: encrypt needs dither=crypto.dp.dither.dither(...)")
        u = np.asarray(u, dtype=np.float64)
        if u.shape != shape or not np.isfinite(u).all() or u.min(initial=0.0) < 0 or u.max(initial=0.0) >= 1:
            raise LayoutMismatchError(f"dither must be {shape} values in [0, 1)")
        return u

    def _normalized_weight(self, weight: float) -> float:
        try:
            weight = float(weight)
        except (TypeError, ValueError) as exc:
            raise WeightRangeError(f"weight must be a number, not {weight!r}") from exc
        if not math.isfinite(weight):
            raise NonFiniteUpdateError(f"weight is {weight}")
        if weight < 0 or weight > self.packing.max_weight:
            raise WeightRangeError(f"weight {weight} outside [0, max_weight={self.packing.max_weight}]")
        return weight / self.packing.max_weight



class CkksAggregator:
    """Server side: sums encrypted updates holding the *public* context only.

    `add` validates a ciphertext completely (format, key, packing, layout, SEAL validity,
    headroom) before touching the running sum, so a rejected input leaves the state unchanged.
    """

    def __init__(
        self,
        public_context: bytes | CkksContext,
        packing: PackingConfig | None = None,
        *,
        expected_values: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        ctx = load_context(public_context) if not isinstance(public_context, CkksContext) else public_context
        if ctx.is_private:
            raise SecretKeyPresentError("the aggregator must be given the public context only")
        self.context = ctx
        self.packing = packing or PackingConfig()
        self._plan = SlotPlan(ctx.params, self.packing)
        self._ops = SealOps(ctx)
        # server noise must be unpredictable to clients: OS entropy unless a test seeds it
        self._rng = rng if rng is not None else np.random.default_rng()
        self.expected_values = expected_values
        self._acc: list[Any] | None = None
        self._n_values: int | None = expected_values
        self._layout_fp: bytes | None = None
        self.count = 0  # updates added (summands: client updates and node noise replies)
        self.update_contributions = 0  # contributions those updates carry (a noise reply: its shares)
        self.noise_shares = 0  # server noise shares added
        self.noise_saturated = 0
        self.seconds = dict.fromkeys(AGGREGATOR_PHASES, 0.0)
        """Where `add` and `result` spent their time, summed over calls (the results JSON's
        server phases): header checks, SEAL load + validation, homomorphic add, serialization."""

    @property
    def contributions(self) -> int:
        """Offsets in the packed fields: every update's declared contributions plus server shares."""
        return self.update_contributions + self.noise_shares

    def add(self, data: bytes) -> None:
        """Add one client's encrypted update (or a node's noise reply of m shares) to the sum."""
        t0 = time.perf_counter()
        env = self._parse(data, ENVELOPE_UPDATE)
        if not 1 <= env.n_updates <= self.packing.max_clients:
            raise NotACiphertextError(f"an update declaring {env.n_updates} contributions")
        if self.contributions + env.n_updates > self.packing.max_clients:
            raise HeadroomError(
                f"aggregate already holds {self.contributions} contributions; {env.n_updates} more with "
                f"max_clients={self.packing.max_clients} would overflow the packed fields"
            )
        t1 = time.perf_counter()
        cts = self._ops.load_checked(env.ciphertexts, self._plan.scale)
        t2 = time.perf_counter()
        self._accumulate(cts)
        self.seconds["parse"] += t1 - t0
        self.seconds["deserialize"] += t2 - t1
        self.seconds["add"] += time.perf_counter() - t2
        self._n_values = env.n_values
        self._layout_fp = env.layout_fp
        self.count += 1
        self.update_contributions += env.n_updates

    def add_noise(self, std: float, shares: int = 1, rng: np.random.Generator | None = None) -> int:
        """Add encrypted Gaussian noise standing in for `shares` missing clients' noise shares.

        Each share has standard deviation `std` (per coordinate, in the pre-scaled domain, e.g.
        ``privacy.noise_std(sigma, C, "distributed", n)``); the sum of `shares` is drawn at
        once (std*sqrt(shares)), quantized like a client contribution with `shares` offsets and
        encrypted with the public key. Returns how many values were saturated. `rng` overrides
        the aggregator's generator for this call (tests); default: OS entropy.
        """
        if self._n_values is None:
            raise EmptyAggregateError("add_noise needs the vector length: add an update first or pass expected_values")
        if not (isinstance(shares, int) and shares >= 1):
            raise ValueError(f"shares must be a positive int, not {shares!r}")
        if not (math.isfinite(std) and std >= 0):
            raise NonFiniteUpdateError(f"noise std must be finite and >= 0, not {std}")
        if self.contributions + shares > self.packing.max_clients:
            raise HeadroomError(
                f"{self.contributions} + {shares} noise shares exceed max_clients={self.packing.max_clients}"
            )
        n = self._n_values
        gen = rng if rng is not None else self._rng
        z = gen.normal(0.0, std * math.sqrt(shares), size=n)
        z, saturated = saturate(z, shares * self.packing.clip_range)
        packer = Packer(self._plan, gen)
        parts = packer.assemble((0.0, float(shares)), packer.encode_values(z, contributions=shares), n)
        blobs = self._ops.encrypt_parts(parts, self._plan.scale, symmetric=False)
        self._accumulate(self._ops.load_checked(tuple(blobs), self._plan.scale))
        self.noise_shares += shares
        self.noise_saturated += saturated
        return saturated

    def result(self) -> bytes:
        """The encrypted aggregate (not seeded: a sum is a full ciphertext, 2x an update)."""
        if self._acc is None or self.count == 0:
            raise EmptyAggregateError("no update has been added")
        t0 = time.perf_counter()
        env = Envelope(
            ENVELOPE_AGGREGATE,
            MODE_CODES[self.packing.mode],
            self.context.key_id,
            self.packing.fingerprint(),
            self._layout_fp or NO_LAYOUT,
            int(self._n_values or 0),
            self.count,
            tuple(seal_save(ct) for ct in self._acc),
        )
        out = pack_envelope(env)
        self.seconds["serialize"] += time.perf_counter() - t0
        return out

    def reset(self) -> None:
        self._acc = None
        self._n_values = self.expected_values
        self._layout_fp = None
        self.count = self.update_contributions = self.noise_shares = self.noise_saturated = 0

    # --- internals ---
    def _parse(self, data: bytes, kind: int) -> Envelope:
        env = parse_for(self.context, self.packing, self._plan, data)
        if env.kind != kind:
            raise NotACiphertextError("expected a client update, got an aggregate")
        if self._n_values is not None and env.n_values != self._n_values:
            raise LayoutMismatchError(f"update has {env.n_values} values, aggregate has {self._n_values}")
        if self._layout_fp is not None and env.layout_fp != self._layout_fp:
            raise LayoutMismatchError("update was made for another tensor layout than the aggregate")
        return env

    def _accumulate(self, cts: list[Any]) -> None:
        if self._acc is None:
            self._acc = cts
            return
        if len(cts) != len(self._acc):  # cannot happen after the n_values check; keep the sum intact
            raise LayoutMismatchError("ciphertext count differs from the aggregate")
        for acc, ct in zip(self._acc, cts):
            self._ops.evaluator.add_inplace(acc, ct)


class AggregateDecryptor:
    """Client side: decrypt an aggregate to the weighted mean (needs the secret context)."""

    def __init__(self, secret_context: CkksContext, packing: PackingConfig | None = None) -> None:
        if not secret_context.is_private:
            raise NoSecretKeyError("decryption needs the secret context; this one is public-only")
        self.context = secret_context
        self.packing = packing or PackingConfig()
        self._plan = SlotPlan(secret_context.params, self.packing)
        self._ops = SealOps(secret_context)

    def decrypt_raw(
        self, data: bytes, layout: Layout | None = None, *, accept: Callable[[np.ndarray], bool] | None = None
    ) -> RawAggregate:
        """Decrypt to the raw sums: exact integer field sums (packed) or real sums (none).

        `accept` (e.g. ``AggregateMac.check``) sees the ciphertexts' coefficients before anything
        is decrypted; False raises `AggregateRejectedError`. Passing it here instead of calling
        ``ciphertext_coefficients`` first loads each ciphertext once, not twice.
        """
        plan, pk = self._plan, self.packing
        env = parse_for(self.context, pk, plan, data)
        if layout is not None:
            if layout.size != env.n_values:
                raise LayoutMismatchError(f"aggregate has {env.n_values} values, layout has {layout.size}")
            if env.layout_fp not in (NO_LAYOUT, layout.digest()):
                raise LayoutMismatchError("aggregate was made for another tensor layout")
        cts = self._ops.load_checked(env.ciphertexts, plan.scale)
        if accept is not None:
            from crypto.binding import coefficients

            if not accept(coefficients(cts)):
                raise AggregateRejectedError("the aggregate is not the sum its manifest announces")
        parts = self._ops.decrypt_parts(cts)
        n = env.n_values
        if plan.packed:
            ints = np.rint(parts)
            worst = float(np.max(np.abs(parts - ints)))
            if worst > _NOISE_MARGIN or ints.min() < 0 or ints.max() >= 2.0**plan.params.slot_bits:
                raise DecryptionError(
                    f"decrypted slots are not the packed integers they must be (noise {worst:.3g}): "
                    "corrupted aggregate or a key that does not match"
                )
            ints = ints.astype(np.int64)
            w_sum = ints[0] / 2.0**plan.wfrac
            contributions = int(ints[1])
            self._check_header(w_sum, contributions)
            sums: np.ndarray = unpack_fields(
                ints[HEADER_PARTS : HEADER_PARTS + plan.n_data_parts(n)], pk.field_bits, plan.k, n
            )
        else:
            w_sum = float(parts[0])
            contributions = int(np.rint(parts[1]))
            if abs(parts[1] - contributions) > 1e-3:
                raise DecryptionError("contribution count did not decrypt to an integer: corrupted or wrong key")
            self._check_header(w_sum, contributions)
            sums = parts[HEADER_PARTS : HEADER_PARTS + n]
        return RawAggregate(sums, w_sum, contributions, env.n_updates)

    def decrypt(
        self, data: bytes, layout: Layout | None = None, *, accept: Callable[[np.ndarray], bool] | None = None,
        dither_total: np.ndarray | None = None,
    ) -> AggregateResult:
        """Decrypt an aggregate (or a single update) to the weighted mean (`accept`: see decrypt_raw).

        A dithered packing needs `dither_total` (``crypto.dp.dither.dither_total`` of the summands)."""
        raw = self.decrypt_raw(data, layout, accept=accept)
        pk = self.packing
        if raw.weight_sum <= 0:
            raise EmptyAggregateError("weight sum is zero: no client weight in this aggregate")
        if self._plan.packed:  # undo the per-contribution offset R (and the dithers)
            sums = raw.sums - self._checked_total(dither_total, raw.sums.shape)
            total = sums * pk.step - pk.clip_range * raw.contributions
        else:
            total = raw.sums
        return AggregateResult(total / raw.weight_sum, raw.weight_sum * pk.max_weight, raw.contributions, raw.n_updates)

    def decrypt_mean(
        self, data: bytes, layout: Layout | None = None, *, as_torch: bool = False
    ) -> np.ndarray | dict[str, Any]:
        """Weighted mean as a flat vector, or unflattened into named tensors if `layout` given."""
        mean = self.decrypt(data, layout).mean
        return layout.unflatten(mean, as_torch=as_torch) if layout is not None else mean

    def _checked_total(self, total: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | float:
        if not self.packing.dither:
            if total is not None:
                raise ParameterError("a dither total was given but this packing does not use one")
            return 0.0
        if total is None:
            raise ParameterError("this packing is dithered: decrypt needs dither_total=crypto.dp.dither.dither_total(...)")
        total = np.asarray(total, dtype=np.float64)
        if total.shape != shape or not np.isfinite(total).all():
            raise LayoutMismatchError(f"dither_total must be {shape} finite values")
        return total

    def _check_header(self, w_sum: float, contributions: int) -> None:
        if not (1 <= contributions <= self.packing.max_clients) or not (
            -1e-6 <= w_sum <= self.packing.max_clients + 1e-6
        ):
            raise DecryptionError(
                f"implausible aggregate header (weight sum {w_sum:g}, {contributions} contributions): "
                "corrupted aggregate or a key that does not match"
            )


def ciphertext_coefficients(ctx: CkksContext, packing: PackingConfig, data: bytes) -> np.ndarray:
    """Coefficients (mod q0) of every ciphertext in an update or aggregate, for ``crypto.binding``."""
    from crypto.binding import coefficients

    plan = SlotPlan(ctx.params, packing)
    env = parse_for(ctx, packing, plan, data)
    return coefficients(SealOps(ctx).load_checked(env.ciphertexts, plan.scale))


def last_modulus(ctx: CkksContext) -> int:
    """q0: the one prime left at the level where fedkv ciphertexts live."""
    return int(ctx.seal.last_context_data().parms().coeff_modulus()[0].value())
