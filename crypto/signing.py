"""Node identities and update signatures (Ed25519), with `cryptography` primitives only.

- Each node owns an X25519 key pair (to receive the CKKS secret context, ``crypto.key_wrap``)
  and an Ed25519 key pair (to sign its updates); it enrolls by giving the key-making node and
  the server its ``NodePublicKeys``.
- Every encrypted update travels as a ``SignedUpdate`` over (run, node id, round, key epoch, key
  id, kind, aggregate tag, SHA-256 of the payload); ``UpdateVerifier`` rejects unknown nodes, bad
  signatures, other runs and rounds (replay, reorder), a second update of a kind in the same
  round, one payload under two node ids, and rotated-out key epochs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from crypto.binding import CONTRIBUTION_UPDATE
from crypto.context import DEFAULT_PRESET, CkksContext, CkksParams
from crypto.errors import KeyUnwrapError, ReplayError, SignatureError, StaleKeyError, UnknownNodeError
from crypto.framing import Reader, lp, pub_raw
from crypto.key_wrap import Dealer, WrappedKeyBundle, unwrap_bundle

__all__ = ["NO_KEY_ID", "NodeKeys", "NodePublicKeys", "SignedUpdate", "UpdateVerifier", "sign_update"]


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
        return NodePublicKeys(self.node_id, pub_raw(self._kx.public_key()), pub_raw(self._sign.public_key()))

    def private_bytes(self, passphrase: bytes) -> bytes:
        """Both private keys as passphrase-encrypted PKCS#8 PEM, for the node's own storage."""
        enc = serialization.BestAvailableEncryption(passphrase)
        pem = serialization.Encoding.PEM
        pkcs8 = serialization.PrivateFormat.PKCS8
        return (
            lp(self.node_id.encode())
            + lp(self._kx.private_bytes(pem, pkcs8, enc))
            + lp(self._sign.private_bytes(pem, pkcs8, enc))
        )

    @classmethod
    def from_private_bytes(cls, data: bytes, passphrase: bytes | None) -> NodeKeys:
        r = Reader(data, "node key file", KeyUnwrapError)
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
        return (lp(self.node_id.encode()) + lp(self._kx.private_bytes(pem, pkcs8, none))
                + lp(self._sign.private_bytes(pem, pkcs8, none)))

    @classmethod
    def from_private_pem(cls, data: bytes) -> NodeKeys:
        return cls.from_private_bytes(data, None)

    def unwrap(self, bundle: bytes | WrappedKeyBundle, dealer_key: bytes, *, min_epoch: int = 0) -> CkksContext:
        return unwrap_bundle(bundle, self, dealer_key, min_epoch=min_epoch)

    def _exchange(self, peer: bytes) -> bytes:
        return self._kx.exchange(X25519PublicKey.from_public_bytes(peer))

    def __repr__(self) -> str:  # never print key material
        return f"NodeKeys({self.node_id!r})"


# --- signed updates ------------------------------------------------------------------------------

_UPDATE_MAGIC = b"FKS\x02"
_UPDATE_DOMAIN = b"fedkv-signed-update-v2"
NO_KEY_ID = bytes(16)
"""key_id of a plaintext (he=false) payload."""


def _update_message(run_id: int, node_id: str, round: int, epoch: int, key_id: bytes, kind: int,
                    tag: bytes, digest: bytes) -> bytes:
    return (
        _UPDATE_DOMAIN + struct.pack(">Q", run_id) + lp(node_id.encode())
        + struct.pack(">QI", round, epoch) + key_id + struct.pack(">B", kind) + lp(tag) + digest
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
            _UPDATE_MAGIC + struct.pack(">Q", self.run_id) + lp(self.node_id.encode())
            + struct.pack(">QI", self.round, self.epoch) + self.key_id + struct.pack(">B", self.kind)
            + lp(self.tag) + lp(self.payload) + self.signature
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedUpdate:
        r = Reader(data, "signed update", SignatureError)
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
