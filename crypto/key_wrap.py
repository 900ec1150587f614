"""Key wrapping: the CKKS secret context, encrypted per node and signed by its maker.

The ``Dealer`` (the node that makes the CKKS key, ``NodeKeys.dealer``) creates the secret
context and, per enrolled node, wraps it: ephemeral X25519 -> HKDF-SHA256 (salt, info bound to
node/epoch/key) -> AES-256-GCM, with the whole header as associated data; the bundle is signed
with the dealer's Ed25519 key. The server receives only the public context, signed the same way
(``verify_public_context``). Rotation: ``Dealer.rotate(round)`` makes a new context (new epoch)
effective from that round; bundles of older epochs are refused (``unwrap_bundle(min_epoch=)``).
Node identities and update signatures: ``crypto.signing``. `cryptography` primitives only.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from typing import Protocol

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crypto.context import DEFAULT_PRESET, CkksContext, CkksParams, load_context, make_secret_context
from crypto.errors import KeyUnwrapError, NotAContextError, SignatureError, StaleKeyError, UnknownNodeError
from crypto.framing import Reader, lp, pub_raw

__all__ = ["Dealer", "WrappedKeyBundle", "unwrap_bundle", "verify_public_context"]


class Enrolled(Protocol):
    """A node's public keys as the dealer reads them (``crypto.signing.NodePublicKeys``)."""

    @property
    def node_id(self) -> str: ...
    @property
    def kx_public(self) -> bytes: ...
    @property
    def sign_public(self) -> bytes: ...


class Recipient(Protocol):
    """A node that can open a bundle: its id and its X25519 exchange (``crypto.signing.NodeKeys``)."""

    node_id: str

    def _exchange(self, peer: bytes) -> bytes: ...


# --- wrapped CKKS context ------------------------------------------------------------------------

_BUNDLE_MAGIC = b"FKB\x01"
_WRAP_INFO = b"fedkv-ckks-context-wrap-v1"


@dataclass(frozen=True)
class WrappedKeyBundle:
    """The CKKS secret context encrypted for one node and signed by the dealer."""

    node_id: str
    epoch: int
    effective_round: int
    key_id: bytes
    ephemeral_public: bytes
    salt: bytes
    nonce: bytes
    ciphertext: bytes
    signature: bytes = b""

    def header(self) -> bytes:
        """Authenticated by AES-GCM (as associated data) and by the dealer's signature."""
        return (
            _BUNDLE_MAGIC
            + lp(self.node_id.encode())
            + struct.pack(">IQ", self.epoch, self.effective_round)
            + self.key_id
            + self.ephemeral_public
            + self.salt
            + self.nonce
        )

    def signed_part(self) -> bytes:
        return self.header() + lp(self.ciphertext)

    def to_bytes(self) -> bytes:
        return self.signed_part() + self.signature

    @classmethod
    def from_bytes(cls, data: bytes) -> WrappedKeyBundle:
        r = Reader(data, "key bundle", SignatureError)
        if r.take(4) != _BUNDLE_MAGIC:
            raise SignatureError("not a fedkv key bundle (bad magic)")
        node_id = r.lp(1024).decode(errors="replace")
        epoch, eff = r.unpack(">IQ")
        key_id, eph, salt, nonce = r.take(16), r.take(32), r.take(16), r.take(12)
        ct = r.lp()
        sig = r.take(64)
        r.done()
        return cls(node_id, epoch, eff, key_id, eph, salt, nonce, ct, sig)


def _wrap_key(shared: bytes, salt: bytes, node_id: str, epoch: int, key_id: bytes) -> bytes:
    info = _WRAP_INFO + lp(node_id.encode()) + struct.pack(">I", epoch) + key_id
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(shared)


def unwrap_bundle(
    bundle: bytes | WrappedKeyBundle, node: Recipient, dealer_key: bytes, *, min_epoch: int = 0
) -> CkksContext:
    """Verify the dealer's signature, check the bundle is for this node, decrypt the context.

    `dealer_key` is the dealer's raw Ed25519 public key (pinned at enrollment). `min_epoch`
    refuses a rollback to an older key. Raises SignatureError, KeyUnwrapError, StaleKeyError.
    """
    b = WrappedKeyBundle.from_bytes(bundle) if isinstance(bundle, (bytes, bytearray)) else bundle
    try:
        Ed25519PublicKey.from_public_bytes(dealer_key).verify(b.signature, b.signed_part())
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("key bundle signature does not verify against the dealer key") from exc
    if b.node_id != node.node_id:
        raise KeyUnwrapError(f"bundle is for node {b.node_id!r}, not {node.node_id!r}")
    if b.epoch < min_epoch:
        raise StaleKeyError(f"bundle epoch {b.epoch} is older than the current epoch {min_epoch}")
    key = _wrap_key(node._exchange(b.ephemeral_public), b.salt, b.node_id, b.epoch, b.key_id)
    try:
        secret = AESGCM(key).decrypt(b.nonce, b.ciphertext, b.header())
    except InvalidTag as exc:
        raise KeyUnwrapError("cannot decrypt the bundle (not wrapped for this node's key, or tampered)") from exc
    try:
        ctx = load_context(secret)
    except NotAContextError as exc:
        raise KeyUnwrapError(f"bundle does not hold a CKKS context: {exc}") from exc
    if ctx.key_id != b.key_id or not ctx.is_private:
        raise KeyUnwrapError("bundle's context does not match its key id")
    return ctx


# --- dealer --------------------------------------------------------------------------------------

_PUBCTX_MAGIC = b"FKP\x01"


class Dealer:
    """Creates the CKKS secret context, wraps it per enrolled node, signs, rotates.

    The dealer is the only party that creates keys; it may run on an operator's machine. It holds
    the current secret context in memory only.
    """

    def __init__(
        self, params: CkksParams | str = DEFAULT_PRESET, signing_key: Ed25519PrivateKey | None = None,
        *, context: CkksContext | None = None, epoch: int = 0, effective_round: int = 0,
    ) -> None:
        self.params = params
        self._signing_key = signing_key or Ed25519PrivateKey.generate()
        self._nodes: dict[str, Enrolled] = {}
        self.epoch = epoch
        self.effective_round = effective_round
        self._context = context if context is not None else make_secret_context(params)

    @property
    def context(self) -> CkksContext:
        """The current secret context: for the key-making node's own store, never for a server."""
        return self._context

    @property
    def verify_key(self) -> bytes:
        """Raw Ed25519 public key nodes and server pin to check bundles / public contexts."""
        return pub_raw(self._signing_key.public_key())

    @property
    def key_id(self) -> bytes:
        return self._context.key_id

    @property
    def nodes(self) -> dict[str, Enrolled]:
        return dict(self._nodes)

    def enroll(self, node: Enrolled) -> None:
        if len(node.kx_public) != 32 or len(node.sign_public) != 32:
            raise ValueError("node public keys must be raw 32-byte X25519 / Ed25519 keys")
        self._nodes[node.node_id] = node

    def remove(self, node_id: str) -> None:
        """Un-enroll a node. Rotate afterwards so it cannot read later rounds."""
        self._nodes.pop(node_id, None)

    def wrap_for(self, node_id: str) -> WrappedKeyBundle:
        node = self._nodes.get(node_id)
        if node is None:
            raise UnknownNodeError(f"node {node_id!r} is not enrolled")
        eph = X25519PrivateKey.generate()  # fresh per bundle: forward secrecy for the dealer side
        salt, nonce = os.urandom(16), os.urandom(12)
        shared = eph.exchange(X25519PublicKey.from_public_bytes(node.kx_public))
        key = _wrap_key(shared, salt, node_id, self.epoch, self.key_id)
        unsigned = WrappedKeyBundle(
            node_id, self.epoch, self.effective_round, self.key_id, pub_raw(eph.public_key()), salt, nonce, b""
        )
        ct = AESGCM(key).encrypt(nonce, self._context.secret_bytes(), unsigned.header())
        body = replace(unsigned, ciphertext=ct)
        return replace(body, signature=self._signing_key.sign(body.signed_part()))

    def wrap_all(self) -> dict[str, bytes]:
        return {nid: self.wrap_for(nid).to_bytes() for nid in self._nodes}

    def public_context(self) -> bytes:
        """The public context for the server (no secret key)."""
        return self._context.public_bytes()

    def signed_public_context(self) -> bytes:
        """Public context + epoch, signed, so the server can check it came from the dealer."""
        body = _PUBCTX_MAGIC + struct.pack(">IQ", self.epoch, self.effective_round) + lp(self.public_context())
        return body + self._signing_key.sign(body)

    def rotate(self, effective_round: int) -> int:
        """New CKKS context from `effective_round` on; returns the new epoch. Re-wrap afterwards."""
        if effective_round < self.effective_round:
            raise ValueError("a rotation cannot take effect before the current key's first round")
        self._context = make_secret_context(self.params)
        self.epoch += 1
        self.effective_round = effective_round
        return self.epoch


def verify_public_context(data: bytes, dealer_key: bytes) -> tuple[bytes, int, int]:
    """Check a `Dealer.signed_public_context`; returns (public context bytes, epoch, round)."""
    if len(data) < 64:
        raise SignatureError("signed public context too short")
    body, sig = data[:-64], data[-64:]
    try:
        Ed25519PublicKey.from_public_bytes(dealer_key).verify(sig, body)
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("public context signature does not verify against the dealer key") from exc
    r = Reader(body, "signed public context", SignatureError)
    if r.take(4) != _PUBCTX_MAGIC:
        raise SignatureError("not a signed fedkv public context")
    epoch, eff = r.unpack(">IQ")
    pub = r.lp()
    r.done()
    return pub, epoch, eff
