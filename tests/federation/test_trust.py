"""Issue 8's attacks, each written as the attacker would run it, and what stops it.

* hostile server with a decryption oracle (crafted aggregates, accept/reject, error texts);
* issue 20: the same round asked twice (one reply, one tag), and the affine forgery from two
  tags of one node (pads bound to each ciphertext's digest), also as a bisection;
* man in the middle substituting a node's identity keys at enrollment (kits pin them), and a
  hostile server forwarding substituted keys to the key-making node;
* a run config that lowers a node's privacy (node policy);
* a node that leaves: the key rotates and its old keys cannot read later aggregates;
* issue 20.5, a malicious key-holding node: an update beyond its clipping ball (the mean of three
  at norm 30) is refused by every node and the round discarded; a crafted header is refused by
  the server; a run whose aggregates every node keeps refusing stops with a clear status.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from crypto import CkksAggregator, NodeKeys, load_context
from crypto.binding import MANIFEST_MAGIC
from crypto.errors import ContextMismatchError
from federation import contribution, key_service, messages, protocol
from federation.codec import CkksClientCodec
from federation.deploy.provisioning import write_kits
from tests.federation.fakes import Federation, timeout_fault

HE = {"he": True, "dp-mode": "distributed", "noise-multiplier": 0.05}


def drops(rec, phase: str) -> dict[int, str]:
    return {d["node"]: d["reason"] for d in rec.dropped if d["phase"] == phase}


# --- a hostile server bisecting on accept/reject -----------------------------------------------


def _ask(fed: Federation, node: int, rnd: int, aggregate: bytes, manifest: bytes) -> tuple[bool, str]:
    """Send one evaluate message whose newest aggregate is the server's choice; (accepted, text)."""
    history = list(fed.strategy.history[:-1]) + [(aggregate, manifest)]
    fed.strategy.known_version[node] = rnd - 1
    saved, fed.strategy.history = fed.strategy.history, history
    try:
        (msg,) = fed.strategy.configure(protocol.EVALUATE, rnd, [node])
    finally:
        fed.strategy.history = saved
    reply = fed.grid.deliver(msg)
    return (not reply.has_error()), (reply.error.reason if reply.has_error() else "")


def test_a_hostile_server_learns_nothing_from_64_crafted_aggregates() -> None:
    """Li-Micciancio needs answers that depend on decryption noise. The server here scales an
    update by k (noise x k crosses the rounding margin at some k: a bisection on k measures the
    noise), adds its own encryptions, or drops a summand while keeping the manifest. Every one is
    refused before decryption by the aggregate MAC, with one text that carries no number."""
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    for node in (100, 101, 102):  # the nodes stay at v0: each query below is a fresh v1 for them
        fed.grid.faults[(node, protocol.EVALUATE)] = timeout_fault
    fed.run_all()
    honest, manifest = fed.strategy.history[-1]
    updates = [m for m in fed.grid.received if m.metadata.message_type == protocol.TRAIN]
    from crypto import SignedUpdate

    payloads = [SignedUpdate.from_bytes(protocol.array_to_bytes(m.content[protocol.UPDATE]["update"])).payload
                for m in updates]
    public = load_context(fed.keys.public_context)

    answers = []
    lo, hi = 1, 2**40
    for q in range(64):
        agg = CkksAggregator(public, fed.strategy.packing, expected_values=fed.dim)
        kind = q % 3
        if kind == 0:  # bisection on the scale factor of one update (+ the others once)
            k = (lo + hi) // 2
            for _ in range(min(k, 30)):
                agg.add(payloads[0])
            agg.add(payloads[1])
        elif kind == 1:  # the honest summands plus a server-made "noise" ciphertext
            for p in payloads:
                agg.add(p)
            agg.add_noise(1e-3 * (q + 1), shares=1)
        else:  # a subset of the summands under the full manifest
            agg.add(payloads[0])
            agg.add(payloads[2])
        accepted, text = _ask(fed, 100 + q % 3, 1, agg.result(), manifest)
        answers.append((accepted, text))
        if kind == 0:  # the attacker bisects on whatever it sees
            lo, hi = (lo, (lo + hi) // 2) if accepted else ((lo + hi) // 2, hi)
    assert {a for a in answers} == {(False, answers[0][1])}, "the answers must not vary with the query"
    assert "aggregate rejected" in answers[0][1]
    assert _ask(fed, 100, 1, honest, manifest) == (True, "")  # control: the honest sum is applied
    for _, text in answers:
        reason = text.split(":", 1)[1] if ":" in text else text
        assert not re.search(r"\d", reason), text


def test_decode_failure_texts_carry_no_numbers() -> None:
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.grid.faults[(101, protocol.EVALUATE)] = timeout_fault
    fed.run_all()
    honest, manifest = fed.strategy.history[-1]
    flipped = bytearray(honest)
    flipped[len(flipped) // 2] ^= 0x10
    cases = [bytes(flipped), honest[:-7], b"", b"\x00" * 64]
    bad_manifests = [manifest[:-1], MANIFEST_MAGIC + b"\xff" * 40, b"", b"FKM\x01" + manifest[4:]]
    texts = [_ask(fed, 101, 1, c, manifest)[1] for c in cases]
    texts += [_ask(fed, 101, 1, honest, m)[1] for m in bad_manifests]
    assert all(t.endswith("aggregate rejected") for t in texts), texts
    assert len(set(texts)) == 1 and not re.search(r"\d", texts[0].split(":", 1)[-1])


# --- issue 20: a tag cannot be re-used ----------------------------------------------------------
# A tag is t = <r, c> + pad. Before issue 20 the pad depended on (run, round, epoch, node, kind)
# only, and a node asked twice in one round tagged twice under one pad: with tags t1 of c1 and t2
# of c2, t2 + k(t1 - t2) tagged H + k(c1 - c2) for every k, and the node's accept/reject became a
# decryption oracle again.


def _signed_reply(fed: Federation, node: int, message_type: str):
    """The signed update in node ``node``'s first reply of ``message_type`` the server received."""
    from crypto import SignedUpdate

    for m in fed.grid.received:
        if m.metadata.message_type == message_type and not m.has_error():
            su = SignedUpdate.from_bytes(protocol.array_to_bytes(m.content[protocol.UPDATE]["update"]))
            if su.node_id == str(node):
                return m, su
    raise AssertionError(f"no {message_type} reply of node {node}")


def _tags_of(fed: Federation, node: int, rnd: int, kind: int, replies: list[Message]) -> set[bytes]:
    from crypto import SignedUpdate

    out = set()
    for m in replies:
        if m.has_error() or protocol.UPDATE not in m.content.array_records:
            continue
        su = SignedUpdate.from_bytes(protocol.array_to_bytes(m.content[protocol.UPDATE]["update"]))
        if su.node_id == str(node) and su.round == rnd and su.kind == kind:
            out.add(su.tag)
    return out


def _same_reply_or_refusal(first: Message, again: Message) -> None:
    if again.has_error():
        assert "answered" in again.error.reason, again.error.reason
        return
    a = protocol.array_to_bytes(first.content[protocol.UPDATE]["update"])
    b = protocol.array_to_bytes(again.content[protocol.UPDATE]["update"])
    assert a == b, "a repeated request must get the byte-identical signed reply"
    if protocol.METRICS in first.content.metric_records:
        assert dict(first.content[protocol.METRICS]) == dict(again.content[protocol.METRICS])


def test_a_train_message_sent_twice_gets_its_first_reply_again_never_a_second_tag() -> None:
    from crypto import CONTRIBUTION_UPDATE

    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.run_all()
    first, _ = _signed_reply(fed, 100, protocol.TRAIN)
    replies = [first]
    for _ in range(2):  # the server asks node 100 again for round 1's update
        (msg,) = fed.strategy.configure(protocol.TRAIN, 1, [100])
        again = fed.grid.deliver(msg)
        _same_reply_or_refusal(first, again)
        replies.append(again)
    assert len(_tags_of(fed, 100, 1, CONTRIBUTION_UPDATE, replies)) == 1


def test_a_noise_request_sent_twice_gets_its_first_reply_again_never_a_second_tag() -> None:
    from crypto import CONTRIBUTION_NOISE

    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.grid.faults[(102, protocol.TRAIN)] = timeout_fault  # a survivor makes node 102's noise share
    (rec,) = fed.run_all()
    assert rec.noise_shares_added == 1
    first = next(m for m in fed.grid.received if m.metadata.message_type == protocol.NOISE)
    from crypto import SignedUpdate

    node = int(SignedUpdate.from_bytes(protocol.array_to_bytes(first.content[protocol.UPDATE]["update"])).node_id)
    replies = [first]
    for shares in (1, 1, 2):  # the same request, then one asking for more shares of the same round
        msg = Message(RecordDict({protocol.CONFIG: ConfigRecord(
            {"server-round": 1, "shares": shares, "num-sampled": 3})}), dst_node_id=node, message_type=protocol.NOISE)
        again = fed.grid.deliver(msg)
        _same_reply_or_refusal(first, again)
        replies.append(again)
    assert len(_tags_of(fed, node, 1, CONTRIBUTION_NOISE, replies)) == 1


def test_a_node_that_failed_before_replying_answers_the_retry_once(monkeypatch) -> None:
    """A node that crashed before its reply was kept sent no tag: the retry is answered (once),
    and a further repeat gets that answer again."""
    from crypto import CONTRIBUTION_UPDATE
    from federation import node_host

    real_save, failed = node_host.save_node, []

    def crash_once(context, node):
        if int(context.node_id) == 100 and not failed:
            failed.append(True)
            raise OSError("disk full")
        return real_save(context, node)

    monkeypatch.setattr(node_host, "save_node", crash_once)
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    (rec,) = fed.run_all()
    assert failed and "disk full" in drops(rec, "train")[100]
    replies = []
    for _ in range(2):
        (msg,) = fed.strategy.configure(protocol.TRAIN, 1, [100])
        replies.append(fed.grid.deliver(msg))
    assert not replies[0].has_error()
    _same_reply_or_refusal(replies[0], replies[1])
    assert len(_tags_of(fed, 100, 1, CONTRIBUTION_UPDATE, replies)) == 1


def _two_tags_of_node_100(fed: Federation):
    """Node 100's round-1 update (c2, t2) and a second update (c1, t1) it tagged in round 1, as a
    second train request made it do before issue 20 (made here through the node's own tagging
    code, so the MAC is tested on its own, whatever the replay guard does)."""
    from crypto import CONTRIBUTION_UPDATE, SignedUpdate
    from federation.config import RunConfig

    _, honest_su = _signed_reply(fed, 100, protocol.TRAIN)
    ctx = fed.grid.contexts[100]
    cfg = RunConfig.from_run_config(ctx.run_config)
    node_ctx, epoch = key_service.secret_context(ctx)
    u = np.zeros(fed.dim) if fed.strategy.packing.dither else None
    vec = np.random.default_rng().uniform(-0.01, 0.01, fed.dim)
    payload = CkksClientCodec(fed.dim, node_ctx, fed.strategy.packing).encode(vec, 1.0, dither=u)
    sender = contribution.sender_for(ctx, epoch, node_ctx)
    second = SignedUpdate.from_bytes(contribution.tag_and_sign(cfg, sender, 1, payload, CONTRIBUTION_UPDATE, fed.dim))
    assert second.tag != honest_su.tag
    return second, honest_su


def _affine(fed: Federation, aggregate: bytes, c1: bytes, c2: bytes, k: int) -> bytes:
    """H + k(c1 - c2): what a server computes from public ciphertexts (double and add)."""
    import dataclasses

    import tenseal.sealapi as sealapi

    from crypto.header_check import parse_for as _parse_for
    from crypto.seal_ops import SealOps as _SealOps
    from crypto.slot_plan import SlotPlan as _Plan
    from crypto.seal_io import seal_save
    from crypto.wire import pack_envelope

    public = load_context(fed.keys.public_context)
    packing = fed.strategy.packing
    plan = _Plan(public.params, packing)
    ops = _SealOps(public)

    def load(blob: bytes):
        env = _parse_for(public, packing, plan, blob)
        return env, ops.load_checked(env.ciphertexts, plan.scale)

    env, h = load(aggregate)
    (_, x), (_, y) = load(c1), load(c2)
    out = []
    for acc, xi, yi in zip(h, x, y):
        base = sealapi.Ciphertext()
        ops.evaluator.sub(xi, yi, base)
        n = k
        while n:
            if n & 1:
                ops.evaluator.add_inplace(acc, base)
            n >>= 1
            if n:
                twice = sealapi.Ciphertext()
                ops.evaluator.add(base, base, twice)
                base = twice
        out.append(seal_save(acc))
    return pack_envelope(dataclasses.replace(env, ciphertexts=tuple(out)))


def _affine_tag(t1: bytes, t2: bytes, k: int, q: int) -> bytes:
    """t2 + k(t1 - t2) mod q, word by word."""
    words = []
    for w in range(len(t1) // 8):
        a, b = (int.from_bytes(t[8 * w : 8 * w + 8], "big") for t in (t1, t2))
        words.append(((b + k * (a - b)) % q).to_bytes(8, "big"))
    return b"".join(words)


def _with_entry(manifest: bytes, node: str, tag: bytes, digest: bytes | None = None) -> bytes:
    """The manifest with node's update entry carrying ``tag`` (and ``digest`` when given)."""
    import dataclasses

    from crypto import CONTRIBUTION_UPDATE, Manifest

    m = Manifest.from_bytes(manifest)
    change = {"tag": tag, **({"digest": digest} if digest is not None else {})}
    entries = tuple(dataclasses.replace(e, **change) if (e.node_id, e.kind) == (node, CONTRIBUTION_UPDATE) else e
                    for e in m.entries)
    return dataclasses.replace(m, entries=entries).to_bytes()


def _entries_carry_digests() -> bool:
    import dataclasses

    from crypto import ManifestEntry

    return "digest" in {f.name for f in dataclasses.fields(ManifestEntry)}


def _forgery_setup():
    from crypto import last_modulus

    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    for node in (100, 101, 102):  # the nodes stay at v0: each query below is a fresh v1 for them
        fed.grid.faults[(node, protocol.EVALUATE)] = timeout_fault
    fed.run_all()
    honest, manifest = fed.strategy.history[-1]
    second, first = _two_tags_of_node_100(fed)
    q = last_modulus(load_context(fed.keys.public_context))
    return fed, honest, manifest, second, first, q


def test_the_affine_forgery_from_two_tags_of_one_node_is_refused() -> None:
    """Issue 20's forgery: two tags of node 100 in round 1 make t2 + k(t1 - t2) a valid tag of
    H + k(c1 - c2) when the pad does not depend on the ciphertext. With pads bound to each
    summand's digest it is refused, under either of the two digests, for every k."""
    import random

    fed, honest, manifest, second, first, q = _forgery_setup()
    ks = [2, 3, 2**8, 2**48, random.SystemRandom().randrange(4, q)]
    answers = {}
    for i, k in enumerate(ks):
        aggregate = _affine(fed, honest, second.payload, first.payload, k)
        tag = _affine_tag(second.tag, first.tag, k, q)
        variants = [None] + ([first.digest, second.digest] if _entries_carry_digests() else [])
        for digest in variants:
            forged = _with_entry(manifest, "100", tag, digest)
            answers[(k, digest)] = _ask(fed, 100 + i % 3, 1, aggregate, forged)
    assert all(a == (False, answers[(ks[0], None)][1]) for a in answers.values()), answers
    assert answers[(ks[0], None)][1].endswith(protocol.AGGREGATE_REJECTED)
    assert _ask(fed, 101, 1, honest, manifest) == (True, "")  # control: the honest sum is applied


def test_a_server_bisecting_on_affine_forgeries_gets_one_answer_for_64_queries() -> None:
    """The oracle issue 20 observed (refused at k = 104, accepted at k = 103): bisect on k over
    affine forgeries; every one of 64 answers is the same refusal, so nothing is learned."""
    fed, honest, manifest, second, first, q = _forgery_setup()
    lo, hi = 1, 2**48
    answers = []
    for n in range(64):
        k = (lo + hi) // 2
        aggregate = _affine(fed, honest, second.payload, first.payload, k)
        forged = _with_entry(manifest, "100", _affine_tag(second.tag, first.tag, k, q))
        accepted, text = _ask(fed, 100 + n % 3, 1, aggregate, forged)
        answers.append((accepted, text))
        lo, hi = (k, hi) if accepted else (lo, k)  # accepted below the noise threshold, refused above
    assert set(answers) == {(False, answers[0][1])}, "the answers must not vary with the query"
    assert answers[0][1].endswith(protocol.AGGREGATE_REJECTED)
    assert not re.search(r"\d", answers[0][1].split(":", 1)[-1])


# --- man in the middle at enrollment; kits pin identity keys -------------------------------------


def kit_federation(tmp_path, n: int = 3, **overrides) -> Federation:
    kits = write_kits(tmp_path / "kits", n)
    fed = Federation(n, **HE, **{"server-kit": str(kits["server"]), **overrides})
    for i, ctx in enumerate(sorted(fed.grid.contexts)):
        fed.grid.contexts[ctx].node_config["kit-dir"] = str(kits[f"node-{i}"])
    return fed


def test_with_kits_the_provisioner_made_the_key_and_nothing_is_keyed_over_the_wire(tmp_path) -> None:
    fed = kit_federation(tmp_path, **{"num-server-rounds": 2})
    recs = fed.run_all()
    assert [r.num_clients for r in recs] == [3, 3]
    assert fed.keys.key_origin["party"] == "provisioner" and fed.keys.stats["enrollment"] == "pinned"
    types = {m.metadata.message_type for m in fed.grid.sent}
    assert key_service.KEYGEN not in types and key_service.PROVISION not in types


def test_substituted_enroll_keys_are_refused_and_nothing_is_wrapped_for_the_attacker(tmp_path) -> None:
    fed = kit_federation(tmp_path, **{"num-server-rounds": 1})
    attacker = NodeKeys.generate("102")

    def mitm(msg: Message, ctx):
        reply = fed.grid.deliver(msg)
        rec = reply.content.config_records[messages.NODE_KEYS]
        rec["kx-public"], rec["sign-public"] = attacker.public.kx_public, attacker.public.sign_public
        return reply

    fed.grid.faults[(102, key_service.ENROLL)] = mitm
    (rec,) = fed.run_all()
    assert "PeerKeyError" in drops(rec, "enroll")[102] or "differ from the ones pinned" in drops(rec, "enroll")[102]
    assert rec.num_clients == 2 and 102 not in fed.keys.members
    assert attacker.public.sign_public not in {m.pub.sign_public for m in fed.keys.members.values()}


def test_a_hostile_server_cannot_get_a_key_wrapped_for_a_substituted_peer(tmp_path) -> None:
    fed = kit_federation(tmp_path, **{"num-server-rounds": 1})
    fed.run_all()
    attacker = NodeKeys.generate("102")
    members = sorted(fed.keys.members)
    names = [fed.keys.members[n].name for n in members]
    kx = [fed.keys.members[n].pub.kx_public for n in members]
    sign = [fed.keys.members[n].pub.sign_public for n in members]
    kx[-1], sign[-1] = attacker.public.kx_public, attacker.public.sign_public  # "node-2" is now the attacker
    req = ConfigRecord({"epoch": 1, "fresh": 1, "preset": "fedkv-4096", "effective-round": 2,
                        "members": [str(n) for n in members], "names": names, "kx": kx, "sign": sign,
                        "epochs": [1]})
    msg = Message(RecordDict({messages.KEYGEN: req}), dst_node_id=100, message_type=key_service.KEYGEN)
    reply = fed.grid.deliver(msg)
    assert reply.has_error() and "does not hold the keys pinned" in reply.error.reason
    store = key_service.NodeStore.for_context(fed.grid.contexts[100])
    assert store.epochs() == [0]  # no key of epoch 1 was made, so none was wrapped


# --- a run config cannot lower a node's policy ---------------------------------------------------


@pytest.mark.parametrize(
    ("node_config", "run", "reason"),
    [
        ({"require-he": "true"}, {"he": False, "dp-mode": "none"}, "node policy requires he=true"),
        ({"min-noise-multiplier": 0.5}, {**HE, "noise-multiplier": 0.1}, "noise-multiplier >= 0.5"),
        ({"min-noise-multiplier": 0.5}, {"he": True, "dp-mode": "none"}, "requires client DP noise"),
    ],
)
def test_a_node_refuses_a_run_below_its_policy(node_config, run, reason) -> None:
    fed = Federation(3, **run, **{"num-server-rounds": 1})
    fed.grid.contexts[102].node_config.update(node_config)
    (rec,) = fed.run_all()
    assert reason in drops(rec, "enroll")[102]
    assert rec.num_clients == 2 and not any(
        m.metadata.dst_node_id == 102 and m.metadata.message_type == protocol.TRAIN for m in fed.grid.sent)


def test_a_node_policy_floor_on_min_clients_refuses_the_run_early() -> None:
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.grid.contexts[100].node_config["min-clients"] = 3
    (rec,) = fed.run_all()
    assert "node policy requires min-clients >= 3" in drops(rec, "enroll")[100]


def test_a_node_will_not_decrypt_a_sum_of_fewer_updates_than_min_clients() -> None:
    """A hostile server sends one node's update alone, correctly tagged (the MAC holds): the
    receiving node refuses because the manifest names fewer updates than the floor."""
    from crypto import Manifest, SignedUpdate

    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.grid.faults[(101, protocol.EVALUATE)] = timeout_fault
    fed.run_all()
    first = next(m for m in fed.grid.received if m.metadata.message_type == protocol.TRAIN)
    su = SignedUpdate.from_bytes(protocol.array_to_bytes(first.content[protocol.UPDATE]["update"]))
    agg = CkksAggregator(load_context(fed.keys.public_context), fed.strategy.packing, expected_values=fed.dim)
    agg.add(su.payload)
    _, manifest = fed.strategy.history[-1]
    m = Manifest.from_bytes(manifest)
    alone = Manifest(m.run_id, m.round, m.epoch, tuple(e for e in m.entries if e.node_id == su.node_id))
    assert _ask(fed, 101, 1, agg.result(), alone.to_bytes())[1].endswith("aggregate rejected")


# --- rotation: a node that leaves cannot read later aggregates -------------------------------------


def test_after_a_node_leaves_the_key_rotates_and_its_keys_cannot_decrypt_later_aggregates() -> None:
    fed = Federation(3, **HE, **{"num-server-rounds": 3})
    r1 = fed.round(1)
    old = {e: key_service.NodeStore.for_context(fed.grid.contexts[102]).context(e) for e in (0,)}
    for kind in (protocol.TRAIN, protocol.EVALUATE, key_service.PROVISION, key_service.KEYGEN, protocol.NOISE):
        fed.grid.faults[(102, kind)] = timeout_fault  # node 102 is gone (killed)
    r2 = fed.round(2)
    r3 = fed.round(3)
    assert not r1.key_rotated and r2.departed == [102] and r3.key_rotated and r3.key_epoch == 1
    assert fed.keys.rotations[0]["reason"].startswith("node(s) [102] left")
    assert r3.num_clients == 2 and 102 not in fed.keys.holders
    packing = fed.strategy.packing
    late_aggregate = fed.strategy.history[2][0]
    with pytest.raises(Exception, match="ContextMismatchError"):
        CkksClientCodec(fed.dim, old[0], packing).decode_mean(late_aggregate)
    with pytest.raises(ContextMismatchError):
        from crypto import AggregateDecryptor

        AggregateDecryptor(old[0], packing).decrypt(late_aggregate)
    # the nodes that stayed decrypt it, and agree
    from federation import node_host

    p0 = node_host.stored_params(fed.grid.contexts[100])
    p1 = node_host.stored_params(fed.grid.contexts[101])
    np.testing.assert_array_equal(p0, p1)


def test_rotate_every_k_rounds() -> None:
    fed = Federation(3, **HE, **{"num-server-rounds": 3, "rotate-every": 1})
    recs = fed.run_all()
    assert [r.key_epoch for r in recs] == [0, 1, 2] and len(fed.keys.rotations) == 2
    assert all(r.num_clients == 3 for r in recs)


# --- one node's bad contribution cannot stop the run ---------------------------------------------


def test_a_ciphertext_mutated_in_transit_is_caught_before_it_is_added() -> None:
    from tests.federation.fakes import tamper_fault

    fed = Federation(3, **HE, **{"num-server-rounds": 1})

    def flip(blob: bytes) -> bytes:  # a bit in the ciphertext, well inside the signed payload
        b = bytearray(blob)
        b[len(b) // 2] ^= 0x01
        return bytes(b)

    fed.grid.faults[(101, protocol.TRAIN)] = tamper_fault(fed.grid, flip)
    (rec,) = fed.run_all()
    assert "signature" in drops(rec, "train")[101] and rec.num_clients == 2
    assert rec.eval_clients == 3 and not rec.aggregate_discarded  # the aggregate is sound


def test_a_key_holder_that_signs_an_untagged_ciphertext_costs_one_round_not_the_run() -> None:
    """Node 102 signs a valid ciphertext that is not the one it tagged: the server cannot tell
    (it has no MAC key), every node refuses the sum, the round is discarded and the run goes on."""
    from tests.federation.fakes import payload_fault

    fed = Federation(3, **HE, **{"num-server-rounds": 3})
    def swap(payload: bytes, msg, ctx) -> bytes:
        node_ctx = key_service.secret_context(ctx)[0]
        u = np.zeros(fed.dim) if fed.strategy.packing.dither else None  # dp-mode distributed: dithered
        return CkksClientCodec(fed.dim, node_ctx, fed.strategy.packing).encode(np.zeros(fed.dim), 1.0, dither=u)

    fed.grid.faults[(102, protocol.TRAIN)] = payload_fault(fed.grid, swap)
    r1 = fed.round(1)
    del fed.grid.faults[(102, protocol.TRAIN)]
    r2, r3 = fed.round(2), fed.round(3)
    assert r1.aggregate_discarded and r1.eval_clients == 0 and len(fed.strategy.history) == 2
    assert not r2.aggregate_discarded and r2.eval_clients == 3 and r3.num_clients == 3
    assert r1.departed == []  # refusing a bad sum is not leaving


def test_in_simulation_a_peer_key_change_after_first_use_is_refused() -> None:
    """TOFU: the first keys a node sees for a peer are pinned; a later substitution is refused."""
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.run_all()
    attacker = NodeKeys.generate("102")
    members = sorted(fed.keys.members)
    kx = [fed.keys.members[n].pub.kx_public for n in members]
    sign = [fed.keys.members[n].pub.sign_public for n in members]
    kx[-1], sign[-1] = attacker.public.kx_public, attacker.public.sign_public
    req = ConfigRecord({"epoch": 1, "fresh": 1, "preset": "fedkv-4096", "effective-round": 2,
                        "members": [str(n) for n in members], "names": [""] * 3, "partitions": [0, 1, 2],
                        "kx": kx, "sign": sign, "epochs": [1]})
    msg = Message(RecordDict({messages.KEYGEN: req}), dst_node_id=100, message_type=key_service.KEYGEN)
    reply = fed.grid.deliver(msg)
    assert reply.has_error() and "other keys than on first use" in reply.error.reason


# --- issue 20: simulation's trust on first use is bounded by the member set pinned at first use ---


def _keygen(fed: Federation, members: list[tuple[int, NodeKeys | None, int]], *, fresh: bool,
            epochs: list[int]) -> RecordDict:
    """A keygen request for ``members`` as (node id, keys or None = the enrolled ones, partition)."""
    pubs = [keys.public if keys is not None else fed.keys.members[n].pub for n, keys, _ in members]
    return RecordDict({messages.KEYGEN: ConfigRecord({
        "epoch": epochs[-1], "fresh": int(fresh), "preset": fed.keys.preset, "effective-round": 3,
        "members": [str(n) for n, _, _ in members], "names": [""] * len(members),
        "partitions": [p for _, _, p in members],
        "kx": [p.kx_public for p in pubs], "sign": [p.sign_public for p in pubs], "epochs": epochs})})


def test_in_simulation_a_member_invented_after_the_first_key_is_refused() -> None:
    """Issue 20: in round 3 the server asks a node to re-wrap the current key for the members
    plus an invented member holding the server's own keys. It used to be trusted on first use
    (any round), so the node wrapped the CKKS key for the server. Now every node pinned the
    member set (node ids, partition ids, num-partitions) when it first took a key: a member
    outside it is refused, whether it claims a pinned partition, one beyond num-partitions or
    replaces a pinned member."""
    fed = Federation(3, **HE, **{"num-server-rounds": 2})
    fed.run_all()
    attacker = NodeKeys.generate("999")
    epochs = list(range(fed.keys.epoch + 1))
    honest = [(100, None, 0), (101, None, 1), (102, None, 2)]
    cases = {
        "an extra member in a free-looking partition": honest + [(999, attacker, 3)],
        "an extra member in a pinned partition": honest + [(999, attacker, 1)],
        "a member substituted for node 102": honest[:2] + [(999, attacker, 2)],
    }
    for target in (100, 101):  # the node that made the key, and one that only ever received it
        cases["the invented member alone"] = [(target, None, target - 100), (999, attacker, 2)]
        for what, members in cases.items():
            msg = Message(_keygen(fed, members, fresh=False, epochs=epochs), dst_node_id=target,
                          message_type=key_service.KEYGEN)
            reply = fed.grid.deliver(msg)
            assert reply.has_error(), f"node {target} wrapped the key for {what}"
            assert reply.error.reason.startswith("MemberSetError: "), reply.error.reason
            assert "999" in reply.error.reason or "num-partitions=3" in reply.error.reason, reply.error.reason
    # a damaged pins.json is named, not a bare JSONDecodeError (and nothing is wrapped)
    pins = key_service.NodeStore.for_context(fed.grid.contexts[101]).root / "pins.json"
    pins.write_bytes(pins.read_bytes()[:20])
    msg = Message(_keygen(fed, honest, fresh=False, epochs=epochs), dst_node_id=101, message_type=key_service.KEYGEN)
    reply = fed.grid.deliver(msg)
    assert reply.has_error() and f"{pins}: " in reply.error.reason, reply.error.reason


def test_in_simulation_a_key_from_an_invented_key_maker_is_refused() -> None:
    """The other direction: the server makes a CKKS key itself (an invented node 999) and
    provisions it to node 101, which would then encrypt its updates under the server's key.
    It used to pin 999 on first use; now 999 is not in the member set 101 pinned."""
    fed = Federation(3, **HE, **{"num-server-rounds": 2})
    fed.run_all()
    attacker = NodeKeys.generate("999")
    epoch = fed.keys.epoch + 1
    dealer = attacker.dealer(fed.keys.preset, epoch=epoch, effective_round=3)
    dealer.enroll(fed.keys.members[101].pub)
    bundle = dealer.wrap_for("101").to_bytes()
    own = fed.keys.members[101].pub
    for members in ([(999, attacker.public, 2), (101, own, 1)], [(999, attacker.public, 3), (101, own, 1)]):
        content = RecordDict({
            messages.PROVISION_REQUEST: ConfigRecord({
                "dealer-node": "999", "dealer-name": "", "dealer-sign": attacker.public.sign_public,
                "members": [str(n) for n, _, _ in members], "names": [""] * len(members),
                "partitions": [p for _, _, p in members], "kx": [k.kx_public for _, k, _ in members],
                "sign": [k.sign_public for _, k, _ in members]}),
            messages.BUNDLES: ArrayRecord({f"e{epoch}": protocol.bytes_to_array(bundle)}),
            messages.PUBLIC_CONTEXT: ArrayRecord({"ctx": protocol.bytes_to_array(dealer.signed_public_context())}),
        })
        reply = fed.grid.deliver(Message(content, dst_node_id=101, message_type=key_service.PROVISION))
        assert reply.has_error(), "node 101 took the server's key"
        assert reply.error.reason.startswith("MemberSetError: ") and "999" in reply.error.reason, reply.error.reason
    assert key_service.NodeStore.for_context(fed.grid.contexts[101]).epochs() == [0]


def test_in_simulation_the_first_key_lists_at_most_num_partitions_distinct_partitions() -> None:
    """At the very first key the server may still choose whom to list (stated in docs/threat-model.md),
    but not more members than num-partitions, nor two in one partition; a refused request pins
    nothing, and the honest first key that follows is made as usual."""
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    for n in (100, 101, 102):
        key_service.node_keys(fed.grid.contexts[n], create=True)
    keys = {n: key_service.node_keys(fed.grid.contexts[n]) for n in (100, 101, 102)}
    attacker = NodeKeys.generate("999")
    honest = [(n, keys[n], n - 100) for n in (100, 101, 102)]
    for members in (honest + [(999, attacker, 3)], honest[:2] + [(999, attacker, 1)]):
        msg = Message(_keygen(fed, members, fresh=True, epochs=[0]), dst_node_id=100,
                      message_type=key_service.KEYGEN)
        reply = fed.grid.deliver(msg)
        assert reply.has_error(), "node 100 made a key for more members than partitions"
        assert reply.error.reason.startswith("MemberSetError: ") and "partition" in reply.error.reason, reply.error.reason
    (rec,) = fed.run_all()
    assert rec.num_clients == 3 and fed.keys.key_origin["node"] == 100


def test_in_simulation_a_node_that_left_rejoins_with_its_pinned_identity() -> None:
    """Rotation after a departure shrinks the member set (allowed); the node that left comes
    back under its pinned node id, partition and keys and is keyed again."""
    fed = Federation(3, **HE, **{"num-server-rounds": 4})
    fed.round(1)
    kinds = (protocol.TRAIN, protocol.EVALUATE, key_service.PROVISION, key_service.KEYGEN, protocol.NOISE)
    for kind in kinds:
        fed.grid.faults[(102, kind)] = timeout_fault
    r2, r3 = fed.round(2), fed.round(3)
    assert r2.departed == [102] and r3.key_rotated
    for kind in kinds:
        del fed.grid.faults[(102, kind)]
    r4 = fed.round(4)
    assert 102 in r4.admitted and r4.num_clients == 3 and 102 in fed.keys.holders


# --- issue 20.5: a malicious key-holding node ----------------------------------------------------
# It holds the CKKS key and its own identity keys: whatever it encrypts, it can tag (crypto.binding)
# and sign validly, so the server and the MAC accept it. What bounds the damage: the nodes refuse a
# mean beyond the public bound (crypto.aggregate_bound), the server refuses a header that disagrees
# with the round's public encoding, and a run whose aggregates every node keeps refusing stops.


def crafted_update_fault(grid, make_delta, rounds=None, header=None, envelope=None, tag=None):
    """The node runs its real train handler, then replaces its update with one it made itself, with
    its own key, dither, MAC tag and signature (valid in every way the server and the MAC can see):
    ``make_delta(packing, dim)`` encoded by the node's codec; ``header(w_int, count)`` rewrites the
    encrypted header (weight and contribution count slots); ``envelope(env)`` the public envelope;
    ``tag(tag)`` the tag it signs. Only in ``rounds`` (None: every round)."""
    from crypto import CONTRIBUTION_UPDATE
    from crypto.wire import pack_envelope, parse_envelope
    from federation.codec import packing_for, wire_dim
    from federation.config import RunConfig
    from node.cache_node import model_layout

    def fault(msg: Message, _ctx):
        reply = grid.deliver(msg)
        rnd = int(msg.content[protocol.CONFIG]["server-round"])
        if reply.has_error() or (rounds is not None and rnd not in rounds):
            return reply
        ctx = grid.contexts[msg.metadata.dst_node_id]
        cfg = RunConfig.from_run_config(ctx.run_config)
        dim = wire_dim(cfg, model_layout(cfg.task, cfg.seed).size)
        packing = packing_for(cfg, dim)
        key, epoch = key_service.secret_context(ctx)
        codec = CkksClientCodec(dim, key, packing)
        if header is not None:
            assemble = codec._enc._packer.assemble
            codec._enc._packer.assemble = lambda h, data, n: assemble(header(*h), data, n)
        sender = contribution.sender_for(ctx, epoch, key)
        u = contribution.dither_for(cfg, sender, rnd, CONTRIBUTION_UPDATE, dim)
        payload = codec.encode(np.asarray(make_delta(packing, dim), dtype=np.float64), 1.0, dither=u)
        if envelope is not None:
            payload = pack_envelope(envelope(parse_envelope(payload, max_ciphertext_bytes=1 << 30)))
        blob = contribution.tag_and_sign(cfg, sender, rnd, payload, CONTRIBUTION_UPDATE, dim)
        if tag is not None:
            from crypto import SignedUpdate

            su = SignedUpdate.from_bytes(blob)
            blob = key_service.sign(ctx, key_service.node_keys(ctx), rnd, payload, epoch, key_id=su.key_id,
                                     kind=CONTRIBUTION_UPDATE, tag=tag(su.tag))
        reply.content.array_records[protocol.UPDATE]["update"] = protocol.bytes_to_array(blob)
        return reply

    return fault


def at_range(packing, dim):
    """Every coordinate at +R: inside the encoder's range, a vector of norm R·√d (90 on digits)."""
    return np.full(dim, packing.clip_range)


def _mean_of(fed: Federation, node: int, aggregate: bytes) -> np.ndarray:
    """What node ``node``'s key decrypts ``aggregate`` to (the attack's effect, for the test only)."""
    from crypto import AggregateDecryptor, Manifest
    from crypto.dp.dither import dither_total

    key, _ = key_service.secret_context(fed.grid.contexts[node])
    m = Manifest.from_bytes(fed.strategy.history[-1][1])
    total = dither_total(key.dither_key, m.run_id, m.round, m.epoch, [(e.node_id, e.kind) for e in m.entries],
                         fed.dim)
    return AggregateDecryptor(key, fed.strategy.packing).decrypt(aggregate, dither_total=total).mean


def _count_zero(w_int: float, count: float) -> tuple[float, float]:
    return w_int, 0.0


@pytest.mark.parametrize("attack", ["every coordinate at +R", "contribution count 0"])
def test_a_key_holders_update_that_moves_the_mean_to_30_C_is_refused_by_every_node(attack) -> None:
    """Issue 20.5's attack: node 102 encrypts, tags and signs, with its own keys, an update of norm
    R·√d = 90 (every coordinate at +R, which the encoder's range allows), or a zero update whose
    encrypted contribution count is 0 (the decoder then adds R to every coordinate). The mean of the
    three moves to norm ~30 against clip-norm 1; every node refuses it, with the one digit-free answer."""
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    if attack == "every coordinate at +R":
        fault = crafted_update_fault(fed.grid, at_range)
    else:
        fault = crafted_update_fault(fed.grid, lambda p, d: np.zeros(d), header=_count_zero)
    fed.grid.faults[(102, protocol.TRAIN)] = fault
    for node in (100, 101, 102):  # nobody evaluates in the round: each query below is a fresh v1
        fed.grid.faults[(node, protocol.EVALUATE)] = timeout_fault
    (rec,) = fed.run_all()
    assert rec.num_clients == 3 and not drops(rec, "train")  # the server took it: it cannot tell
    aggregate, manifest = fed.strategy.history[-1]
    assert np.linalg.norm(_mean_of(fed, 100, aggregate)) > 25 * fed.cfg.clip_norm  # the attack works
    answers = {node: _ask(fed, node, 1, aggregate, manifest) for node in (100, 101, 102)}
    assert set(answers.values()) == {(False, answers[100][1])}, answers
    assert answers[100][1].endswith(protocol.AGGREGATE_REJECTED)
    assert not re.search(r"\d", answers[100][1].split(":", 1)[-1])


def test_a_round_with_a_crafted_update_is_discarded_and_the_model_stays_at_the_last_accepted_version() -> None:
    from federation import node_host

    fed = Federation(3, **HE, **{"num-server-rounds": 2})
    r1 = fed.round(1)
    before = {n: node_host.stored_params(fed.grid.contexts[n]) for n in (100, 101, 102)}
    fed.grid.faults[(102, protocol.TRAIN)] = crafted_update_fault(fed.grid, at_range)
    r2 = fed.round(2)
    assert not r1.aggregate_discarded and r2.aggregate_discarded and r2.eval_clients == 0
    assert len(fed.strategy.history) == 1 and r2.departed == []
    assert set(drops(r2, "evaluate")) == {100, 101, 102}
    assert all(reason.endswith(protocol.AGGREGATE_REJECTED) for reason in drops(r2, "evaluate").values())
    for n, params in before.items():  # every node is still at v1, its weights untouched
        np.testing.assert_array_equal(node_host.stored_params(fed.grid.contexts[n]), params)


@pytest.mark.parametrize("field", ["layout", "tag"])
def test_a_signed_update_whose_header_disagrees_with_the_round_is_refused_by_the_server(field) -> None:
    """A crafted header, validly tagged and signed. layout: node 100 (added first) declares a layout
    digest, and every later update "was made for another tensor layout": the honest nodes were
    dropped and the run stopped. tag: node 102 signs a tag of three words; the manifest carrying it
    does not parse on any node, so every node refused every aggregate. Now the server refuses the
    summand itself (the reason names the field), adds the others, and the nodes accept the sum."""
    import dataclasses

    if field == "layout":
        node, kwargs = 100, {"envelope": lambda env: dataclasses.replace(env, layout_fp=b"\x01" * 8)}
    else:
        node, kwargs = 102, {"tag": lambda t: t + b"\x00" * 8}
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    fed.grid.faults[(node, protocol.TRAIN)] = crafted_update_fault(fed.grid, lambda p, d: np.zeros(d), **kwargs)
    (rec,) = fed.run_all()
    assert list(drops(rec, "train")) == [node] and field in drops(rec, "train")[node]
    assert rec.num_clients == 2 and not rec.aggregate_discarded and rec.eval_clients == 3
    assert len(fed.strategy.history) == 1


def _run_with_crafted(rounds_attacked, num_rounds: int, **overrides):
    from federation.local import InProcessGrid, run_local
    from tests.federation.fakes import BASE_CONFIG

    run_config = {**BASE_CONFIG, **HE, "num-server-rounds": num_rounds, **overrides}
    grid = InProcessGrid(3, run_config)
    grid.faults[(102, protocol.TRAIN)] = crafted_update_fault(grid, at_range, rounds=rounds_attacked)
    return grid, run_local(run_config, 3, grid=grid)


def test_a_node_whose_every_update_is_refused_stops_the_run_after_k_rounds_with_a_clear_status() -> None:
    """The run does not spin: after max-rejected-rounds (default 3) rounds in a row whose aggregate
    every node refused, it stops with a status that says so; the model never moved."""
    from federation import node_host

    grid, results = _run_with_crafted(None, 6)
    assert results.status.startswith("stopped: 3 rounds in a row had their aggregate refused by every node"), \
        results.status
    assert [r.aggregate_discarded for r in results.rounds] == [True] * 3
    assert all(node_host.peek_node(grid.contexts[n]).version == 0 for n in grid.node_ids)


@pytest.mark.parametrize("engine", ["supernode", "simulation"])
def test_refused_aggregates_are_discarded_in_the_error_text_flower_writes(monkeypatch, engine) -> None:
    """Flower does not pass a ClientApp's exception text on as it is: a SuperNode writes
    ``<class '...AggregateRejected'>:<'aggregate rejected'>`` and the simulation engine wraps it in
    a ClientAppException first (flwr 1.42 ``run_clientapp.py``, ``vce_api.py``, ``ray_actor.py``).
    The strategy read only the in-process form, so in a real run a refused round was never
    discarded: nodes were counted as departed and the run went on with a model nobody took."""
    from flwr.clientapp.client_app import ClientAppException

    from federation.local import InProcessGrid

    def flower_reason(ex: Exception) -> str:
        if engine == "simulation":
            ex = ClientAppException(str(ex))
        return str(type(ex)) + ":<'" + str(ex) + "'>"  # flwr's own expression

    monkeypatch.setattr(InProcessGrid, "error_reason", staticmethod(flower_reason))
    _, results = _run_with_crafted({1}, 2)
    assert results.status == "completed"
    assert [r.aggregate_discarded for r in results.rounds] == [True, False]
    assert results.rounds[0].departed in (None, [])


def test_one_refused_round_then_honest_rounds_completes() -> None:
    _, results = _run_with_crafted({1}, 3)
    assert results.status == "completed"
    assert [r.aggregate_discarded for r in results.rounds] == [True, False, False]
    assert [r.eval_clients for r in results.rounds] == [0, 3, 3]


def test_max_rejected_rounds_sets_how_many_refused_rounds_in_a_row_stop_the_run() -> None:
    _, results = _run_with_crafted(None, 4, **{"max-rejected-rounds": 1})
    assert results.status.startswith("stopped: 1 round in a row had their aggregate refused by every node (rounds 1;")
    assert len(results.rounds) == 1


# --- issue 30: the key-making node checks the CKKS preset against its own he-security ---------


@pytest.mark.parametrize("classical", ["fedkv-4096", "fedkv-2048"])
def test_a_post_quantum_node_refuses_to_make_a_classical_key(classical) -> None:
    """The server names the preset in its keygen request; a node under he-security
    post-quantum used to build whatever it named (a downgrade to a ring only the classical
    column calls 128-bit). Now it refuses, and makes no key. (The 8192 rings lie within the
    post-quantum column: log q 120 and 140 <= 202.)"""
    fed = Federation(3, **HE, **{"num-server-rounds": 1, "he-security": "post-quantum"})
    for n in (100, 101, 102):
        key_service.node_keys(fed.grid.contexts[n], create=True)
    keys = {n: key_service.node_keys(fed.grid.contexts[n]) for n in (100, 101, 102)}
    req = _keygen(fed, [(n, keys[n], n - 100) for n in (100, 101, 102)], fresh=True, epochs=[0])
    req.config_records[messages.KEYGEN]["preset"] = classical
    reply = fed.grid.deliver(Message(req, dst_node_id=100, message_type=key_service.KEYGEN))
    assert reply.has_error(), f"a post-quantum node made a {classical} key"
    assert "post-quantum" in reply.error.reason and classical in reply.error.reason, reply.error.reason
    store = key_service.NodeStore.for_context(fed.grid.contexts[100])
    assert store.held() is None and store.epochs() == [] and not (store.root / "pins.json").exists()


def test_a_post_quantum_node_refuses_a_classical_key_another_member_made() -> None:
    """Provision: node 100 (misconfigured, or the server's accomplice) made a fedkv-4096 key;
    node 101 under he-security post-quantum used to take it and encrypt under it."""
    fed = Federation(3, **HE, **{"num-server-rounds": 1, "he-security": "post-quantum"})
    keys = {n: key_service.node_keys(fed.grid.contexts[n], create=True) for n in (100, 101, 102)}
    dealer = keys[100].dealer("fedkv-4096", epoch=0, effective_round=1)
    dealer.enroll(keys[101].public)
    content = RecordDict({
        messages.PROVISION_REQUEST: ConfigRecord({
            "dealer-node": "100", "dealer-name": "", "dealer-sign": keys[100].public.sign_public,
            "members": ["100", "101", "102"], "names": [""] * 3, "partitions": [0, 1, 2],
            "kx": [keys[n].public.kx_public for n in (100, 101, 102)],
            "sign": [keys[n].public.sign_public for n in (100, 101, 102)]}),
        messages.BUNDLES: ArrayRecord({"e0": protocol.bytes_to_array(dealer.wrap_for("101").to_bytes())}),
        messages.PUBLIC_CONTEXT: ArrayRecord({"ctx": protocol.bytes_to_array(dealer.signed_public_context())}),
    })
    reply = fed.grid.deliver(Message(content, dst_node_id=101, message_type=key_service.PROVISION))
    assert reply.has_error() and reply.error.reason.startswith("DowngradeError: "), reply.error.reason
    assert key_service.NodeStore.for_context(fed.grid.contexts[101]).held() is None


def test_a_node_policy_he_security_floor_refuses_a_classical_run_and_key() -> None:
    """The node's own floor (node config ``he-security=post-quantum``): a run config that says
    classical is refused at enrollment: no node is keyed."""
    fed = Federation(3, **HE, **{"num-server-rounds": 1})
    for ctx in fed.grid.contexts.values():
        ctx.node_config["he-security"] = "post-quantum"
    reply = fed.grid.deliver(Message(RecordDict({messages.ENROLL_REQUEST: ConfigRecord({})}),
                                     dst_node_id=100, message_type=key_service.ENROLL))
    assert reply.has_error() and "he-security" in reply.error.reason, reply.error.reason
    from federation.strategy import NotEnoughClients

    with pytest.raises(NotEnoughClients, match="he-security=post-quantum"):
        fed.run_all()
    assert fed.keys.holders == set() and fed.keys.epoch == -1


# --- issue 30: a node's identity and pinned member set hold across runs on its node dir --------


def _sign_keys(fed: Federation) -> dict[int, bytes]:
    """partition -> the identity (signing) key each node enrolled with."""
    return {m.partition: m.pub.sign_public for m in fed.keys.members.values()}


def test_two_runs_on_one_node_dir_keep_each_nodes_identity_and_pins(tmp_path) -> None:
    """Two ``flwr run`` on one ``$FEDKV_NODE_DIR``: new run id, new node ids. The second run
    used to make every node a new identity and pin its members afresh; now each node (a
    partition of an N-partition federation) reuses its identity and pins, and the run works."""
    d = str(tmp_path / "nodes")
    first = Federation(3, **HE, **{"num-server-rounds": 1}, run_id=1, node_dir=d)
    assert first.run_all()[0].num_clients == 3
    second = Federation(3, **HE, **{"num-server-rounds": 1}, run_id=2, node_dir=d, first_node_id=200)
    assert second.run_all()[0].num_clients == 3
    assert _sign_keys(second) == _sign_keys(first)
    # another federation shape on the same root is another set of nodes: it enrolls its own
    other = Federation(2, **HE, **{"num-server-rounds": 1}, run_id=3, node_dir=d, first_node_id=300)
    assert other.run_all()[0].num_clients == 2
    assert set(_sign_keys(other).values()).isdisjoint(_sign_keys(first).values())


def test_a_new_run_does_not_reopen_trust_on_first_use(tmp_path) -> None:
    """Run 1 pinned the member set; at the first key of run 2 the server lists its own keys for
    partition 2. Pins were per run, so this was a new first use and node 200 made the key for
    the server; now the partition's keys pinned in run 1 hold, and nothing is made."""
    d = str(tmp_path / "nodes")
    Federation(3, **HE, **{"num-server-rounds": 1}, run_id=1, node_dir=d).run_all()
    fed = Federation(3, **HE, **{"num-server-rounds": 1}, run_id=2, node_dir=d, first_node_id=200)
    keys = {n: key_service.node_keys(fed.grid.contexts[n], create=True) for n in (200, 201, 202)}
    attacker = NodeKeys.generate("999")
    for members in ([(200, keys[200], 0), (201, keys[201], 1), (999, attacker, 2)],
                    [(200, keys[200], 0), (201, keys[201], 1), (202, attacker, 2)],
                    [(200, keys[200], 0), (999, keys[201], 2)]):  # a pinned key in another partition
        msg = Message(_keygen(fed, members, fresh=True, epochs=[0]), dst_node_id=200,
                      message_type=key_service.KEYGEN)
        reply = fed.grid.deliver(msg)
        assert reply.has_error(), f"node 200 made a key for {members}"
        assert reply.error.reason.startswith("PeerKeyError: ") and "earlier run" in reply.error.reason, reply.error.reason
    assert key_service.NodeStore.for_context(fed.grid.contexts[200]).held() is None
    assert fed.run_all()[0].num_clients == 3  # the honest first key of run 2 follows


@pytest.mark.parametrize("how", ["env", "node-config"])
def test_re_enroll_is_the_operators_say_and_keeps_the_old_enrollment(tmp_path, monkeypatch, how) -> None:
    """A new enrollment (new identity, pins forgotten) only when the operator sets
    ``re-enroll`` (node config) or ``$FEDKV_RE_ENROLL``; the old one is moved aside, not deleted."""
    root = tmp_path / "nodes"
    first = Federation(3, **HE, **{"num-server-rounds": 1}, run_id=1, node_dir=str(root))
    first.run_all()
    second = Federation(3, **HE, **{"num-server-rounds": 1}, run_id=2, node_dir=str(root), first_node_id=200)
    if how == "env":
        monkeypatch.setenv("FEDKV_RE_ENROLL", "1")
    else:
        for ctx in second.grid.contexts.values():
            ctx.node_config["re-enroll"] = "true"
    assert second.run_all()[0].num_clients == 3
    assert set(_sign_keys(second).values()).isdisjoint(_sign_keys(first).values())
    kept = sorted(p.name for p in (root / "enrolled").iterdir())
    assert len(kept) == 6 and sum(".replaced-" in n for n in kept) == 3, kept


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_real_flwr_runs_on_one_node_dir_reuse_the_enrollment(flwr_cli, tmp_path) -> None:
    """The same through the real CLI: two ``flwr run`` (simulation: new run id, new node ids)
    on one ``$FEDKV_NODE_DIR`` both complete, nobody refused, and the second run's nodes enroll
    with the identities the first one made."""
    root = Path(flwr_cli.env["FEDKV_NODE_DIR"])
    config = {"num-server-rounds": 1, "task": "digits", "he": True, "dp-mode": "distributed",
              "noise-multiplier": 0.01, "results-dir": str(tmp_path / "results")}
    identities = []
    for _ in range(2):
        run = flwr_cli.run(num_supernodes=3, run_config=config)
        assert run.returncode == 0 and run.results_path is not None, run.output[-4000:]
        data = json.loads(run.results_path.read_text())
        assert data["status"] == "completed" and data["provisioning"]["refused"] == 0, data["provisioning"]
        assert data["rounds"][0]["num_clients"] == 3
        identities.append({p.name: (p / "identity.key").read_bytes() for p in (root / "enrolled").iterdir()})
    assert sorted(identities[0]) == ["n3-p0", "n3-p1", "n3-p2"] and identities[1] == identities[0]
    assert len([p for p in root.iterdir() if p.name.startswith("run-")]) == 2
