"""SEAL encoder, encryptors, evaluator and decryptor bound to one ``CkksContext``.

Driven through ``tenseal.sealapi`` because the high-level ``ckks_vector`` neither exposes complex
slots nor keeps the symmetric seed. Ciphertext bytes go through ``crypto.seal_io``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tenseal.sealapi as sealapi

from crypto.context import CkksContext
from crypto.errors import NotACiphertextError
from crypto.seal_io import seal_load_ciphertext, seal_save

__all__ = ["SealOps"]


class SealOps:
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
