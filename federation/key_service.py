"""The in-run key service: enrollment, key provisioning and rotation (server ``KeyService``, node
handlers). The CKKS secret key is made by a node or a provisioner, never the server. (The offline
provisioner that writes startup kits is ``federation.deploy.provision``.)

Who makes the key (``key_origin`` in the results JSON)
------------------------------------------------------
* **deployment** (``server-kit`` in the run config, ``kit-dir`` in each node config): the offline
  provisioner (``python -m federation.deploy.provision``) made epoch 0 and wrote it into every node kit;
  the server kit holds only the provisioner-signed public context. Identity keys are pinned: the
  server accepts an enroll reply only if its keys are the roster's for that name, and a node wraps
  or accepts keys only for and from roster members.
* **simulation** (no kits): the admitted node with the lowest Flower node id makes the context
  (``query.fedkv_keygen``) and wraps it for each peer (X25519 + HKDF + AES-GCM, signed with its
  Ed25519 key); the server relays the bundles (``query.fedkv_provision``) and keeps only the
  node-signed public context. Peer keys are trusted on first use (logged as such), bounded:
  the first keygen or provision request a node takes pins its member set (node ids, partition
  ids, identity keys; ``NodeStore.pin_members``) under the node's own ``num-partitions``; later
  requests may list pinned members (a subset: rotation after a departure; a node that left
  coming back) and new members only in a partition no pinned member holds, so nothing can be
  added once every partition is pinned. A server that substitutes keys at a node's first key is
  not detected in simulation; kits close that.

Either way the ServerApp process never creates, receives or parses a secret context (the
``crypto.context`` guard records where that happens; a test checks a real ``flwr run``).

Rotation: when a node leaves (dropped, killed, removed) and, with ``rotate-every`` K, every K
rounds, a remaining node makes a new context (epoch + 1) for the remaining nodes only; a node
that joins later receives every epoch's key from a holder, so it can replay the history.

Messages (``query`` category)
-----------------------------
``query.fedkv_enroll``   server -> node: ``enroll`` {} ; node -> server: ``node-keys``
    {node-id, name, kx-public, sign-public, epoch, key-id, partition-id, num-partitions}
    (epoch -1 = holds no CKKS key).
``query.fedkv_keygen``   server -> key-making node: ``keygen`` {epoch, fresh, preset,
    effective-round, members, names, partitions, kx, sign, epochs}; reply ``keygen`` {epoch, key-id, members}
    + ArrayRecord ``bundles`` {"<member>": its bundles, one per epoch asked (``protocol.pack_blobs``)}
    + ArrayRecord ``public-context`` {ctx}. Members include the key-making node itself.
``query.fedkv_provision`` server -> node: ``provision`` {dealer-node, dealer-name, dealer-sign,
    members, names, partitions, kx, sign} (the members the key was wrapped for, as in keygen)
    + ArrayRecord ``bundles`` {"e<epoch>": bundle} + ``public-context``; reply ``provisioned``
    {key-id, epoch}.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import log

from crypto import (
    CONTRIBUTION_UPDATE,
    DEFAULT_PRESET,
    NO_KEY_ID,
    NodeKeys,
    NodePublicKeys,
    UpdateVerifier,
    WrappedKeyBundle,
    load_public_context,
    sign_update,
    unwrap_bundle,
    verify_public_context,
)
from crypto.context import PQ_LOG_Q_BOUND, PRESETS, CkksParams, is_post_quantum
from crypto.errors import CryptoError
from federation import messages, protocol
from federation.messages import BUNDLES, CTX, ENROLL_REQUEST, PROVISION_REQUEST, PUBLIC_CONTEXT
from federation.config import RunConfig
from federation.node_store import MemberSetError, NodeStore, Peer, PeerKeyError, ProvisioningError
from federation.node_policy import NodePolicy

__all__ = ["ENROLL", "KEYGEN", "PROVISION", "KeyService", "AdmitReport", "DowngradeError", "MemberSetError", "PeerKeyError",
           "ProvisioningError", "node_keys", "node_policy", "secret_context", "sign"]

ENROLL = "query.fedkv_enroll"
KEYGEN = "query.fedkv_keygen"
PROVISION = "query.fedkv_provision"



# --- node side ----------------------------------------------------------------------------


def node_policy(context: Context) -> NodePolicy:
    store = NodeStore.for_context(context)
    return NodePolicy.of(context.node_config, store.kit.policy if store.kit is not None else None)


def node_keys(context: Context, *, create: bool = False) -> NodeKeys:
    """This node's identity keys, from its kit or its node-local directory."""
    return NodeStore.for_context(context).identity(create=create)


def secret_context(context: Context, epoch: int | None = None) -> tuple[Any, int]:
    """(secret CKKS context, epoch): the newest the node holds, or the one of ``epoch``."""
    store = NodeStore.for_context(context)
    held = store.held()
    if held is None:
        raise ProvisioningError("node holds no CKKS key: it was not provisioned in this run")
    epoch = held[0] if epoch is None else epoch
    return store.context(epoch), epoch


def sign(context: Context, keys: NodeKeys, server_round: int, payload: bytes, epoch: int = 0, *,
         key_id: bytes = NO_KEY_ID, kind: int = CONTRIBUTION_UPDATE, tag: bytes = b"") -> bytes:
    """The wire form of a contribution: signed over (run, node, round, epoch, key id, kind, tag, digest)."""
    return sign_update(keys, str(context.node_id), server_round, payload, epoch, run_id=int(context.run_id),
                       key_id=key_id, kind=kind, tag=tag)


def _own_partition(context: Context, store: NodeStore) -> tuple[int, int]:
    """(partition-id, num-partitions) of this node: its kit's, else its node config's."""
    if store.kit is not None:
        return store.kit.partition_id, store.kit.num_partitions
    from federation.node_host import spec_from_context

    try:
        spec = spec_from_context(context)
    except ValueError as err:
        raise ProvisioningError(f"node config: {err}") from None
    return spec.partition_id, spec.num_partitions


def handle_enroll(msg: Message, context: Context) -> Message:
    """``query.fedkv_enroll``: check the run against the node's policy, return its public keys."""
    node_policy(context).check(RunConfig.from_run_config(context.run_config))
    store = NodeStore.for_context(context)
    partition, num_partitions = _own_partition(context, store)
    pub = store.identity(create=True).public
    held = store.held()
    return messages.enroll_reply(msg, messages.EnrollReply(
        pub.node_id, store.name, pub.kx_public, pub.sign_public, held[0] if held else -1,
        held[1] if held else b"", partition, num_partitions))


def _member_list(req: ConfigRecord) -> list[tuple[NodePublicKeys, str, int]]:
    """(keys, name, partition id) of each member a keygen/provision request lists."""
    try:
        ids, names = list(req["members"]), list(req["names"])
        kx, sg = list(req["kx"]), list(req["sign"])
        parts = list(req["partitions"]) if "partitions" in req else [-1] * len(ids)
        ok = len(ids) == len(names) == len(kx) == len(sg) == len(parts) and len(set(ids)) == len(ids)
        ok = ok and all(isinstance(p, int) and not isinstance(p, bool) for p in parts)
        members = [(NodePublicKeys(str(n), bytes(k), bytes(s)), str(name), int(p))
                   for n, name, k, s, p in zip(ids, names, kx, sg, parts)]
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ProvisioningError("malformed member list")
    return members


def _pin(context: Context, store: NodeStore, members: list[tuple[NodePublicKeys, str, int]]) -> None:
    """Simulation: the member set must fit the one this node pinned at first use (and is pinned
    now if this is its first key). This node must be listed as itself: its id, keys, partition."""
    partition, num_partitions = _own_partition(context, store)
    if any(p < 0 for _, _, p in members):
        raise MemberSetError("the request lists no partition ids for its members; refusing")
    me = store.identity().public
    own = next(((pub, p) for pub, _, p in members if pub.node_id == me.node_id), None)
    if own is None or (own[0].kx_public, own[0].sign_public, own[1]) != (me.kx_public, me.sign_public, partition):
        raise MemberSetError(f"the request does not list this node ({me.node_id}) with its own keys and "
                             f"partition {partition}; refusing")
    store.pin_members([Peer(pub.node_id, p, pub.sign_public, pub.kx_public) for pub, _, p in members],
                      num_partitions)


def _members(req: ConfigRecord, store: NodeStore, context: Context) -> list[tuple[NodePublicKeys, str]]:
    """The peers to wrap for, checked against the kit roster (or the member set pinned at first use)."""
    members = _member_list(req)
    if store.kit is not None:
        for pub, name, _ in members:
            entry = store.kit.roster.by_name(name)
            if entry is None or entry.kx_public != pub.kx_public or entry.sign_public != pub.sign_public:
                raise PeerKeyError(f"member {name!r} does not hold the keys pinned in this node's kit; refusing to wrap")
    else:
        _pin(context, store, members)
        log(WARNING, "keygen: peer keys are trusted on first use (simulation, no kits), bounded by the "
                     "member set pinned at this node's first key")
    return [(pub, name) for pub, name, _ in members]


class DowngradeError(ProvisioningError):
    """A CKKS key below this node's he-security (a classical ring for a post-quantum node)."""


def _check_security(context: Context, preset: str | CkksParams, what: str) -> None:
    """Refuse a CKKS ring outside the node's he-security: the stricter of the run config's (as
    this node reads it) and its own policy's (node config / kit ``he-security``). The server
    names the preset in its keygen request; the node does not take its word for it."""
    cfg = RunConfig.from_run_config(context.run_config)
    required = "post-quantum" if "post-quantum" in (cfg.he_security, node_policy(context).he_security) else "classical"
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ProvisioningError(f"{what}: unknown CKKS preset {preset[:40]!r}; refusing")
        preset = PRESETS[preset]
    if required == "post-quantum" and not is_post_quantum(preset):
        raise DowngradeError(
            f"{what}: the CKKS preset {preset.name!r} (log q {sum(preset.coeff_mod_bit_sizes)} at N="
            f"{preset.poly_modulus_degree}) is below this node's he-security post-quantum (log q <= "
            f"{PQ_LOG_Q_BOUND.get(preset.poly_modulus_degree, 0)}); refusing: no key is made or taken")


def handle_keygen(msg: Message, context: Context) -> Message:
    """``query.fedkv_keygen``: make (fresh) or re-wrap CKKS keys for the listed members."""
    node_policy(context).check(RunConfig.from_run_config(context.run_config))
    req = msg.content.config_records[messages.KEYGEN]
    store = NodeStore.for_context(context)
    keys = store.identity()
    if int(req["fresh"]):  # before anything is pinned
        _check_security(context, str(req["preset"]), "keygen")
    epoch, members = int(req["epoch"]), _members(req, store, context)
    if int(req["fresh"]):
        dealer = keys.dealer(str(req["preset"]), epoch=epoch, effective_round=int(req["effective-round"]))
        store.save_context(dealer.context, epoch)
        epochs = [epoch]
    else:
        epochs = sorted(int(e) for e in req["epochs"])
    packs: dict[str, list[bytes]] = {pub.node_id: [] for pub, _ in members}
    dealer = None
    for e in epochs:
        _check_security(context, store.context(e).params, f"keygen (epoch {e})")
        dealer = keys.dealer(store.context(e).params, context=store.context(e), epoch=e)
        for pub, _ in members:
            dealer.enroll(pub)
            packs[pub.node_id].append(dealer.wrap_for(pub.node_id).to_bytes())
    assert dealer is not None
    bundles = {node: protocol.pack_blobs(packed) for node, packed in packs.items()}
    return messages.keygen_reply(msg, messages.KeygenReply(dealer.epoch, dealer.key_id, bundles,
                                                           dealer.signed_public_context()))


def _check_dealer(context: Context, store: NodeStore, req: ConfigRecord, dealer_sign: bytes) -> None:
    dealer_node, dealer_name = str(req["dealer-node"]), str(req["dealer-name"])
    if store.kit is not None:
        entry = store.kit.roster.by_name(dealer_name)
        if entry is None or entry.sign_public != dealer_sign:
            raise PeerKeyError("the key bundle's signer is not a member pinned in this node's kit; refusing")
        return
    if "members" not in req:
        raise MemberSetError("the provision request lists no member set; refusing")
    members = _member_list(req)
    dealer = next((pub for pub, _, _ in members if pub.node_id == dealer_node), None)
    if dealer is None or dealer.sign_public != dealer_sign:
        raise MemberSetError(f"the key maker {dealer_node[:20]!r} is not a listed member with its signing key; refusing")
    _pin(context, store, members)


def handle_provision(msg: Message, context: Context) -> Message:
    """``query.fedkv_provision``: verify the signer, unwrap every bundle, keep the keys in files."""
    req = msg.content.config_records[PROVISION_REQUEST]
    store = NodeStore.for_context(context)
    dealer_sign = bytes(req["dealer-sign"])
    pub_signed = protocol.array_to_bytes(msg.content.array_records[PUBLIC_CONTEXT][CTX])
    pub_bytes, pub_epoch, _ = verify_public_context(pub_signed, dealer_sign)
    public = load_public_context(pub_bytes)  # refuses a secret context before parsing it
    _check_security(context, public.params, "provision")  # before anything is pinned
    _check_dealer(context, store, req, dealer_sign)
    keys = store.identity()
    newest = None
    for key, arr in sorted(msg.content.array_records[BUNDLES].items()):
        bundle = WrappedKeyBundle.from_bytes(protocol.array_to_bytes(arr))
        ctx = unwrap_bundle(bundle, keys, dealer_sign)
        store.save_context(ctx, bundle.epoch)
        if newest is None or bundle.epoch > newest[0]:
            newest = (bundle.epoch, ctx.key_id)
    if newest is None or newest != (pub_epoch, public.key_id):
        raise ProvisioningError("the bundles do not match the signed public context")
    return messages.provision_ack(msg, messages.ProvisionAck(key_id=newest[1], epoch=newest[0]))


# --- server side (relay, roster, rotation) --------------------------------------------------


@dataclass
class AdmitReport:
    """What one ``admit`` call did (for the round's record)."""

    ready: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Member:
    pub: NodePublicKeys
    name: str
    partition: int


class KeyService:
    """Enrolls nodes, has a node (or the kits) supply the CKKS key, relays bundles, rotates.

    Holds only public material: the nodes' public keys, the current signed public context and
    the ``UpdateVerifier``. It never holds, receives or parses a secret context.
    """

    def __init__(self, cfg: RunConfig, run_id: int, server_kit: Any = None, preset: str | None = None) -> None:
        self.cfg = cfg
        self.preset = preset if preset is not None else cfg.ckks_preset
        """The CKKS preset a key-making node is asked for (``codec.ckks_preset_for``, resolved);
        "auto" left unresolved (no model size given) asks for ``crypto.DEFAULT_PRESET``."""
        if self.preset == "auto":
            self.preset = DEFAULT_PRESET
        self.he = cfg.he
        self.timeout = cfg.round_timeout
        self.kit = server_kit
        self.verifier = UpdateVerifier(run_id=run_id)
        self.members: dict[int, _Member] = {}
        self.num_partitions: int | None = None
        """Of the first node enrolled; a node that reports another one is refused."""
        self.holders: set[int] = set()
        self.retry_at: dict[int, int] = {}
        """Round from which a node whose enrollment or keying failed is tried again (back-off)."""
        self.epoch = -1
        self.key_id = NO_KEY_ID
        self.public_context: bytes | None = None
        self.key_origin: dict[str, Any] = {"party": None}
        self._failures: dict[int, int] = {}
        self._rekeyed: set[int] = set()
        self.rotations: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {"enrollment": "pinned" if server_kit is not None else "tofu",
                                      "enrolled": 0, "provisioned": 0, "refused": 0, "seconds": 0.0}
        if server_kit is not None and self.he:
            pub, epoch, _ = verify_public_context(server_kit.signed_public_context, server_kit.roster.provisioner_key)
            self._set_key(pub, epoch, {"party": "provisioner", "node": None, "epoch": epoch})

    def __repr__(self) -> str:
        return f"KeyService(he={self.he}, epoch={self.epoch}, holders={sorted(self.holders)})"

    def _set_key(self, pub_bytes: bytes, epoch: int, origin: dict[str, Any]) -> None:
        ctx = load_public_context(pub_bytes)  # refuses a secret context before parsing it
        self.public_context, self.epoch, self.key_id = pub_bytes, epoch, ctx.key_id
        self.verifier.rotate(epoch, ctx.key_id)
        if self.key_origin.get("party") is None:
            self.key_origin = origin
        if not self.kit and epoch == 0:
            log(WARNING, "provisioning: simulation without kits; peer keys are trusted on first use")

    # -- admission ----------------------------------------------------------------------
    def admit(self, grid: Any, node_ids: list[int], rnd: int = 1) -> AdmitReport:
        """Enroll (and, he=true, key) every connected node not ready yet; return who is ready."""
        out, t0 = AdmitReport(), time.perf_counter()
        due = [n for n in node_ids if self.retry_at.get(n, 0) <= rnd]
        new = [n for n in due if n not in self.members]
        if new:
            log(INFO, "provisioning: enrolling %d node(s) (first contact: each loads its data and "
                      "makes its identity keys) ...", len(new))
            self._enroll(grid, new, out)
            log(INFO, "provisioning: %d of %d enrolled in %.1f s", len([n for n in new if n in self.members]),
                len(new), time.perf_counter() - t0)
        if self.he:
            lacking = [n for n in due if n in self.members and n not in self.holders]
            if lacking:
                t1 = time.perf_counter()
                log(INFO, "provisioning: giving %d node(s) the CKKS key ...", len(lacking))
                self._key(grid, lacking, rnd, out)
                log(INFO, "provisioning: %d of %d keyed in %.1f s", len([n for n in lacking if n in self.holders]),
                    len(lacking), time.perf_counter() - t1)
        ready = self.holders if self.he else set(self.members)
        out.admitted = sorted(n for n in due if n in ready and (n in new or n in self._rekeyed))
        self._rekeyed = set()
        if out.admitted:
            log(INFO, "provisioning: admitted node(s) %s", out.admitted)
        for d in out.dropped:  # back off: 1, 2, 4 ... rounds before trying that node again
            tries = self._failures[d["node"]] = self._failures.get(d["node"], 0) + 1
            self.retry_at[d["node"]] = rnd + 2 ** (tries - 1)
        out.ready = sorted(n for n in node_ids if n in ready)
        out.seconds = time.perf_counter() - t0
        self.stats["seconds"] += out.seconds
        return out

    def depart(self, nodes: list[int]) -> list[int]:
        """Nodes that left a round (he=true): out of the key group until a holder re-keys them."""
        gone = sorted(n for n in nodes if n in self.holders)
        self.holders.difference_update(gone)
        return gone

    def _refuse(self, out: AdmitReport, node: int, phase: str, reason: str) -> None:
        log(WARNING, "%s: node %s not admitted: %s", phase, node, reason)
        out.dropped.append({"node": node, "phase": phase, "reason": reason})
        self.stats["refused"] += 1

    def _exchange(self, grid: Any, phase: str, messages: list[Message], out: AdmitReport) -> dict[int, Message]:
        expected = {m.metadata.dst_node_id for m in messages}
        got: dict[int, Message] = {}
        got_replies = grid.send_and_receive(messages, timeout=self.timeout)
        sent = protocol.destinations(messages)
        for reply in got_replies:
            node = protocol.reply_sender(reply, sent)
            if node not in expected or node in got:
                continue
            if reply.has_error():
                self._refuse(out, node, phase, f"client error: {protocol.error_text(reply)}")
                expected.discard(node)
            else:
                got[node] = reply
        for node in sorted(expected - set(got)):
            self._refuse(out, node, phase, f"no reply within round-timeout={self.timeout}s")
        return got

    def _enroll(self, grid: Any, nodes: list[int], out: AdmitReport) -> None:
        msgs = [Message(RecordDict({ENROLL_REQUEST: ConfigRecord({})}), dst_node_id=n, message_type=ENROLL)
                for n in nodes]
        for node, reply in sorted(self._exchange(grid, "enroll", msgs, out).items()):
            try:
                rec = messages.parse_enroll_reply(reply, str(node))
                self._check_roster(rec)
                self._check_partition(rec)
            except (messages.BadReply, ProvisioningError) as err:
                self._refuse(out, node, "enroll", f"bad enroll reply: {err}")
                continue
            pub = NodePublicKeys(rec.node_id, rec.kx_public, rec.sign_public)
            self.members[node] = _Member(pub, rec.name, rec.partition_id)
            self.num_partitions = rec.num_partitions
            self.verifier.add_node(pub)
            self.stats["enrolled"] += 1
            if self.he and rec.epoch == self.epoch and rec.key_id == self.key_id and self.epoch >= 0:
                self.holders.add(node)  # a kit node: holds the provisioner's key already

    def _check_roster(self, rec: Any) -> None:
        if self.kit is None:
            return
        entry = self.kit.roster.by_name(rec.name)
        if entry is None:
            raise PeerKeyError(f"node name {rec.name[:40]!r} is not in the server kit's roster")
        if entry.kx_public != rec.kx_public or entry.sign_public != rec.sign_public:
            raise PeerKeyError(f"keys of {rec.name[:40]!r} differ from the ones pinned in the roster")
        if any(m.name == rec.name for m in self.members.values()):
            raise PeerKeyError(f"{rec.name[:40]!r} is already enrolled under another node id")
        if (rec.partition_id, rec.num_partitions) != (entry.partition_id, self.kit.roster.num_partitions):
            raise PeerKeyError(f"{rec.name[:40]!r} reports partition {rec.partition_id}/{rec.num_partitions}, "
                               f"the roster {entry.partition_id}/{self.kit.roster.num_partitions}")

    def _check_partition(self, rec: Any) -> None:
        """One member per partition, one num-partitions for all (nodes pin both at their first key)."""
        if self.num_partitions is not None and rec.num_partitions != self.num_partitions:
            raise ProvisioningError(f"num-partitions={rec.num_partitions} differs from the enrolled nodes' "
                                    f"{self.num_partitions}")
        owner = next((n for n, m in self.members.items() if m.partition == rec.partition_id), None)
        if owner is not None:
            raise ProvisioningError(f"partition-id={rec.partition_id} is enrolled already (node {owner})")

    # -- keys ---------------------------------------------------------------------------
    def _key(self, grid: Any, lacking: list[int], rnd: int, out: AdmitReport) -> None:
        """Give ``lacking`` nodes the key: a fresh one if there is none, else a holder re-wraps."""
        if self.epoch < 0:
            self._fresh_key(grid, sorted(lacking), rnd, out)
            return
        dealers = sorted(self.holders)
        if dealers:
            self._distribute(grid, dealers[0], lacking, list(range(self.epoch + 1)), False, rnd, out)

    def rotate(self, grid: Any, remaining: list[int], rnd: int, reason: str, out: AdmitReport | None = None) -> bool:
        """New key epoch for ``remaining`` only (a departed node cannot read later aggregates);
        nodes that fail to take the new key are listed in ``out.dropped``."""
        members = sorted(n for n in remaining if n in self.holders)
        if not self.he or not members:
            return False
        out = out if out is not None else AdmitReport()
        if self._fresh_key(grid, members, rnd, out):
            self.rotations.append({"round": rnd, "epoch": self.epoch, "reason": reason, "members": len(self.holders)})
            log(INFO, "provisioning: rotated to key epoch %d before round %d (%s)", self.epoch, rnd, reason)
            return True
        return False

    def _fresh_key(self, grid: Any, members: list[int], rnd: int, out: AdmitReport) -> bool:
        for dealer in members:  # the lowest node id makes the key; the next one if it fails
            if self._distribute(grid, dealer, members, [self.epoch + 1], True, rnd, out):
                return True
        return False

    def _distribute(self, grid: Any, dealer: int, members: list[int], epochs: list[int], fresh: bool,
                    rnd: int, out: AdmitReport) -> bool:
        everyone = sorted({dealer, *members})
        req = ConfigRecord({
            "epoch": epochs[-1], "fresh": int(fresh), "preset": self.preset, "effective-round": rnd,
            **self._member_fields(everyone), "epochs": epochs,
        })
        msg = Message(RecordDict({messages.KEYGEN: req}), dst_node_id=dealer, message_type=KEYGEN)
        reply = self._exchange(grid, "keygen", [msg], out).get(dealer)
        if reply is None:
            return False
        try:
            made = messages.parse_keygen_reply(reply, [str(n) for n in everyone], epochs[-1])
            pub, epoch, _ = verify_public_context(made.signed_public_context, self.members[dealer].pub.sign_public)
            if epoch != epochs[-1]:
                raise ProvisioningError("public context of another epoch")
            key_id = load_public_context(pub).key_id  # refuses a secret context before parsing it
            if key_id != made.key_id or (not fresh and (epoch != self.epoch or key_id != self.key_id)):
                raise ProvisioningError("the key made is not the one asked for")
            bundles = {n: self._split(made.bundles[str(n)], epochs) for n in members if n != dealer}
        except (messages.BadReply, ProvisioningError, CryptoError, ValueError) as err:
            self._refuse(out, dealer, "keygen", f"bad keygen reply: {messages.safe_reason(err)}")
            return False
        if fresh:  # only now, with every part of the reply checked
            self._set_key(pub, epoch, {"party": "node", "node": dealer, "epoch": epoch})
            self.holders = {dealer}
        self._provision(grid, dealer, bundles, made.signed_public_context, everyone, out)
        return True

    def _member_fields(self, nodes: list[int]) -> dict[str, list]:
        """The member list of a keygen / provision request (nodes pin it at their first key)."""
        return {"members": [str(n) for n in nodes], "names": [self.members[n].name for n in nodes],
                "partitions": [self.members[n].partition for n in nodes],
                "kx": [self.members[n].pub.kx_public for n in nodes],
                "sign": [self.members[n].pub.sign_public for n in nodes]}

    @staticmethod
    def _split(pack: bytes, epochs: list[int]) -> dict[str, bytes]:
        """One node's bundles by epoch ("e<k>"); exactly the epochs asked for."""
        out = {f"e{WrappedKeyBundle.from_bytes(b).epoch}": b for b in protocol.unpack_blobs(pack)}
        if sorted(out) != sorted(f"e{e}" for e in epochs):
            raise ProvisioningError("bundles of other epochs than asked")
        return out

    def _provision(self, grid: Any, dealer: int, bundles: dict[int, dict[str, bytes]], signed_public: bytes,
                   everyone: list[int], out: AdmitReport) -> None:
        d = self.members[dealer]
        listed = self._member_fields(everyone)
        msgs = []
        for n, by_epoch in bundles.items():
            content = RecordDict({
                PROVISION_REQUEST: ConfigRecord({"dealer-node": str(dealer), "dealer-name": d.name,
                                             "dealer-sign": d.pub.sign_public, **listed}),
                BUNDLES: ArrayRecord({k: protocol.bytes_to_array(v) for k, v in by_epoch.items()}),
                PUBLIC_CONTEXT: ArrayRecord({CTX: protocol.bytes_to_array(signed_public)}),
            })
            msgs.append(Message(content, dst_node_id=n, message_type=PROVISION))
        for node, reply in self._exchange(grid, "provision", msgs, out).items():
            try:
                ack = messages.parse_provision_ack(reply)
            except messages.BadReply as err:
                self._refuse(out, node, "provision", f"bad provision reply: {err}")
                continue
            if ack.key_id != self.key_id or ack.epoch != self.epoch:
                self._refuse(out, node, "provision", "node acknowledged another key id/epoch")
                continue
            self.holders.add(node)
            self._rekeyed.add(node)
            self.stats["provisioned"] += 1
