"""Exceptions of the privacy core.

Every boundary of `crypto` raises one of these, never a bare SEAL/TenSEAL/cryptography error, so
callers (the node, the server) can tell a foreign ciphertext from a forged signature and keep
going. Each is raised *before* any state changes: a rejected input leaves the aggregator,
verifier or decryptor exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "CryptoError",
    "ParameterError",
    "NotAContextError",
    "NoSecretKeyError",
    "SecretKeyPresentError",
    "ContextMismatchError",
    "StaleKeyError",
    "NotACiphertextError",
    "PackingMismatchError",
    "LayoutMismatchError",
    "NonFiniteUpdateError",
    "WeightRangeError",
    "SaturationError",
    "HeadroomError",
    "EmptyAggregateError",
    "DecryptionError",
    "AggregateRejectedError",
    "SignatureError",
    "ReplayError",
    "UnknownNodeError",
    "KeyUnwrapError",
    "KeyCheckError",
]


class CryptoError(Exception):
    """Base class of every error raised by `crypto`."""


# --- contexts and parameters -------------------------------------------------------------------


class ParameterError(CryptoError, ValueError):
    """CKKS parameters or a packing configuration that cannot work (insecure, overflowing...)."""


class NotAContextError(CryptoError, ValueError):
    """Bytes that are not a serialized fedkv CKKS context."""


class NoSecretKeyError(CryptoError):
    """A secret-key operation (decrypt) was asked of a context that holds only public keys."""


class SecretKeyPresentError(CryptoError):
    """A server-side object was handed a context that contains the secret key."""


class ContextMismatchError(CryptoError, ValueError):
    """A ciphertext was made under another key / parameter set than the context in hand."""


class StaleKeyError(ContextMismatchError):
    """A ciphertext, bundle or signed update belongs to a key epoch that has been rotated out."""


# --- ciphertexts ---------------------------------------------------------------------------------


class NotACiphertextError(CryptoError, ValueError):
    """Bytes that are not a well-formed fedkv ciphertext (truncated, random, corrupted header)."""


class PackingMismatchError(CryptoError, ValueError):
    """A ciphertext was packed with another `PackingConfig` than the one in hand."""


class LayoutMismatchError(CryptoError, ValueError):
    """Vector length, tensor names/shapes or layout digest do not match."""


class NonFiniteUpdateError(CryptoError, ValueError):
    """An update (or its noise/weight) contains NaN or Inf; rejected before encryption."""


class WeightRangeError(CryptoError, ValueError):
    """A client weight is negative, non-finite or above `PackingConfig.max_weight`."""


class SaturationError(CryptoError, ValueError):
    """Values fell outside the packing range while `on_saturation="raise"`."""


class HeadroomError(CryptoError):
    """Adding more contributions would overflow the packed fields (more than `max_clients`)."""


class EmptyAggregateError(CryptoError):
    """Nothing to aggregate or decrypt (no update added, or the weight sum is zero)."""


class DecryptionError(CryptoError):
    """Decryption produced values that cannot be a valid aggregate (corruption or wrong key)."""


class AggregateRejectedError(DecryptionError):
    """An aggregate failed its pre-decryption check (``crypto.binding``): nothing was decrypted."""


# --- keys and signatures ------------------------------------------------------------------------


class SignatureError(CryptoError):
    """A signature does not verify, or the signed message is malformed."""


class ReplayError(CryptoError):
    """An update for a round other than the current one, or a second update in the same round."""


class UnknownNodeError(CryptoError, KeyError):
    """A node id that is not enrolled."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KeyUnwrapError(CryptoError):
    """A wrapped key bundle cannot be opened by this node (wrong recipient or tampered)."""


class KeyCheckError(KeyUnwrapError):
    """A secret file's key check value does not match its bytes: it changed since it was written
    (a flipped bit, a truncated copy, an edit). The message names the file."""
