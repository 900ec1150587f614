"""CKKS parameters, contexts (secret and public) and their serialization.

Aggregation only ever *adds* ciphertexts, so no multiplicative depth is needed: the parameters
keep a single 60-bit prime at the data level and one special prime, and every ciphertext is sent
at the last (only) data level — one 60-bit limb, the smallest a CKKS ciphertext can be. Size
grows with the limbs still present when a ciphertext is sent, not with N.

A context travels in a small envelope: magic, whether it holds the secret key, a 16-byte
`key_id` (SHA-256 of the public key material, so any party can recompute and check it), the
`CkksParams` as JSON, then TenSEAL's own serialization. Ciphertexts carry the key_id, which is
how a ciphertext is matched to "its" context and how rotated keys are told apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

import tenseal as ts

from crypto.errors import NoSecretKeyError, NotAContextError, ParameterError
from crypto.seal_keys import SEAL_KEYS_MAGIC, SealKeys, load_seal_keys, make_seal_keys

__all__ = [
    "CkksParams",
    "PRESETS",
    "DEFAULT_PRESET",
    "CkksContext",
    "SecretContext",
    "make_secret_context",
    "public_context_bytes",
    "load_context",
    "load_public_context",
    "SECRET_GUARD_ENV",
    "secret_events",
]


@dataclass(frozen=True)
class CkksParams:
    """CKKS parameters for addition-only aggregation (classical 128-bit security: SEAL's
    HE-standard bound, not the standard's post-quantum column).

    poly_modulus_degree: N; N/2 complex slots = N slot parts (real + imaginary) per ciphertext.
    coeff_mod_bit_sizes: prime sizes; the FIRST prime is the one left at the last level, where
        fedkv encrypts. Total bits must stay within SEAL's 128-bit bound for N (54 at 2048, 109
        at 4096, 218 at 8192: the HE standard's tables), which SEAL enforces. A single prime
        means no key switching (none is needed to add): such contexts are held by
        ``crypto.seal_keys`` because TenSEAL refuses them.
    packed_scale_bits:   log2 of the CKKS scale for packed integers. Decryption noise of a sum of
        32 fresh ciphertexts is < 0.1 at 2^18 (measured: 0.03-0.07 at N=4096), far below the 0.5
        that rounding to the exact integer tolerates.
    real_scale_bits:     log2 of the scale in mode "none" (approximate reals): error ~1e-8.
    slot_bits:           exact-integer capacity of one slot part. Needs slot_bits +
        packed_scale_bits <= q0_bits - 2 (the encoded value must stay below q0/2 with a factor-2
        margin for the coefficient growth of the encoding); 40 + 18 = 58 for a 60-bit q0 held
        exactly at the maximum (tested), while 41 + 19 wrapped.
    """

    name: str = "fedkv-4096"
    poly_modulus_degree: int = 4096
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 49)
    packed_scale_bits: int = 18
    real_scale_bits: int = 40
    slot_bits: int = 40

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeff_mod_bit_sizes", tuple(int(b) for b in self.coeff_mod_bit_sizes))
        n = self.poly_modulus_degree
        if n < 2048 or n & (n - 1):
            raise ParameterError(f"poly_modulus_degree must be a power of two >= 2048, not {n}")
        if len(self.coeff_mod_bit_sizes) < 1:
            raise ParameterError("need at least one prime")
        q0 = self.coeff_mod_bit_sizes[0]
        if self.slot_bits + self.packed_scale_bits > q0 - 2:
            raise ParameterError(
                f"slot_bits + packed_scale_bits = {self.slot_bits + self.packed_scale_bits} "
                f"exceeds q0_bits - 2 = {q0 - 2}: packed sums would wrap"
            )
        if self.slot_bits > 50:
            raise ParameterError("slot_bits > 50 loses exactness in SEAL's double-precision encoder")
        if self.real_scale_bits >= q0 - 3:
            raise ParameterError("real_scale_bits leaves no room for values below q0")

    @property
    def q0_bits(self) -> int:
        return self.coeff_mod_bit_sizes[0]

    @property
    def slot_parts(self) -> int:
        """Real numbers one ciphertext carries: N/2 complex slots x 2 parts."""
        return self.poly_modulus_degree

    def real_value_bound(self, max_clients: int) -> float:
        """Largest |value| per client in mode "none" so the sum of max_clients stays < q0/4."""
        return 2.0 ** (self.q0_bits - 3 - self.real_scale_bits) / max_clients

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> CkksParams:
        obj = json.loads(text)
        obj["coeff_mod_bit_sizes"] = tuple(obj["coeff_mod_bit_sizes"])
        return cls(**obj)


PRESETS: dict[str, CkksParams] = {
    # The smallest secure ring: N=2048, one 54-bit prime (the 128-bit maximum at N=2048, no
    # special prime). 2,048 slot parts of 35 exact bits per 16.5 KB seeded ciphertext: for a
    # model below ~6k values one ciphertext is smaller than its fp32 plaintext. Scale 2^17:
    # decryption noise of a 32-update sum measured 0.016 here (rounding tolerates 0.5);
    # tests/crypto/test_seal_keys.py checks exact sums at the headroom limit.
    "fedkv-2048": CkksParams(
        name="fedkv-2048", poly_modulus_degree=2048, coeff_mod_bit_sizes=(54,), packed_scale_bits=17,
        real_scale_bits=34, slot_bits=35,
    ),
    # Default. 109 bits = the 128-bit maximum at N=4096. 12,288 values (8-bit, 3 per part) or
    # 4,096 reals per 32,972-byte seeded ciphertext: 2.69 / 8.07 bytes per parameter (one full ciphertext).
    "fedkv-4096": CkksParams(),
    # Same bytes per parameter, twice the values per ciphertext (fewer, larger messages) and
    # sqrt(2) more decryption noise (still < 0.1 at 2^18). 120 of the 218 bits allowed.
    "fedkv-8192": CkksParams(name="fedkv-8192", poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 60)),
    # The HE standard's post-quantum 128-bit column (log q <= 51 at N=2048, 101 at 4096):
    # 3 bits fewer per slot part at 2048 (32 + 17 = 49 = 51 - 2); at 4096 only the special
    # prime shrinks (60 + 41), so q0 and the packing are the classical ring's.
    "fedkv-2048-pq": CkksParams(
        name="fedkv-2048-pq", poly_modulus_degree=2048, coeff_mod_bit_sizes=(51,), packed_scale_bits=17,
        real_scale_bits=31, slot_bits=32,
    ),
    "fedkv-4096-pq": CkksParams(name="fedkv-4096-pq", poly_modulus_degree=4096, coeff_mod_bit_sizes=(60, 41)),
    # NVFlare / TenSEAL tutorial parameters. fedkv still encrypts at the last level (one limb).
    "nvflare-default": CkksParams(
        name="nvflare-default", poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 40, 40)
    ),
}
DEFAULT_PRESET = "fedkv-4096"
PQ_LOG_Q_BOUND: dict[int, int] = {2048: 51, 4096: 101, 8192: 202}
"""The HE standard's post-quantum 128-bit bound on log q per N (SEAL enforces the classical one)."""


def is_post_quantum(params: CkksParams) -> bool:
    """Whether ``params`` lie within the HE standard's post-quantum 128-bit column (log q at
    most ``PQ_LOG_Q_BOUND`` for its ring; a ring the table lacks is not)."""
    bound = PQ_LOG_Q_BOUND.get(params.poly_modulus_degree)
    return bound is not None and sum(params.coeff_mod_bit_sizes) <= bound


# --- where secret contexts exist ------------------------------------------------------------------
# The claim "the ServerApp process never creates or deserializes a secret context" is checked, not
# assumed: every creation and every deserialization of a context holding the secret key is recorded
# with the pid of the process that did it, in memory and, when FEDKV_SECRET_GUARD_LOG names a file,
# appended there (one "pid event key_id" line; no key material), so a test can read the records of
# every process of a real `flwr run`.

SECRET_GUARD_ENV = "FEDKV_SECRET_GUARD_LOG"
_secret_events: list[tuple[int, str, str]] = []


def _record_secret(event: str, key_id: bytes) -> None:
    entry = (os.getpid(), event, key_id.hex())
    _secret_events.append(entry)
    path = os.environ.get(SECRET_GUARD_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{entry[0]} {entry[1]} {entry[2]}\n".encode())
        finally:
            os.close(fd)


def secret_events() -> list[tuple[int, str, str]]:
    """(pid, "create" | "load", key id hex) of every secret context made or parsed in this process."""
    return list(_secret_events)


# --- contexts -------------------------------------------------------------------------------------

_CTX_MAGIC = b"FKC\x01"
_FLAG_SECRET = 1


def _ts_public_bytes(ctx: ts.Context | SealKeys) -> bytes:
    return ctx.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )


def _key_id(public_ts_bytes: bytes) -> bytes:
    return hashlib.sha256(b"fedkv-ckks-key-v1" + public_ts_bytes).digest()[:16]


@dataclass
class CkksContext:
    """A TenSEAL CKKS context plus its `CkksParams` and `key_id`; secret or public-only.

    The dealer creates the secret one; nodes receive it wrapped (`crypto.key_wrap`); the server gets
    `public_bytes()`, from which the secret key cannot be recovered.
    """

    tenseal: ts.Context | SealKeys
    """TenSEAL's context, or `crypto.seal_keys.SealKeys` (same methods) for single-prime sets."""
    params: CkksParams
    key_id: bytes
    _seal: Any = field(default=None, repr=False)
    _secret: bytes | None = field(default=None, repr=False)
    """The secret envelope, serialized once: every holder derives the same ``mac_key`` from it."""

    @property
    def is_private(self) -> bool:
        return bool(self.tenseal.has_secret_key())

    @property
    def seal(self) -> Any:
        """The underlying SEALContext (for sealapi encoders/encryptors)."""
        if self._seal is None:
            self._seal = self.tenseal.seal_context().data
        return self._seal

    def secret_key(self) -> Any:
        if not self.is_private:
            raise NoSecretKeyError("this context holds only public keys; it cannot decrypt")
        return self.tenseal.secret_key().data

    def public_key(self) -> Any:
        return self.tenseal.public_key().data

    def public_bytes(self) -> bytes:
        """Serialized public context (no secret key): what the server receives."""
        return self._envelope(_ts_public_bytes(self.tenseal), secret=False)

    def secret_bytes(self) -> bytes:
        """Serialized secret context. Key material: only ever hand it to `keys.Dealer` wrapping."""
        if not self.is_private:
            raise NoSecretKeyError("public context has no secret key to serialize")
        if self._secret is None:
            raw = self.tenseal.serialize(
                save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
            )
            self._secret = self._envelope(raw, secret=True)
        return self._secret

    @property
    def mac_key(self) -> bytes:
        """32-byte key of the aggregate MAC (``crypto.binding``), derived from the secret envelope
        with HKDF-SHA256: every key holder has it, the server (public context only) cannot."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = b"fedkv-aggregate-mac-v1" + self.key_id
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(self.secret_bytes())

    @property
    def dither_key(self) -> bytes:
        """32-byte key of the quantization dither (``crypto.dp.dither``), from the secret envelope
        like ``mac_key`` (another HKDF label): key holders share it, the server cannot derive it."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        info = b"fedkv-dither-v1" + self.key_id
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(self.secret_bytes())

    def public(self) -> CkksContext:
        """A public-only copy (same key_id)."""
        return load_context(self.public_bytes())

    def _envelope(self, ts_bytes: bytes, *, secret: bool) -> bytes:
        pj = self.params.to_json().encode()
        return (
            _CTX_MAGIC
            + struct.pack(">B16sH", _FLAG_SECRET if secret else 0, self.key_id, len(pj))
            + pj
            + ts_bytes
        )

    def __repr__(self) -> str:
        kind = "secret" if self.is_private else "public"
        return f"CkksContext({self.params.name}, {kind}, key_id={self.key_id.hex()})"


SecretContext = CkksContext  # the name used in the design notes


def make_secret_context(params: CkksParams | str = DEFAULT_PRESET) -> CkksContext:
    """Create a fresh secret CKKS context (the dealer's job)."""
    if isinstance(params, str):
        try:
            params = PRESETS[params]
        except KeyError as exc:
            raise ParameterError(f"unknown preset {params!r}; known: {sorted(PRESETS)}") from exc
    ctx: ts.Context | SealKeys
    if len(params.coeff_mod_bit_sizes) == 1:
        ctx = make_seal_keys(params.poly_modulus_degree, params.coeff_mod_bit_sizes)
    else:
        try:
            ctx = ts.context(
                ts.SCHEME_TYPE.CKKS,
                poly_modulus_degree=params.poly_modulus_degree,
                coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
            )
        except ValueError as exc:  # SEAL rejects parameters above the 128-bit security bound
            raise ParameterError(f"SEAL rejected {params}: {exc}") from exc
    key_id = _key_id(_ts_public_bytes(ctx))
    _record_secret("create", key_id)
    return CkksContext(ctx, params, key_id)


def public_context_bytes(ctx: CkksContext) -> bytes:
    """Serialized public-only context for the server."""
    return ctx.public_bytes()


def load_context(data: bytes) -> CkksContext:
    """Parse a context envelope; checks parameters and key_id against the key material."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise NotAContextError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    head = len(_CTX_MAGIC) + struct.calcsize(">B16sH")
    if len(data) < head or data[:4] != _CTX_MAGIC:
        raise NotAContextError("not a fedkv CKKS context (bad magic or too short)")
    flags, key_id, plen = struct.unpack(">B16sH", data[4:head])
    if flags & _FLAG_SECRET:
        _record_secret("load", key_id)
    try:
        params = CkksParams.from_json(data[head : head + plen])
    except (ValueError, TypeError, KeyError) as exc:
        raise NotAContextError(f"bad parameter record in context: {exc}") from exc
    body = data[head + plen :]
    if body[:4] == SEAL_KEYS_MAGIC:
        if len(params.coeff_mod_bit_sizes) != 1:
            raise NotAContextError("a raw-SEAL key record for a parameter set TenSEAL holds")
        ctx = load_seal_keys(body)
    else:
        try:
            ctx = ts.context_from(body)
        except Exception as exc:  # pybind maps C++ parse errors to several Python types
            raise NotAContextError(f"TenSEAL could not parse the context: {exc}") from exc
    if ctx.has_secret_key() and not flags & _FLAG_SECRET:
        _record_secret("load", key_id)  # a lying envelope: it was parsed all the same
    if bool(flags & _FLAG_SECRET) != bool(ctx.has_secret_key()):
        raise NotAContextError("context flags disagree with the keys it contains")
    _check_params(ctx, params)
    if _key_id(_ts_public_bytes(ctx)) != key_id:
        raise NotAContextError("key_id does not match the key material (tampered context)")
    return CkksContext(ctx, params, key_id, _secret=data if ctx.has_secret_key() else None)


def load_public_context(data: bytes) -> CkksContext:
    """``load_context`` for parties that must never hold the secret key (the server): bytes whose
    envelope says "secret" are refused before TenSEAL parses them."""
    if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > 4 and bytes(data[:4]) == _CTX_MAGIC:
        if data[4] & _FLAG_SECRET:
            from crypto.errors import SecretKeyPresentError

            raise SecretKeyPresentError("refusing to parse a context that carries the secret key")
    ctx = load_context(data)
    if ctx.is_private:
        from crypto.errors import SecretKeyPresentError

        raise SecretKeyPresentError("context carries a secret key although its envelope says public")
    return ctx


def _check_params(ctx: ts.Context, params: CkksParams) -> None:
    seal = ctx.seal_context().data
    parms = seal.key_context_data().parms()
    bits = tuple(m.bit_count() for m in parms.coeff_modulus())
    if parms.poly_modulus_degree() != params.poly_modulus_degree or bits != params.coeff_mod_bit_sizes:
        raise NotAContextError(
            f"context parameters (N={parms.poly_modulus_degree()}, {bits}) disagree with the "
            f"recorded preset {params.name}"
        )
