"""CKKS keys over raw SEAL for parameter sets TenSEAL cannot hold: a single prime.

Why: addition-only aggregation needs no key switching, so the smallest secure ring (N = 2048,
one prime of at most 54 bits: SEAL's `CoeffModulus.MaxBitCount(2048, tc128)`, the HE standard's
128-bit bound) needs no special prime. TenSEAL's context always makes relinearization keys and
refuses such parameters ("keyswitching is not supported by the context"), while SEAL itself
accepts them. `SealKeys` offers the few TenSEAL context methods `crypto.context` uses
(`has_secret_key`, `seal_context().data`, `secret_key().data`, `public_key().data`, `serialize`)
so the rest of `crypto` does not know which one it holds.

Bytes: ``b"FKS\\x01"`` then length-prefixed (u32, big-endian) SEAL serializations of the
encryption parameters, the public key and (secret contexts only) the secret key. Loading builds
the SEALContext with ``sec_level_type.tc128``, so parameters beyond the 128-bit bound are refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import tenseal.sealapi as sealapi

from crypto.errors import NotAContextError, ParameterError
from crypto.seal_io import seal_load, seal_save

__all__ = ["SEAL_KEYS_MAGIC", "SealKeys", "make_seal_keys", "load_seal_keys"]

SEAL_KEYS_MAGIC = b"FKS\x01"
_LEN = struct.Struct(">I")
_MAX_PART = 64 << 20


@dataclass(frozen=True)
class _Held:
    """TenSEAL wraps SEAL objects in holders with a ``data`` attribute; so does this."""

    data: Any


class SealKeys:
    """A SEALContext with its public key and, on key holders, its secret key."""

    def __init__(self, parms: Any, public_key: Any, secret_key: Any | None) -> None:
        self._parms = parms
        self._seal = _seal_context(parms)
        self._pk = public_key
        self._sk = secret_key

    @classmethod
    def _from_parts(cls, parms: Any, seal: Any, pk: Any, sk: Any | None) -> SealKeys:
        out = cls.__new__(cls)
        out._parms, out._seal, out._pk, out._sk = parms, seal, pk, sk
        return out

    def has_secret_key(self) -> bool:
        return self._sk is not None

    def seal_context(self) -> _Held:
        return _Held(self._seal)

    def secret_key(self) -> _Held:
        return _Held(self._sk)

    def public_key(self) -> _Held:
        return _Held(self._pk)

    def serialize(self, *, save_public_key: bool = True, save_secret_key: bool = False,
                  save_galois_keys: bool = False, save_relin_keys: bool = False) -> bytes:
        """Parameters + public key (+ secret key): TenSEAL's signature, no Galois/relin keys exist."""
        if not save_public_key:
            raise ParameterError("a fedkv context always carries its public key")
        parts = [seal_save(self._parms), seal_save(self._pk)]
        if save_secret_key:
            if self._sk is None:
                raise ParameterError("no secret key to serialize")
            parts.append(seal_save(self._sk))
        return SEAL_KEYS_MAGIC + b"".join(_LEN.pack(len(p)) + p for p in parts)


def _seal_context(parms: Any) -> Any:
    ctx = sealapi.SEALContext(parms, True, sealapi.SEC_LEVEL_TYPE.TC128)
    if not ctx.parameters_set():
        n, bits = parms.poly_modulus_degree(), [m.bit_count() for m in parms.coeff_modulus()]
        raise ParameterError(f"SEAL refused N={n}, primes {bits} (above the 128-bit bound of "
                             f"{sealapi.CoeffModulus.MaxBitCount(n, sealapi.SEC_LEVEL_TYPE.TC128)} bits?)")
    return ctx


def make_seal_keys(poly_modulus_degree: int, coeff_mod_bit_sizes: tuple[int, ...]) -> SealKeys:
    """Fresh keys; ParameterError when SEAL refuses the parameters (e.g. above 128-bit bound)."""
    parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(poly_modulus_degree)
    try:
        parms.set_coeff_modulus(sealapi.CoeffModulus.Create(poly_modulus_degree, list(coeff_mod_bit_sizes)))
    except Exception as exc:  # pybind maps SEAL's invalid_argument to several types
        raise ParameterError(f"SEAL cannot make primes {coeff_mod_bit_sizes} for N={poly_modulus_degree}: {exc}") from exc
    seal = _seal_context(parms)
    keygen = sealapi.KeyGenerator(seal)
    pk = sealapi.PublicKey()
    keygen.create_public_key(pk)
    return SealKeys._from_parts(parms, seal, pk, keygen.secret_key())


def load_seal_keys(data: bytes) -> SealKeys:
    """Parse `SealKeys.serialize` output; NotAContextError on anything else."""
    if data[:4] != SEAL_KEYS_MAGIC:
        raise NotAContextError("not a fedkv SEAL key record")
    parts, pos = [], 4
    while pos < len(data):
        if pos + 4 > len(data) or len(parts) == 3:
            raise NotAContextError("malformed SEAL key record")
        (n,) = _LEN.unpack_from(data, pos)
        if n == 0 or n > _MAX_PART or pos + 4 + n > len(data):
            raise NotAContextError("malformed SEAL key record (bad part length)")
        parts.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    if len(parts) not in (2, 3):
        raise NotAContextError("a SEAL key record holds parameters, a public key and maybe a secret key")
    try:
        parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
        seal_load(parms, parts[0])
        seal = _seal_context(parms)
        pk = sealapi.PublicKey()
        seal_load(pk, parts[1], seal)
        sk = None
        if len(parts) == 3:
            sk = sealapi.SecretKey()
            seal_load(sk, parts[2], seal)
    except NotAContextError:
        raise
    except Exception as exc:  # SEAL's own validation (sizes, moduli, parms ids)
        raise NotAContextError(f"SEAL could not parse the key record: {exc}") from exc
    return SealKeys._from_parts(parms, seal, pk, sk)

