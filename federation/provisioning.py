"""Key provisioning and update signing for a fedkv run (``crypto.keys`` over Flower messages).

Roles
-----
* **Node**: owns an X25519 key pair (receives the wrapped CKKS secret context) and an Ed25519
  key pair (signs its updates): ``crypto.NodeKeys``, generated once per run and kept in its
  ``context.state`` (the only per-node storage Flower keeps across messages; never logged,
  never sent — only ``NodePublicKeys`` leave the node).
* **Dealer**: ``crypto.Dealer`` creates the CKKS secret context, wraps it for each enrolled
  node (ephemeral X25519 -> HKDF-SHA256 -> AES-256-GCM) and signs each bundle and the public
  context with its Ed25519 key.
* **Server** (``OpaqueFedAvg``): receives the dealer-signed *public* context (checked: no
  secret key) and an ``UpdateVerifier`` holding the nodes' public signing keys. Nothing else.

Where the dealer runs
---------------------
In this app (simulation and the localhost demo) ``KeyService`` plays the dealer inside the
ServerApp *process*, at the start of the run, and relays bundles through Flower messages;
the strategy object never gets a reference to it (``KeyService.admit`` is passed to
``OpaqueFedAvg.run`` as an argument, not stored). Relaying is safe because a bundle is
AES-GCM-encrypted to one node's X25519 key and signed by the dealer: the server can neither
read nor forge it. In a real deployment the dealer is a separate trusted process (an
operator's machine) that the server cannot inspect: it receives the nodes' public keys
(relayed by the server or out of band), returns one bundle per node and the signed public
context, and the ServerApp forwards them with the same two messages as here. Nodes pin the
dealer's Ed25519 verify key: from their node config (``--node-config "dealer-key='<hex>'"``,
obtained out of band) when given, otherwise trust-on-first-use from the enroll message (what
simulation does; it only protects later messages, not the first one).

Messages (``query`` category, so they never reach Flower's default train/evaluate handlers)
--------------------------------------------------------------------------------------
``query.fedkv_enroll``
    server -> node: ConfigRecord ``enroll`` {``dealer-key``: 32-byte Ed25519 verify key
    (he=true only)}.
    node -> server: ConfigRecord ``node-keys`` {``node-id``: str, ``kx-public``: 32 bytes,
    ``sign-public``: 32 bytes}. The node generates its keys on first contact and returns the
    same public keys afterwards; a dealer key that differs from the pinned one is refused.
``query.fedkv_provision`` (he=true only)
    server -> node: ConfigRecord ``provision`` {``bundle``: WrappedKeyBundle bytes (~187 KB at
    fedkv-4096), ``dealer-key``, ``public-context``: dealer-signed public context (~125 KB)}.
    The node checks the dealer key against its pin, both signatures, that the bundle is for it
    and that its context's key id equals the signed public context's, then keeps the *wrapped*
    bundle (not the raw secret) in ``context.state`` and unwraps it when it needs the key.
    node -> server: ConfigRecord ``provisioned`` {``key-id``: 16 bytes, ``epoch``: int}.

Signed updates: every update blob (CKKS or plaintext alike) travels as
``crypto.sign_update(keys, node_id, round, payload, epoch)``; ``OpaqueFedAvg`` verifies it
with ``UpdateVerifier`` (started for the round) before ``Aggregator.add``.

Not wired here: key rotation (``Dealer.rotate``) — one key epoch (0) per run.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import log

from crypto import (
    CkksContext,
    Dealer,
    NodeKeys,
    NodePublicKeys,
    UpdateVerifier,
    WrappedKeyBundle,
    load_context,
    sign_update,
    unwrap_bundle,
    verify_public_context,
)
from crypto.errors import CryptoError

ENROLL = "query.fedkv_enroll"
PROVISION = "query.fedkv_provision"

# record names in messages
ENROLL_REC = "enroll"
NODE_KEYS_REC = "node-keys"
PROVISION_REC = "provision"
PROVISIONED_REC = "provisioned"

# record names in the node's context.state
STATE_KEYS = "fedkv.node-keys"
STATE_DEALER = "fedkv.dealer"
STATE_CKKS = "fedkv.ckks"

PASSPHRASE_ENV = "FEDKV_NODE_KEY_PASSPHRASE"
_DEFAULT_PASSPHRASE = b"fedkv-node-keys-at-rest"
"""Used when FEDKV_NODE_KEY_PASSPHRASE is unset. NOT a protection (it is in the source): it
keeps one storage format. Set the variable on a real node to encrypt its keys at rest."""


class ProvisioningError(RuntimeError):
    """A node cannot take part: it refused provisioning or lacks its keys."""


# --- node side ----------------------------------------------------------------------------


def _passphrase() -> bytes:
    value = os.environ.get(PASSPHRASE_ENV)
    return value.encode() if value else _DEFAULT_PASSPHRASE


def node_id_of(context: Context) -> str:
    """The id a node signs with: Flower's node id as a string (the server sees the same id)."""
    return str(context.node_id)


def node_keys(context: Context, *, create: bool = False) -> NodeKeys:
    """This node's private keys from ``context.state`` (generated there if ``create``)."""
    rec = context.state.config_records.get(STATE_KEYS)
    if rec is None:
        if not create:
            raise ProvisioningError("node has no keys: it was not enrolled in this run")
        keys = NodeKeys.generate(node_id_of(context))
        context.state[STATE_KEYS] = ConfigRecord(
            {"node-id": keys.node_id, "private": keys.private_bytes(_passphrase())}
        )
        return keys
    keys = NodeKeys.from_private_bytes(bytes(rec["private"]), _passphrase())
    if keys.node_id != node_id_of(context):
        raise ProvisioningError(f"stored keys belong to node {keys.node_id}, not {node_id_of(context)}")
    return keys


def _pinned_dealer_key(context: Context) -> bytes | None:
    configured = context.node_config.get("dealer-key")
    if configured:
        return bytes.fromhex(str(configured))
    rec = context.state.config_records.get(STATE_DEALER)
    return bytes(rec["dealer-key"]) if rec is not None else None


def _check_dealer_key(context: Context, offered: bytes) -> bytes:
    """Pin on first contact (unless node-config pins it); refuse a different key later."""
    pinned = _pinned_dealer_key(context)
    if pinned is None:
        context.state[STATE_DEALER] = ConfigRecord({"dealer-key": offered})
        return offered
    if offered != pinned:
        raise ProvisioningError("the server offers a dealer key that differs from the pinned one; refusing")
    return pinned


def handle_enroll(msg: Message, context: Context) -> Message:
    """``query.fedkv_enroll``: make (once) and return this node's public keys."""
    req = msg.content.config_records.get(ENROLL_REC)
    offered = req.get("dealer-key") if req is not None else None
    if offered:
        _check_dealer_key(context, bytes(offered))
    pub = node_keys(context, create=True).public
    reply = ConfigRecord({"node-id": pub.node_id, "kx-public": pub.kx_public, "sign-public": pub.sign_public})
    return Message(RecordDict({NODE_KEYS_REC: reply}), reply_to=msg)


def handle_provision(msg: Message, context: Context) -> Message:
    """``query.fedkv_provision``: verify + unwrap the bundle, keep it, acknowledge its key id."""
    req = msg.content.config_records[PROVISION_REC]
    dealer_key = _check_dealer_key(context, bytes(req["dealer-key"]))
    bundle = bytes(req["bundle"])
    keys = node_keys(context)
    pub_bytes, epoch, _ = verify_public_context(bytes(req["public-context"]), dealer_key)
    ctx = unwrap_bundle(bundle, keys, dealer_key)
    public = load_context(pub_bytes)
    if public.is_private:
        raise ProvisioningError("the 'public' context carries a secret key; refusing")
    if ctx.key_id != public.key_id:
        raise ProvisioningError("the wrapped context does not match the dealer's public context")
    b = WrappedKeyBundle.from_bytes(bundle)
    if b.epoch != epoch:
        raise ProvisioningError(f"bundle epoch {b.epoch} != public context epoch {epoch}")
    context.state[STATE_CKKS] = ConfigRecord({"bundle": bundle, "epoch": epoch, "key-id": ctx.key_id})
    ack = ConfigRecord({"key-id": ctx.key_id, "epoch": epoch})
    return Message(RecordDict({PROVISIONED_REC: ack}), reply_to=msg)


_UNWRAPPED: OrderedDict[bytes, CkksContext] = OrderedDict()
"""Per-process cache of unwrapped contexts, keyed by a digest of (node, dealer key, bundle):
unwrapping and loading a context costs ~6 ms per message otherwise. A process that ran the
handler held the secret anyway; nothing here outlives the process."""


def secret_context(context: Context) -> tuple[CkksContext, int]:
    """(secret CKKS context, key epoch), unwrapped from the bundle kept in ``context.state``."""
    rec = context.state.config_records.get(STATE_CKKS)
    dealer_key = _pinned_dealer_key(context)
    if rec is None or dealer_key is None:
        raise ProvisioningError("node holds no CKKS key: it was not provisioned in this run")
    bundle = bytes(rec["bundle"])
    key = hashlib.sha256(node_id_of(context).encode() + b"|" + dealer_key + b"|" + bundle).digest()
    ctx = _UNWRAPPED.get(key)
    if ctx is None:
        ctx = unwrap_bundle(bundle, node_keys(context), dealer_key)
        _UNWRAPPED[key] = ctx
        while len(_UNWRAPPED) > 64:
            _UNWRAPPED.popitem(last=False)
    return ctx, int(rec["epoch"])


def sign(context: Context, keys: NodeKeys, server_round: int, payload: bytes, epoch: int = 0) -> bytes:
    """The wire form of an update: signed over (node id, round, epoch, SHA-256(payload))."""
    return sign_update(keys, node_id_of(context), server_round, payload, epoch)


# --- server side (the dealer's relay) ---------------------------------------------------------


@dataclass
class AdmitReport:
    """What one ``admit`` call did (for the round's record)."""

    ready: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


class KeyService:
    """Enrolls nodes, provisions them (he=true) and fills the strategy's ``UpdateVerifier``.

    Holds the ``Dealer`` (the CKKS secret context) when he=true: keep it out of the strategy.
    Exposes only public material: ``verifier``, ``public_context``, ``dealer_key``.
    """

    def __init__(self, he: bool, preset: str = "fedkv-4096", timeout: float = 120.0,
                 dealer: Dealer | None = None) -> None:
        self.he = he
        self.timeout = timeout
        self._dealer = (dealer or Dealer(preset)) if he else None
        self.verifier = UpdateVerifier()
        self.ready: set[int] = set()
        self.signed_public_context: bytes | None = None
        self.public_context: bytes | None = None
        if self._dealer is not None:
            self.signed_public_context = self._dealer.signed_public_context()
            # what the server would do with a remote dealer: check the signature, keep the bytes
            self.public_context, _, _ = verify_public_context(self.signed_public_context, self.dealer_key)
        self.stats: dict[str, Any] = {
            "dealer": "serverapp-process" if he else None,
            "enrolled": 0,
            "provisioned": 0,
            "refused": 0,
            "bundle_bytes": 0,
            "public_context_bytes": len(self.public_context or b""),
            "signed_public_context_bytes": len(self.signed_public_context or b""),
            "seconds": 0.0,
        }

    @property
    def dealer_key(self) -> bytes | None:
        return self._dealer.verify_key if self._dealer is not None else None

    def __repr__(self) -> str:  # never show key material
        return f"KeyService(he={self.he}, ready={sorted(self.ready)})"

    def admit(self, grid: Any, node_ids: list[int]) -> AdmitReport:
        """Enroll (+ provision) every node in ``node_ids`` not ready yet; return who is ready."""
        out = AdmitReport()
        t0 = time.perf_counter()
        new = [n for n in node_ids if n not in self.ready]
        if new:
            enrolled = self._enroll(grid, new, out)
            done = self._provision(grid, enrolled, out) if self.he else enrolled
            for n in done:
                self.ready.add(n)
                out.admitted.append(n)
            if done:
                log(INFO, "provisioning: admitted node(s) %s", done)
        out.ready = sorted(n for n in node_ids if n in self.ready)
        out.seconds = time.perf_counter() - t0
        self.stats["seconds"] += out.seconds
        return out

    def _refuse(self, out: AdmitReport, node: int, phase: str, reason: str) -> None:
        log(WARNING, "%s: node %s not admitted: %s", phase, node, reason)
        out.dropped.append({"node": node, "phase": phase, "reason": reason})
        self.stats["refused"] += 1

    def _exchange(self, grid: Any, phase: str, messages: list[Message], out: AdmitReport) -> dict[int, Message]:
        expected = [m.metadata.dst_node_id for m in messages]
        replies: dict[int, Message] = {}
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                self._refuse(out, node, phase, f"client error: {reply.error.reason}")
            else:
                replies[node] = reply
        for node in expected:
            if node not in replies and not any(d["node"] == node and d["phase"] == phase for d in out.dropped):
                self._refuse(out, node, phase, f"no reply within round-timeout={self.timeout}s")
        return replies

    def _enroll(self, grid: Any, nodes: list[int], out: AdmitReport) -> list[int]:
        body = {"dealer-key": self.dealer_key} if self.dealer_key is not None else {}
        messages = [
            Message(RecordDict({ENROLL_REC: ConfigRecord(dict(body))}), dst_node_id=n, message_type=ENROLL)
            for n in nodes
        ]
        enrolled = []
        for node, reply in self._exchange(grid, "enroll", messages, out).items():
            try:
                rec = reply.content.config_records[NODE_KEYS_REC]
                pub = NodePublicKeys(str(rec["node-id"]), bytes(rec["kx-public"]), bytes(rec["sign-public"]))
                if pub.node_id != str(node):
                    raise ProvisioningError(f"reply claims node id {pub.node_id!r}")
                if self._dealer is not None:
                    self._dealer.enroll(pub)  # validates key sizes
                elif len(pub.kx_public) != 32 or len(pub.sign_public) != 32:
                    raise ProvisioningError("public keys must be raw 32-byte keys")
            except (KeyError, TypeError, ValueError, ProvisioningError, CryptoError) as err:
                self._refuse(out, node, "enroll", f"bad enroll reply: {type(err).__name__}: {err}")
                continue
            self.verifier.add_node(pub)
            self.stats["enrolled"] += 1
            enrolled.append(node)
        return sorted(enrolled)

    def _provision(self, grid: Any, nodes: list[int], out: AdmitReport) -> list[int]:
        assert self._dealer is not None and self.signed_public_context is not None
        messages = []
        for n in nodes:
            bundle = self._dealer.wrap_for(str(n)).to_bytes()
            self.stats["bundle_bytes"] = len(bundle)
            rec = ConfigRecord(
                {"bundle": bundle, "dealer-key": self.dealer_key, "public-context": self.signed_public_context}
            )
            messages.append(Message(RecordDict({PROVISION_REC: rec}), dst_node_id=n, message_type=PROVISION))
        done = []
        for node, reply in self._exchange(grid, "provision", messages, out).items():
            try:
                ack = reply.content.config_records[PROVISIONED_REC]
                ok = bytes(ack["key-id"]) == self._dealer.key_id and int(ack["epoch"]) == self._dealer.epoch
            except (KeyError, TypeError, ValueError) as err:
                self._refuse(out, node, "provision", f"bad provision reply: {type(err).__name__}: {err}")
                continue
            if not ok:
                self._refuse(out, node, "provision", "node acknowledged another key id/epoch")
                continue
            self.stats["provisioned"] += 1
            done.append(node)
        # nodes that did not finish provisioning cannot decrypt: keep them out of the verifier
        for n in nodes:
            if n not in done:
                self.verifier.remove_node(str(n))
        return sorted(done)
