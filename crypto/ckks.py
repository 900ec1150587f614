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

SEAL objects are driven through `tenseal.sealapi` because the high-level `ckks_vector` neither
exposes complex slots nor keeps the symmetric seed.

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
import tenseal.sealapi as sealapi

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
    ContextMismatchError,
    DecryptionError,
    EmptyAggregateError,
    HeadroomError,
    LayoutMismatchError,
    NoSecretKeyError,
    NonFiniteUpdateError,
    NotACiphertextError,
    PackingMismatchError,
    ParameterError,
    SaturationError,
    SecretKeyPresentError,
    WeightRangeError,
)
from crypto.layout import Layout, flatten, to_numpy
from crypto.packing import (
    PackingConfig,
    dequantize,
    dithered_quantize,
    pack_fields,
    saturate,
    stochastic_quantize,
    unpack_fields,
)
from crypto.seal_io import seal_load_ciphertext, seal_save
from crypto.wire import (
    ENVELOPE_AGGREGATE,
    ENVELOPE_UPDATE,
    MODE_CODES,
    NO_LAYOUT,
    Envelope,
    pack_envelope,
    parse_envelope,
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
    "ciphertext_info",
    "update_header_problem",
    "preset_for",
    "AUTO_PRESETS",
    "PQ_AUTO_PRESETS",
    "update_bytes_estimate",
]

AGGREGATOR_PHASES = ("parse", "deserialize", "add", "serialize")
_HEADER_PARTS = 2  # slot part 0: weight sum, part 1: contribution count
_NOISE_MARGIN = 0.3  # max |decoded - nearest integer| accepted for packed parts (measured < 0.1)


@dataclass(frozen=True)
class _Plan:
    """Everything derived from (CkksParams, PackingConfig) that fixes the slot layout."""

    params: CkksParams
    packing: PackingConfig

    def __post_init__(self) -> None:
        pk, pa = self.packing, self.params
        if pk.mode == "packed":
            if self.k < 1:
                raise ParameterError(
                    f"a {pk.field_bits}-bit field (bits={pk.bits} + headroom {pk.headroom_bits}) "
                    f"does not fit a {pa.slot_bits}-bit slot part"
                )
            if self.wfrac < 16:
                raise ParameterError("max_clients too large for the weight slot")
        else:
            bound = pa.real_value_bound(pk.max_clients)
            if pk.clip_range > bound:
                raise ParameterError(
                    f"mode none: clip_range {pk.clip_range} x max_clients {pk.max_clients} would "
                    f"overflow q0 at scale 2^{pa.real_scale_bits}; use clip_range <= {bound:g}"
                )

    @property
    def packed(self) -> bool:
        return self.packing.mode == "packed"

    @property
    def k(self) -> int:
        return self.packing.fields_per_part(self.params.slot_bits)

    @property
    def wfrac(self) -> int:
        return self.packing.weight_frac_bits(self.params.slot_bits)

    @property
    def scale(self) -> float:
        bits = self.params.packed_scale_bits if self.packed else self.params.real_scale_bits
        return float(2**bits)

    @property
    def parts_per_ct(self) -> int:
        return self.params.slot_parts

    def n_data_parts(self, n_values: int) -> int:
        return -(-n_values // self.k)

    def n_ciphertexts(self, n_values: int) -> int:
        return max(1, -(-(_HEADER_PARTS + self.n_data_parts(n_values)) // self.parts_per_ct))

    @property
    def max_ciphertext_bytes(self) -> int:
        # size-2 ciphertext with every limb, uncompressed, plus SEAL's header: a generous cap
        n, limbs = self.params.poly_modulus_degree, len(self.params.coeff_mod_bit_sizes)
        return 2 * n * limbs * 8 + 4096

    def bytes_per_param_estimate(self) -> float:
        """Seeded symmetric ciphertext: one N-coefficient 64-bit polynomial per N*k values."""
        return 8.0 / self.k


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


class _SealOps:
    """SEAL encoder / encryptor / evaluator bound to one context (built once, reused)."""

    def __init__(self, ctx: CkksContext) -> None:
        self.ctx = ctx
        seal = ctx.seal
        self.seal = seal
        self.encoder = sealapi.CKKSEncoder(seal)
        self.parms_id = seal.last_parms_id()
        self.evaluator = sealapi.Evaluator(seal)
        self.half = ctx.params.poly_modulus_degree // 2
        self.sym_encryptor = sealapi.Encryptor(seal, ctx.secret_key()) if ctx.is_private else None
        self.pub_encryptor = sealapi.Encryptor(seal, ctx.public_key())
        self.decryptor = sealapi.Decryptor(seal, ctx.secret_key()) if ctx.is_private else None

    def encrypt_parts(self, parts: np.ndarray, scale: float, *, symmetric: bool) -> list[bytes]:
        """Encode N real parts per ciphertext as N/2 complex slots and encrypt at the last level."""
        n = 2 * self.half
        out = []
        for start in range(0, parts.shape[0], n):
            chunk = parts[start : start + n]
            z = chunk[: self.half] + 1j * chunk[self.half :]
            pt = sealapi.Plaintext()
            self.encoder.encode(z.tolist(), self.parms_id, scale, pt)
            if symmetric:
                assert self.sym_encryptor is not None
                out.append(seal_save(self.sym_encryptor.encrypt_symmetric(pt)))  # seeded
            else:
                ct = sealapi.Ciphertext()
                self.pub_encryptor.encrypt(pt, ct)
                out.append(seal_save(ct))
        return out

    def load_checked(self, blobs: tuple[bytes, ...], scale: float) -> list[Any]:
        """Load every ciphertext and check level, size, NTT form and scale; all or nothing."""
        cts = []
        for i, blob in enumerate(blobs):
            ct = seal_load_ciphertext(self.seal, blob)
            if ct.parms_id() != self.parms_id or ct.size() != 2 or not ct.is_ntt_form():
                raise NotACiphertextError(f"ciphertext {i} is not a fresh last-level CKKS ciphertext")
            if not math.isclose(ct.scale, scale, rel_tol=1e-9):
                raise NotACiphertextError(f"ciphertext {i} has scale {ct.scale}, expected {scale}")
            cts.append(ct)
        return cts

    def decrypt_parts(self, cts: list[Any]) -> np.ndarray:
        assert self.decryptor is not None
        out = []
        for ct in cts:
            pt = sealapi.Plaintext()
            self.decryptor.decrypt(ct, pt)
            z = np.asarray(self.encoder.decode_complex(pt), dtype=np.complex128)
            out.append(z.real)
            out.append(z.imag)
        return np.concatenate(out)


class _Packer:
    """Turns pre-scaled values into slot parts (quantize + pack when packed); shared by the
    client encryptor and the server's noise top-up so both encode identically."""

    def __init__(self, plan: _Plan, rng: np.random.Generator) -> None:
        self.plan = plan
        self.rng = rng

    def encode_values(self, y: np.ndarray, contributions: int) -> np.ndarray:
        return self.quantize(y, contributions)[0]

    def quantize(self, y: np.ndarray, contributions: int, u: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(slot parts, the values they stand for): the second is what the sum will contain.
        With a dither `u` (one per summand, whatever its contributions) the rounding is
        subtractive-dithered."""
        plan, pk = self.plan, self.plan.packing
        if not plan.packed:
            return y, y
        if u is not None:
            q = dithered_quantize(y, pk.clip_range, pk.levels, u, contributions)
            sent = dequantize(q - u + 0.5, pk.clip_range, pk.levels, contributions)
        else:
            q = stochastic_quantize(y, pk.clip_range, pk.levels, self.rng, contributions)
            sent = dequantize(q, pk.clip_range, pk.levels, contributions)
        return pack_fields(q, pk.field_bits, plan.k).astype(np.float64), sent

    def assemble(self, header: tuple[float, float], data: np.ndarray, n_values: int) -> np.ndarray:
        n_ct = self.plan.n_ciphertexts(n_values)
        parts = np.zeros(n_ct * self.plan.parts_per_ct, dtype=np.float64)
        parts[0], parts[1] = header
        parts[_HEADER_PARTS : _HEADER_PARTS + data.shape[0]] = data
        return parts


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
        self._plan = _Plan(context.params, self.packing)
        self._ops = _SealOps(context)
        self._packer = _Packer(self._plan, rng if rng is not None else np.random.default_rng())
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
        wanted = y
        y, saturated = saturate(y, m * pk.clip_range)
        if saturated and pk.on_saturation == "raise":
            raise SaturationError(f"{saturated} values outside ±{m * pk.clip_range}")
        data, sent = self._packer.quantize(y, contributions=m, u=self._checked_dither(dither, vec.shape))
        parts = self._packer.assemble(header, data, vec.shape[0])
        blobs = self._ops.encrypt_parts(parts, plan.scale, symmetric=self.context.is_private)
        env = Envelope(
            ENVELOPE_UPDATE,
            MODE_CODES[pk.mode],
            self.context.key_id,
            pk.fingerprint(),
            layout.digest() if layout is not None else NO_LAYOUT,
            vec.shape[0],
            m,
            tuple(blobs),
        )
        out = pack_envelope(env)
        self.last_report = EncryptReport(vec.shape[0], len(blobs), len(out), saturated, w)
        self.total_saturated += saturated
        self.last_residual = wanted - sent
        return out

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
        self._plan = _Plan(ctx.params, self.packing)
        self._ops = _SealOps(ctx)
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
        packer = _Packer(self._plan, gen)
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
        env = _parse_for(self.context, self.packing, self._plan, data)
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


def _parse_for(ctx: CkksContext, packing: PackingConfig, plan: _Plan, data: bytes) -> Envelope:
    env = parse_envelope(data, max_ciphertext_bytes=plan.max_ciphertext_bytes)
    if env.key_id != ctx.key_id:
        raise ContextMismatchError(
            f"ciphertext was made under key {env.key_id.hex()}, this context is {ctx.key_id.hex()} "
            "(another dealer, parameter set or a rotated-out key)"
        )
    if env.packing_fp != packing.fingerprint() or env.mode != MODE_CODES[packing.mode]:
        raise PackingMismatchError("ciphertext was packed with another PackingConfig")
    if len(env.ciphertexts) != plan.n_ciphertexts(env.n_values):
        raise NotACiphertextError(
            f"{len(env.ciphertexts)} ciphertexts cannot hold {env.n_values} values "
            f"(expected {plan.n_ciphertexts(env.n_values)})"
        )
    return env


class AggregateDecryptor:
    """Client side: decrypt an aggregate to the weighted mean (needs the secret context)."""

    def __init__(self, secret_context: CkksContext, packing: PackingConfig | None = None) -> None:
        if not secret_context.is_private:
            raise NoSecretKeyError("decryption needs the secret context; this one is public-only")
        self.context = secret_context
        self.packing = packing or PackingConfig()
        self._plan = _Plan(secret_context.params, self.packing)
        self._ops = _SealOps(secret_context)

    def decrypt_raw(
        self, data: bytes, layout: Layout | None = None, *, accept: Callable[[np.ndarray], bool] | None = None
    ) -> RawAggregate:
        """Decrypt to the raw sums: exact integer field sums (packed) or real sums (none).

        `accept` (e.g. ``AggregateMac.check``) sees the ciphertexts' coefficients before anything
        is decrypted; False raises `AggregateRejectedError`. Passing it here instead of calling
        ``ciphertext_coefficients`` first loads each ciphertext once, not twice.
        """
        plan, pk = self._plan, self.packing
        env = _parse_for(self.context, pk, plan, data)
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
                ints[_HEADER_PARTS : _HEADER_PARTS + plan.n_data_parts(n)], pk.field_bits, plan.k, n
            )
        else:
            w_sum = float(parts[0])
            contributions = int(np.rint(parts[1]))
            if abs(parts[1] - contributions) > 1e-3:
                raise DecryptionError("contribution count did not decrypt to an integer: corrupted or wrong key")
            self._check_header(w_sum, contributions)
            sums = parts[_HEADER_PARTS : _HEADER_PARTS + n]
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


def ciphertext_info(data: bytes) -> dict[str, Any]:
    """Public header fields of an update/aggregate (what the server can see), for logs/tests."""
    env = parse_envelope(data, max_ciphertext_bytes=1 << 30)
    return {
        "kind": "update" if env.kind == ENVELOPE_UPDATE else "aggregate",
        "mode": next(k for k, v in MODE_CODES.items() if v == env.mode),
        "key_id": env.key_id.hex(),
        "n_values": env.n_values,
        "n_updates": env.n_updates,
        "n_ciphertexts": len(env.ciphertexts),
        "nbytes": len(data),
    }


def update_header_problem(data: bytes, context: CkksContext, packing: PackingConfig, n_values: int,
                          contributions: int) -> tuple[str, str] | None:
    """(field, what is wrong) for the first field of an update's public envelope (``crypto.wire``)
    that disagrees with the round's public encoding, or None when every field agrees.

    The server's check before it adds a summand (issue 20): every field is pinned to what the
    round declares, none to what an earlier summand said. ``CkksAggregator.add`` compares the
    layout digest with the first summand's only, so a first summand declaring a layout made every
    later honest update "another tensor layout" and dropped them all. ``context`` may be public;
    ``contributions`` is what the summand must stand for (1 for an update, m for m noise shares).
    Raises ``NotACiphertextError`` when the bytes do not parse at all."""
    plan = _Plan(context.params, packing)
    env = parse_envelope(data, max_ciphertext_bytes=plan.max_ciphertext_bytes)
    want_ct = plan.n_ciphertexts(n_values)
    checks = (
        ("kind", env.kind == ENVELOPE_UPDATE, "is an aggregate, not an update"),
        ("mode", env.mode == MODE_CODES[packing.mode], f"has packing mode code {env.mode}, the round's is "
                                                       f"{MODE_CODES[packing.mode]} ({packing.mode})"),
        ("key_id", env.key_id == context.key_id, f"was encrypted under key {env.key_id.hex()[:16]}…, the round's "
                                                 f"key is {context.key_id.hex()[:16]}…"),
        ("packing_fp", env.packing_fp == packing.fingerprint(), f"has packing fingerprint {env.packing_fp.hex()}, "
                                                                f"the round's is {packing.fingerprint().hex()}"),
        ("layout_fp", env.layout_fp == NO_LAYOUT, f"declares tensor layout {env.layout_fp.hex()}, the round's "
                                                  "updates are flat vectors (no layout)"),
        ("n_values", env.n_values == n_values, f"holds {env.n_values} values, the round's updates {n_values}"),
        ("n_updates", env.n_updates == contributions, f"carries {env.n_updates} share(s), {contributions} were asked"),
        ("n_ciphertexts", len(env.ciphertexts) == want_ct, f"has {len(env.ciphertexts)} ciphertexts, "
                                                           f"{n_values} values take {want_ct}"),
    )
    return next(((name, what) for name, ok, what in checks if not ok), None)


def ciphertext_coefficients(ctx: CkksContext, packing: PackingConfig, data: bytes) -> np.ndarray:
    """Coefficients (mod q0) of every ciphertext in an update or aggregate, for ``crypto.binding``."""
    from crypto.binding import coefficients

    plan = _Plan(ctx.params, packing)
    env = _parse_for(ctx, packing, plan, data)
    return coefficients(_SealOps(ctx).load_checked(env.ciphertexts, plan.scale))


def last_modulus(ctx: CkksContext) -> int:
    """q0: the one prime left at the level where fedkv ciphertexts live."""
    return int(ctx.seal.last_context_data().parms().coeff_modulus()[0].value())


AUTO_PRESETS = ("fedkv-2048", "fedkv-4096")
"""The rings `preset_for` chooses among (all classical 128-bit secure by the HE standard's
tables; not its post-quantum column)."""
PQ_AUTO_PRESETS = ("fedkv-2048-pq", "fedkv-4096-pq")
"""The same choice within the HE standard's post-quantum 128-bit column (he-security)."""


def update_bytes_estimate(params: CkksParams, packing: PackingConfig, n_values: int) -> int:
    """Bytes of a seeded update of `n_values` under `params`: one N-word polynomial per
    ciphertext plus SEAL's header and seed (~210 bytes, measured), envelope excluded."""
    plan = _Plan(params, packing)
    return plan.n_ciphertexts(n_values) * (8 * params.poly_modulus_degree + 210)


def preset_for(n_values: int, packing: PackingConfig, names: tuple[str, ...] = AUTO_PRESETS) -> str:
    """The smallest ring of `names` (ordered small to large) whose ONE ciphertext holds
    `n_values`; the last of `names` when none does. Why: a model below one N=4096 ciphertext's
    capacity pays for the whole ciphertext, and the smallest secure ring that holds it costs half
    as much. Larger models stay on the larger ring: the same bytes per parameter in fewer
    ciphertexts, and 60-bit coefficients the MAC reads fast (``crypto.binding``)."""
    for name in names:
        try:
            if _Plan(PRESETS[name], packing).n_ciphertexts(n_values) == 1:
                return name
        except ParameterError:
            continue  # this packing does not fit that ring's slots
    return names[-1]
