"""Key provisioning and update signing with `cryptography` primitives (nothing hand-rolled).

- Each node owns an X25519 key pair (to receive the CKKS secret context) and an Ed25519 key
  pair (to sign its updates); it enrolls by giving the dealer and the server `NodePublicKeys`.
- The `Dealer` creates the CKKS secret context and, per node, wraps it: ephemeral X25519 ->
  HKDF-SHA256 (salt, info bound to node/epoch/key) -> AES-256-GCM, with the whole header as
  associated data; the bundle is signed with the dealer's Ed25519 key. The server receives only
  the public context.
- Every encrypted update travels as a `SignedUpdate` over (node id, round, key epoch, SHA-256 of
  the payload); `UpdateVerifier` rejects unknown nodes, bad signatures, other rounds (replay,
  reorder), a second update in the same round, and rotated-out key epochs.
- Rotation: `Dealer.rotate(round)` makes a new context (new epoch) effective from that round;
  ciphertexts, bundles and signatures of older epochs are refused.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from crypto.binding import CONTRIBUTION_UPDATE
from crypto.context import DEFAULT_PRESET, CkksContext, CkksParams, load_context, make_secret_context
from crypto.errors import (
    KeyUnwrapError,
    NotAContextError,
    ReplayError,
    SignatureError,
    StaleKeyError,
    UnknownNodeError,
)

__all__ = [
    "NodePublicKeys",
    "NodeKeys",
    "WrappedKeyBundle",
    "Dealer",
    "SignedUpdate",
    "sign_update",
    "UpdateVerifier",
    "unwrap_bundle",
    "verify_public_context",
    "NO_KEY_ID",
]

_RAW = serialization.Encoding.Raw
_RAW_PUB = serialization.PublicFormat.Raw


def _pub_raw(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    return key.public_bytes(_RAW, _RAW_PUB)


def _lp(b: bytes) -> bytes:
    """Length-prefixed field, so concatenated fields are unambiguous."""
    return struct.pack(">I", len(b)) + b


class _Reader:
    def __init__(self, data: bytes, what: str, error: type[Exception]) -> None:
        self.data, self.pos, self.what, self.error = memoryview(data), 0, what, error

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.error(f"truncated {self.what}")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def lp(self, limit: int = 1 << 31) -> bytes:
        (n,) = self.unpack(">I")
        if n > limit:
            raise self.error(f"oversized field in {self.what}")
        return self.take(n)

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.error(f"trailing bytes after {self.what}")


# --- node identities ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodePublicKeys:
    """What a node reveals when it enrolls: its id and two raw 32-byte public keys."""

    node_id: str
    kx_public: bytes  # X25519, receives the wrapped CKKS context
    sign_public: bytes  # Ed25519, verifies the node's updates

    def to_dict(self) -> dict[str, str]:
        return {"node_id": self.node_id, "kx_public": self.kx_public.hex(), "sign_public": self.sign_public.hex()}

    @classmethod
    def from_dict(cls, d: Mapping[str, str]) -> NodePublicKeys:
        return cls(str(d["node_id"]), bytes.fromhex(d["kx_public"]), bytes.fromhex(d["sign_public"]))


class NodeKeys:
    """A node's private keys (X25519 + Ed25519). Never serialized unencrypted by this module."""

    def __init__(self, node_id: str, kx: X25519PrivateKey, sign: Ed25519PrivateKey) -> None:
        if not node_id:
            raise ValueError("node_id must be non-empty")
        self.node_id = node_id
        self._kx = kx
        self._sign = sign

    @classmethod
    def generate(cls, node_id: str) -> NodeKeys:
        return cls(node_id, X25519PrivateKey.generate(), Ed25519PrivateKey.generate())

    @property
    def public(self) -> NodePublicKeys:
        return NodePublicKeys(self.node_id, _pub_raw(self._kx.public_key()), _pub_raw(self._sign.public_key()))

    def private_bytes(self, passphrase: bytes) -> bytes:
        """Both private keys as passphrase-encrypted PKCS#8 PEM, for the node's own storage."""
        enc = serialization.BestAvailableEncryption(passphrase)
        pem = serialization.Encoding.PEM
        pkcs8 = serialization.PrivateFormat.PKCS8
        return (
            _lp(self.node_id.encode())
            + _lp(self._kx.private_bytes(pem, pkcs8, enc))
            + _lp(self._sign.private_bytes(pem, pkcs8, enc))
        )

    @classmethod
    def from_private_bytes(cls, data: bytes, passphrase: bytes | None) -> NodeKeys:
        r = _Reader(data, "node key file", KeyUnwrapError)
        node_id = r.lp().decode()
        try:
            kx = serialization.load_pem_private_key(r.lp(), passphrase or None)
            sign = serialization.load_pem_private_key(r.lp(), passphrase or None)
        except (ValueError, TypeError) as exc:
            raise KeyUnwrapError(f"cannot load node keys: {exc}") from exc
        r.done()
        if not isinstance(kx, X25519PrivateKey) or not isinstance(sign, Ed25519PrivateKey):
            raise KeyUnwrapError("node key file holds keys of the wrong type")
        return cls(node_id, kx, sign)

    def sign(self, message: bytes) -> bytes:
        return self._sign.sign(message)

    def renamed(self, node_id: str) -> NodeKeys:
        """The same keys under another id (a kit's name -> the Flower node id it runs as)."""
        return NodeKeys(node_id, self._kx, self._sign)

    def dealer(self, params: CkksParams | str = DEFAULT_PRESET, *, context: CkksContext | None = None,
               epoch: int = 0, effective_round: int = 0) -> Dealer:
        """A ``Dealer`` that signs with this node's Ed25519 key: the node that makes (or re-wraps) the
        CKKS key. ``context`` re-wraps a key the node holds instead of making a new one."""
        return Dealer(params, signing_key=self._sign, context=context, epoch=epoch, effective_round=effective_round)

    def private_pem(self) -> bytes:
        """Both private keys as unencrypted PKCS#8 PEM, for ``crypto.at_rest`` (which seals them)."""
        none = serialization.NoEncryption()
        pem, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
        return (_lp(self.node_id.encode()) + _lp(self._kx.private_bytes(pem, pkcs8, none))
                + _lp(self._sign.private_bytes(pem, pkcs8, none)))

    @classmethod
    def from_private_pem(cls, data: bytes) -> NodeKeys:
        return cls.from_private_bytes(data, None)

    def unwrap(self, bundle: bytes | WrappedKeyBundle, dealer_key: bytes, *, min_epoch: int = 0) -> CkksContext:
        return unwrap_bundle(bundle, self, dealer_key, min_epoch=min_epoch)

    def _exchange(self, peer: bytes) -> bytes:
        return self._kx.exchange(X25519PublicKey.from_public_bytes(peer))

    def __repr__(self) -> str:  # never print key material
        return f"NodeKeys({self.node_id!r})"


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
            + _lp(self.node_id.encode())
            + struct.pack(">IQ", self.epoch, self.effective_round)
            + self.key_id
            + self.ephemeral_public
            + self.salt
            + self.nonce
        )

    def signed_part(self) -> bytes:
        return self.header() + _lp(self.ciphertext)

    def to_bytes(self) -> bytes:
        return self.signed_part() + self.signature

    @classmethod
    def from_bytes(cls, data: bytes) -> WrappedKeyBundle:
        r = _Reader(data, "key bundle", SignatureError)
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
    info = _WRAP_INFO + _lp(node_id.encode()) + struct.pack(">I", epoch) + key_id
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(shared)


def unwrap_bundle(
    bundle: bytes | WrappedKeyBundle, node: NodeKeys, dealer_key: bytes, *, min_epoch: int = 0
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
        self._nodes: dict[str, NodePublicKeys] = {}
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
        return _pub_raw(self._signing_key.public_key())

    @property
    def key_id(self) -> bytes:
        return self._context.key_id

    @property
    def nodes(self) -> dict[str, NodePublicKeys]:
        return dict(self._nodes)

    def enroll(self, node: NodePublicKeys) -> None:
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
            node_id, self.epoch, self.effective_round, self.key_id, _pub_raw(eph.public_key()), salt, nonce, b""
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
        body = _PUBCTX_MAGIC + struct.pack(">IQ", self.epoch, self.effective_round) + _lp(self.public_context())
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
    r = _Reader(body, "signed public context", SignatureError)
    if r.take(4) != _PUBCTX_MAGIC:
        raise SignatureError("not a signed fedkv public context")
    epoch, eff = r.unpack(">IQ")
    pub = r.lp()
    r.done()
    return pub, epoch, eff


# --- signed updates ------------------------------------------------------------------------------

_UPDATE_MAGIC = b"FKS\x02"
_UPDATE_DOMAIN = b"fedkv-signed-update-v2"
NO_KEY_ID = bytes(16)
"""key_id of a plaintext (he=false) payload."""


def _update_message(run_id: int, node_id: str, round: int, epoch: int, key_id: bytes, kind: int,
                    tag: bytes, digest: bytes) -> bytes:
    return (
        _UPDATE_DOMAIN + struct.pack(">Q", run_id) + _lp(node_id.encode())
        + struct.pack(">QI", round, epoch) + key_id + struct.pack(">B", kind) + _lp(tag) + digest
    )


@dataclass(frozen=True)
class SignedUpdate:
    """A contribution plus what it is bound to: run, node, round, key epoch and key id, its kind
    (update or noise share), its aggregate tag (``crypto.binding``) and the payload digest."""

    run_id: int
    node_id: str
    round: int
    epoch: int
    key_id: bytes
    kind: int
    tag: bytes
    payload: bytes
    signature: bytes

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.payload).digest()

    def signed_message(self) -> bytes:
        return _update_message(self.run_id, self.node_id, self.round, self.epoch, self.key_id,
                               self.kind, self.tag, self.digest)

    def to_bytes(self) -> bytes:
        return (
            _UPDATE_MAGIC + struct.pack(">Q", self.run_id) + _lp(self.node_id.encode())
            + struct.pack(">QI", self.round, self.epoch) + self.key_id + struct.pack(">B", self.kind)
            + _lp(self.tag) + _lp(self.payload) + self.signature
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedUpdate:
        r = _Reader(data, "signed update", SignatureError)
        if r.take(4) != _UPDATE_MAGIC:
            raise SignatureError("not a signed fedkv update (bad magic)")
        (run_id,) = r.unpack(">Q")
        node_id = r.lp(1024).decode(errors="replace")
        rnd, epoch = r.unpack(">QI")
        key_id = r.take(16)
        (kind,) = r.unpack(">B")
        tag = r.lp(1024)
        payload = r.lp()
        sig = r.take(64)
        r.done()
        return cls(run_id, node_id, rnd, epoch, key_id, kind, tag, payload, sig)


def sign_update(node_keys: NodeKeys, node_id: str, round: int, payload: bytes, epoch: int = 0, *,
                run_id: int = 0, key_id: bytes = NO_KEY_ID, kind: int = CONTRIBUTION_UPDATE, tag: bytes = b"") -> bytes:
    """Sign ``payload`` for (run, node, round, key epoch, key id, kind, tag); returns wire bytes."""
    if node_id != node_keys.node_id:
        raise ValueError(f"node_keys belong to {node_keys.node_id!r}, not {node_id!r}")
    if round < 0 or epoch < 0 or run_id < 0:
        raise ValueError("run id, round and epoch must be non-negative")
    if len(key_id) != 16:
        raise ValueError("key_id is 16 bytes")
    unsigned = SignedUpdate(run_id, node_id, round, epoch, bytes(key_id), kind, bytes(tag), bytes(payload), b"")
    return replace(unsigned, signature=node_keys.sign(unsigned.signed_message())).to_bytes()


class UpdateVerifier:
    """Server side: accept each enrolled node's contribution of each kind once, for the current
    run, round, key epoch and key id; one payload may not arrive under two node ids."""

    def __init__(
        self,
        nodes: Iterable[NodePublicKeys] | Mapping[str, NodePublicKeys] = (),
        round: int = 0,
        epoch: int = 0,
        *,
        run_id: int = 0,
        key_id: bytes = NO_KEY_ID,
    ) -> None:
        items = nodes.values() if isinstance(nodes, Mapping) else nodes
        self.nodes = {n.node_id: n for n in items}
        self.round = round
        self.epoch = epoch
        self.run_id = run_id
        self.key_id = key_id
        self._seen: set[tuple[str, int]] = set()
        self._digests: dict[bytes, str] = {}

    def add_node(self, node: NodePublicKeys) -> None:
        self.nodes[node.node_id] = node

    def remove_node(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    def start_round(self, round: int) -> None:
        """Move to ``round`` (must not go back); forgets who already sent a contribution."""
        if round < self.round:
            raise ReplayError(f"round cannot go back from {self.round} to {round}")
        if round != self.round:
            self._seen.clear()
            self._digests.clear()
        self.round = round

    def rotate(self, epoch: int, key_id: bytes = NO_KEY_ID) -> None:
        """Switch to a new key epoch; contributions signed under older epochs are refused from now."""
        if epoch <= self.epoch and not (epoch == self.epoch == 0 and self.key_id == NO_KEY_ID):
            raise StaleKeyError(f"new epoch {epoch} must be greater than {self.epoch}")
        self.epoch = epoch
        self.key_id = key_id

    def __repr__(self) -> str:
        return f"UpdateVerifier(nodes={sorted(self.nodes)}, round={self.round}, epoch={self.epoch})"

    def verify(self, data: bytes | SignedUpdate, kind: int = CONTRIBUTION_UPDATE) -> SignedUpdate:
        """Return the verified ``SignedUpdate``, or raise without recording anything.

        The signature is checked before run/round/epoch, so a forged message that claims an old
        round is reported as forged, not as a replay.
        """
        su = SignedUpdate.from_bytes(data) if isinstance(data, (bytes, bytearray)) else data
        node = self.nodes.get(su.node_id)
        if node is None:
            raise UnknownNodeError(f"update from unknown node {su.node_id!r}")
        try:
            Ed25519PublicKey.from_public_bytes(node.sign_public).verify(su.signature, su.signed_message())
        except InvalidSignature as exc:
            raise SignatureError(f"signature of the update from {su.node_id!r} does not verify") from exc
        if su.run_id != self.run_id:
            raise ReplayError(f"update signed for run {su.run_id}, this is run {self.run_id}")
        if su.epoch != self.epoch or su.key_id != self.key_id:
            raise StaleKeyError(f"update signed under key epoch {su.epoch}, current epoch is {self.epoch}")
        if su.kind != kind:
            raise SignatureError(f"update of kind {su.kind} where kind {kind} was expected")
        if su.round != self.round:
            kind_s = "replayed/late" if su.round < self.round else "out-of-order (future)"
            raise ReplayError(f"{kind_s} update for round {su.round} from {su.node_id!r}; current round is {self.round}")
        if (su.node_id, su.kind) in self._seen:
            raise ReplayError(f"second update from {su.node_id!r} in round {self.round}")
        other = self._digests.get(su.digest)
        if other is not None:
            raise ReplayError(f"payload already received from node {other!r} this round")
        self._seen.add((su.node_id, su.kind))
        self._digests[su.digest] = su.node_id
        return su
