"""he=true end to end in process: CKKS codec, key provisioning, signed updates, faults.

The server side (strategy, aggregator, every message) must only ever carry ciphertexts and
a public context; nodes get their secret context wrapped by the dealer.
"""

from __future__ import annotations

import math
import os
import types

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from crypto import (
    AggregateDecryptor,
    CkksContext,
    Dealer,
    NodeKeys,
    SignedUpdate,
    UpdateEncryptor,
    ciphertext_info,
    dp_clip_range,
    load_context,
    make_secret_context,
    saturation_budget,
    sign_update,
)
from crypto.binding import MANIFEST_MAGIC, Manifest
from crypto.dp.dither import dither_total
from crypto.seal_io import seal_save
from crypto.errors import SecretKeyPresentError
from federation import client_app, node_host, protocol, key_service
from federation.codec import CkksAggregatorCodec, CkksClientCodec, CodecError, make_aggregator, packing_for
from federation.config import RunConfig
from federation.key_service import KeyService
from federation.node_store import NodeStore
from federation.strategy import NotEnoughClients, OpaqueFedAvg
from tests.federation.fakes import (
    BASE_CONFIG, Federation, make_context, payload_fault, raise_fault, set_server_identity,
)

HE = {"he": True}


def he_federation(num_nodes: int = 3, **overrides) -> Federation:
    return Federation(num_nodes, **{**HE, **overrides})


def drops(rec, phase: str = "train") -> dict[int, str]:
    return {d["node"]: d["reason"] for d in rec.dropped if d["phase"] == phase}


# --- codec ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["packed", "none"])
def test_ckks_codec_weighted_mean_equals_plain_fedavg(mode) -> None:
    cfg = RunConfig.from_run_config({**BASE_CONFIG, **HE, "packing": mode, "max-weight": 500.0})
    dim = 5000
    packing = packing_for(cfg, dim)
    secret = make_secret_context()
    client = CkksClientCodec(dim, secret, packing)
    agg = make_aggregator(True, dim, packing, secret.public_bytes())
    rng = np.random.default_rng(0)
    vecs = [rng.normal(0, cfg.clip_norm / math.sqrt(dim), dim) for _ in range(4)]
    weights = [120.0, 500.0, 33.0, 260.0]
    for v, w in zip(vecs, weights):
        agg.add(client.encode(v, w))
    assert agg.count == 4
    got = client.decode_mean(agg.result())
    want = sum(w * v for v, w in zip(vecs, weights)) / sum(weights)
    bound = packing.mean_error_bound(sum(weights) / packing.max_weight, 4)
    assert np.max(np.abs(got - want)) <= bound + 1e-6
    rms = cfg.clip_norm / math.sqrt(dim)  # of a clipped update's coordinate
    if mode == "packed":  # worst case < 1/4 of a coordinate's RMS; typical error ~5 % of it
        assert bound < 0.25 * rms and np.sqrt(np.mean((got - want) ** 2)) < 0.1 * rms
    else:
        assert np.max(np.abs(got - want)) < 1e-6 * rms


def test_derived_packing_is_public_and_identical_everywhere() -> None:
    cfg = RunConfig.from_run_config({**BASE_CONFIG, **HE, "dp-mode": "distributed", "min-clients": 2})
    a, b = packing_for(cfg, 4810), packing_for(RunConfig.from_run_config(cfg.as_dict()), 4810)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a.max_weight == 1.0  # equal weights under DP
    sigma_share = cfg.noise_multiplier * cfg.clip_norm / math.sqrt(2)
    # under DP: the smallest range whose saturation bound fits the budget (crypto.dp.saturation)
    want = dp_clip_range(cfg.clip_norm, sigma_share, 4810, cfg.max_clients, cfg.num_server_rounds,
                         saturation_budget(cfg.target_delta))
    assert want <= a.clip_range <= want * (1 + 1e-5)
    none = packing_for(RunConfig.from_run_config({**BASE_CONFIG, **HE, "max-weight": 300.0}), 4810)
    assert none.max_weight == 300.0 and none.clip_range == pytest.approx(12 / math.sqrt(4810), rel=1e-5)
    fixed = packing_for(RunConfig.from_run_config({**BASE_CONFIG, **HE, "packing-range": 0.5}), 4810)
    assert fixed.clip_range == 0.5


def test_crypto_errors_become_codec_rejections_and_leave_the_sum_alone() -> None:
    cfg = RunConfig.from_run_config({**BASE_CONFIG, **HE, "max-weight": 1.0})
    dim = 300
    packing = packing_for(cfg, dim)
    secret, other = make_secret_context(), make_secret_context()
    agg = make_aggregator(True, dim, packing, secret.public_bytes())
    mine = CkksClientCodec(dim, secret, packing)
    agg.add(mine.encode(np.full(dim, 0.01), 1.0))
    bad = {
        "NotACiphertextError": os.urandom(33000),
        "ContextMismatchError": CkksClientCodec(dim, other, packing).encode(np.zeros(dim), 1.0),
        "PackingMismatchError": UpdateEncryptor(secret).encrypt(np.zeros(dim), 1.0),
        "LayoutMismatchError": CkksClientCodec(dim + 1, secret, packing).encode(np.zeros(dim + 1), 1.0),
    }
    for name, blob in bad.items():
        with pytest.raises(CodecError, match=name):
            agg.add(blob)
    assert agg.count == 1
    np.testing.assert_allclose(mine.decode_mean(agg.result()), 0.01, atol=packing.step)
    with pytest.raises(CodecError, match="WeightRangeError"):
        mine.encode(np.zeros(dim), 2.0)  # above max_weight
    with pytest.raises(CodecError, match="shape"):
        mine.encode(np.zeros(dim + 1), 1.0)
    with pytest.raises(CodecError):
        mine.decode_mean(b"garbage")


def test_server_side_refuses_a_secret_context() -> None:
    cfg = RunConfig.from_run_config({**BASE_CONFIG, **HE})
    secret = make_secret_context()
    with pytest.raises(CodecError, match="secret key"):
        make_aggregator(True, 100, packing_for(cfg, 100), secret.secret_bytes())
    # a key-making node that hands the server its secret context: refused before parsing
    keys = KeyService(cfg, run_id=1)
    with pytest.raises(SecretKeyPresentError):
        keys._set_key(secret.secret_bytes(), 0, {"party": "node"})
    assert keys.public_context is None and keys.epoch == -1


# --- the server only ever handles public material -------------------------------------------


def _walk(obj, seen=None, depth=0):
    """Every object reachable through attributes / containers (not through modules/classes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 12:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, (str, bytes, bytearray, int, float, bool, type(None), np.ndarray, type, types.ModuleType)):
        return
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not callable(obj):
        children = list(vars(obj).values())
    else:
        children = []
    for child in children:
        yield from _walk(child, seen, depth + 1)


def _message_blobs(msg: Message) -> list[bytes]:
    out = []
    if msg.has_error():
        return out
    for rec in msg.content.config_records.values():
        out += [bytes(v) for v in rec.values() if isinstance(v, bytes)]
    for rec in msg.content.array_records.values():
        out += [protocol.array_to_bytes(a) for a in rec.values() if a.dtype == "uint8"]
    return out


def test_server_only_ever_handles_ciphertexts_and_a_public_context() -> None:
    fed = he_federation(3, **{"dp-mode": "distributed", "num-server-rounds": 2})
    recs = fed.run_all()
    assert [r.num_clients for r in recs] == [3, 3]
    secret = node_secret(fed, 100)
    secret_key = seal_save(secret.secret_key())
    probes = [secret_key] + [secret_key[i : i + 64] for i in range(0, len(secret_key) - 64, len(secret_key) // 16)]

    # 1) the strategy and key-service object graph: public context only, no node keys, no decryptor
    agg = fed.strategy.make_aggregator()
    for obj in _walk([fed.strategy, fed.keys, agg]):
        assert not isinstance(obj, (Dealer, NodeKeys, CkksClientCodec)), type(obj)
        assert type(obj).__name__ not in ("Decryptor", "SecretKey"), type(obj)
        if isinstance(obj, CkksContext):
            assert not obj.is_private
        if isinstance(obj, (bytes, bytearray)) and len(obj) >= 64:
            assert not any(p in obj for p in probes)
    assert not load_context(fed.keys.public_context).is_private
    assert isinstance(agg, CkksAggregatorCodec) and not agg.context.is_private

    # 2) every message the grid carried, both directions: every byte string is classified
    kinds = {"update": 0, "aggregate": 0, "manifest": 0, "context": 0, "bundle": 0, "key/id": 0}
    for msg in fed.grid.sent + fed.grid.received:
        for blob in _message_blobs(msg):
            assert not any(p in blob for p in probes), msg.metadata.message_type
            if len(blob) <= 32:
                kinds["key/id"] += 1  # public keys (32 B), key id (16 B)
            elif blob[:4] == b"FKP\x01":  # node-signed public context
                pub = key_service.verify_public_context(blob, fed.keys.members[100].pub.sign_public)[0]
                assert not load_context(pub).is_private
                kinds["context"] += 1
            elif blob[:4] == b"FKB\x01" or blob[4:8] == b"FKB\x01":  # a bundle, or a pack of them
                kinds["bundle"] += 1  # AES-GCM-wrapped for one node, signed by the key-making node
            elif blob[:4] == b"FKS\x02":
                info = ciphertext_info(SignedUpdate.from_bytes(blob).payload)
                assert info["kind"] == "update" and info["n_values"] == fed.dim
                kinds["update"] += 1
            elif blob[:4] == MANIFEST_MAGIC:
                kinds["manifest"] += 1
            else:
                assert ciphertext_info(blob)["kind"] == "aggregate"
                kinds["aggregate"] += 1
    assert all(ciphertext_info(a)["kind"] == "aggregate" for a, _ in fed.strategy.history)
    # updates: 3 nodes x 2 rounds; aggregates (each with its manifest) sent: v1 and v2 to 3
    # evaluators (trainers of round 2 already confirmed v1); bundles: node 100 wraps for 3
    # members (itself included) and the server relays 2; public context: 1 from node 100 + 2 relayed;
    # keys: 3 x (2 public keys + key id) at enroll, 3 x dealer key sent at provision... see below
    assert kinds["update"] == 6 and kinds["aggregate"] == 6 and kinds["manifest"] == 6
    assert kinds["bundle"] == 3 + 2 and kinds["context"] == 3
    # no node secret lives in context.state (in simulation it sits in the ServerApp's process)
    for ctx in fed.grid.contexts.values():
        stored = b"".join(bytes(v) for rec in ctx.state.config_records.values()
                          for v in rec.values() if isinstance(v, bytes))
        stored += b"".join(protocol.array_to_bytes(a) for rec in ctx.state.array_records.values()
                           for a in rec.values() if a.dtype == "uint8")
        assert secret_key not in stored and b"PRIVATE KEY" not in stored
        # nor the decrypted global model: context.state holds public scalars only
        assert not ctx.state.array_records


def node_secret(fed: Federation, node_id: int) -> CkksContext:
    """A node's secret context, read from its node-local files (the test plays that node)."""
    return key_service.secret_context(fed.grid.contexts[node_id])[0]


def test_he_round_aggregate_equals_plain_fedavg_of_the_same_updates(monkeypatch) -> None:
    """What the nodes write back = the plaintext weighted FedAvg of what they encrypted."""
    sent: list[tuple[np.ndarray, float]] = []
    real_encode = CkksClientCodec.encode

    def spy(self, vec, weight, noise=None, carry=None, dither=None):
        assert carry is None or not np.any(carry)  # error feedback: nothing to carry in round 1
        sent.append((np.asarray(vec, dtype=np.float64).copy(), float(weight)))
        return real_encode(self, vec, weight, noise, carry, dither)

    monkeypatch.setattr(CkksClientCodec, "encode", spy)
    fed = he_federation(3, **{"num-server-rounds": 1, "max-weight": 500.0})
    before = _flat_params(fed, 100, fresh=True)
    (rec,) = fed.run_all()
    assert rec.num_clients == 3 and len(sent) == 3
    weights = np.array([w for _, w in sent])
    assert all(w <= 500 for w in weights) and rec.weight_capped == sum(w == 500 for w in weights)
    want = sum(w * v for v, w in sent) / weights.sum()
    got = _flat_params(fed, 100) - before
    bound = fed.strategy.packing.mean_error_bound(weights.sum() / 500.0, 3)
    assert np.max(np.abs(got - want)) <= bound + 1e-6
    assert rec.clipped_fraction == 1.0  # he=true clips to clip-norm even with dp-mode none
    assert all(np.linalg.norm(v) <= 1.0 + 1e-6 for v, _ in sent)
    for n in (101, 102):  # every node wrote back the same aggregate
        np.testing.assert_array_equal(_flat_params(fed, n), _flat_params(fed, 100))


def _flat_params(fed: Federation, node_id: int, fresh: bool = False) -> np.ndarray:
    if fresh:
        from crypto import flatten
        from node.cache_node import build_model

        return flatten(build_model("digits", 42).state_dict())[0].astype(np.float64)
    return node_host.stored_params(fed.grid.contexts[node_id]).astype(np.float64)


def test_he_learns_like_plaintext_with_the_same_clipping() -> None:
    """Same clipping, no noise: the CKKS codec's quantisation changes accuracy by < 0.5 points."""
    common = {"num-server-rounds": 4, "dp-mode": "local", "noise-multiplier": 0.0}
    plain = Federation(3, **common).run_all()
    he = he_federation(3, **common).run_all()
    assert abs(plain[-1].eval_metric - he[-1].eval_metric) < 0.005
    assert he[-1].eval_loss == pytest.approx(plain[-1].eval_loss, rel=0.02)
    assert he[-1].saturated_fraction is None or math.isnan(he[-1].saturated_fraction)  # private under DP
    assert he[0].upload_bytes_mean < plain[0].upload_bytes_mean * 2  # 4810 values: one ciphertext


# --- faults --------------------------------------------------------------------------------------


def _resign(fed: Federation, signer: int, node_id: str | None = None, keys: NodeKeys | None = None,
            round_shift: int = 0):
    """A fault for node 100: its real update, re-signed by ``signer``'s keys (or ``keys`` as
    ``node_id``) for its round + ``round_shift``."""

    def fault(msg: Message, ctx):
        reply = fed.grid.deliver(msg)
        rec = reply.content.array_records[protocol.UPDATE]
        su = SignedUpdate.from_bytes(protocol.array_to_bytes(rec["update"]))
        if keys is not None:
            blob = sign_update(keys, node_id, su.round + round_shift, su.payload, su.epoch, run_id=su.run_id,
                               key_id=su.key_id, kind=su.kind, tag=su.tag)
        else:
            c = fed.grid.contexts[signer]
            blob = key_service.sign(c, key_service.node_keys(c), su.round + round_shift, su.payload, su.epoch,
                                     key_id=su.key_id, kind=su.kind, tag=su.tag)
        rec["update"] = protocol.bytes_to_array(blob)
        return reply

    return fault


def _unsigned(fed: Federation):
    def fault(msg: Message, ctx):
        reply = fed.grid.deliver(msg)
        rec = reply.content.array_records[protocol.UPDATE]
        rec["update"] = protocol.bytes_to_array(SignedUpdate.from_bytes(protocol.array_to_bytes(rec["update"])).payload)
        return reply

    return fault


def _foreign_ciphertext(fed: Federation):
    """Right shape and packing, validly signed by node 100, but under another dealer's key."""
    foreign = CkksClientCodec(fed.dim, make_secret_context(), fed.strategy.packing)
    u = np.zeros(fed.dim) if fed.strategy.packing.dither else None  # dp-mode distributed: dithered
    return payload_fault(fed.grid, lambda p, m, c: foreign.encode(np.zeros(fed.dim), 1.0, dither=u))


FAULTS = {
    "random bytes": (lambda fed: payload_fault(fed.grid, lambda p, m, c: os.urandom(len(p))),
                     "update rejected: CodecError: NotACiphertextError"),
    "ciphertext of another context": (_foreign_ciphertext, "(header field key_id)"),
    "unsigned": (_unsigned, "signature check failed: SignatureError: not a signed fedkv update"),
    "forged signature": (lambda fed: _resign(fed, 0, "100", NodeKeys.generate("100")),
                         "signature check failed: SignatureError: signature of the update from '100' does not verify"),
    "future round": (lambda fed: _resign(fed, 100, round_shift=1),
                     "signature check failed: ReplayError: out-of-order (future) update for round"),
    "another node's signed update": (lambda fed: _resign(fed, 101),
                                     "signature check failed: SignatureError: update signed by node 101 arrived from node 100"),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_bad_update_is_left_out_and_round_completes(name, caplog) -> None:
    make_fault, reason = FAULTS[name]
    fed = he_federation(3, **{"dp-mode": "distributed"})
    fed.grid.faults[(100, protocol.TRAIN)] = make_fault(fed)
    with caplog.at_level("WARNING", logger="flwr"):
        recs = fed.run_all()
    assert [r.num_clients for r in recs] == [2, 2]
    for rec in recs:
        assert set(drops(rec)) == {100} and reason in drops(rec)[100], drops(rec)
        assert set(rec.upload_bytes) == {"101", "102"}
        assert rec.noise_shares_added == 1  # distributed: a survivor made node 100's share
        assert rec.eval_clients == 3  # node 100 still decrypts the aggregate and evaluates
    # node 100 dropped each round: the key rotated before round 2 and node 100 was re-keyed
    assert recs[1].key_rotated and recs[1].key_epoch == 1 and recs[0].departed == [100]
    assert any("leaving out node 100" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_update_from_a_node_the_verifier_does_not_know_is_left_out() -> None:
    fed = he_federation(3, **{"num-server-rounds": 2})
    fed.round(1)
    fed.keys.verifier.remove_node("100")  # e.g. its enrollment was revoked
    rec = fed.round(2)
    assert "UnknownNodeError: update from unknown node '100'" in drops(rec)[100]
    assert rec.num_clients == 2


def test_replayed_previous_round_update_is_left_out() -> None:
    fed = he_federation(3, **{"num-server-rounds": 3})
    captured: dict[int, object] = {}

    def replay(msg: Message, ctx):
        reply = fed.grid.deliver(msg)
        rnd = int(msg.content[protocol.CONFIG]["server-round"])
        rec = reply.content.array_records[protocol.UPDATE]
        if rnd == 1:
            captured[1] = rec["update"]
        else:
            rec["update"] = captured[1]  # node 100's own, validly signed, round-1 update
        return reply

    fed.grid.faults[(100, protocol.TRAIN)] = replay
    recs = fed.run_all()
    assert [r.num_clients for r in recs] == [3, 2, 2]
    assert "ReplayError: replayed/late update for round 1 from '100'; current round is 2" in drops(recs[1])[100]
    # node 100 was dropped in round 2, so the key rotated: in round 3 the replay is also stale
    assert "StaleKeyError: update signed under key epoch 0, current epoch is 1" in drops(recs[2])[100]


def test_distributed_top_up_noise_is_added_under_encryption(monkeypatch) -> None:
    """A dropped client's noise share is added by the server: contributions = sampled, and
    the extra noise has the share's standard deviation σC/√n."""
    sent: list[np.ndarray] = []
    real_encode = CkksClientCodec.encode

    def spy(self, vec, weight, noise=None, **kwargs):
        sent.append(np.asarray(vec, dtype=np.float64).copy())
        return real_encode(self, vec, weight, noise, **kwargs)

    monkeypatch.setattr(CkksClientCodec, "encode", spy)
    fed = he_federation(3, **{"dp-mode": "distributed", "num-server-rounds": 1, "noise-multiplier": 1.0,
                              "clip-norm": 0.5})
    fed.grid.faults[(101, protocol.TRAIN)] = raise_fault
    (rec,) = fed.run_all()
    assert rec.sampled == 3 and rec.num_clients == 2 and rec.noise_shares_added == 1
    secret = node_secret(fed, 100)
    dec = AggregateDecryptor(secret, fed.strategy.packing)
    aggregate, manifest = fed.strategy.history[0]
    m = Manifest.from_bytes(manifest)
    assert fed.strategy.packing.dither  # distributed DP: rounding independent of the data
    total = dither_total(secret.dither_key, m.run_id, m.round, m.epoch, [(e.node_id, e.kind) for e in m.entries],
                         fed.dim)
    result = dec.decrypt(aggregate, dither_total=total)
    # two updates + one noise share (made by a survivor, weight 0): three contributions
    assert result.n_updates == 3 and result.contributions == 3 and result.weight_sum == pytest.approx(2.0)
    trained = [v for v in sent if np.any(v)]
    server_noise = result.mean * 2 - (trained[0] + trained[1])
    share = 1.0 * 0.5 / math.sqrt(3)
    assert np.std(server_noise) == pytest.approx(share, rel=0.1)
    assert abs(np.mean(server_noise)) < 0.05 * share
    assert rec.epsilon_client < math.inf


def test_a_survivor_making_two_shares_sends_them_as_two_contributions(monkeypatch) -> None:
    """3 of 5 sampled nodes drop: the 2 survivors make 2 + 1 shares, each reply encoded as that
    many contributions (range ±m·R); the aggregate decodes to the updates plus 3 shares' noise."""
    calls: list[tuple[int, int]] = []
    sent: list[np.ndarray] = []
    real_encode = CkksClientCodec.encode

    def spy(self, vec, weight, noise=None, carry=None, dither=None, contributions=1):
        sent.append(np.asarray(vec, dtype=np.float64).copy())
        blob = real_encode(self, vec, weight, noise, carry, dither, contributions)
        calls.append((contributions, self.saturated))
        return blob

    monkeypatch.setattr(CkksClientCodec, "encode", spy)
    fed = he_federation(5, **{"dp-mode": "distributed", "num-server-rounds": 1, "noise-multiplier": 1.0,
                              "clip-norm": 0.5})
    for node in (102, 103, 104):
        fed.grid.faults[(node, protocol.TRAIN)] = raise_fault
    (rec,) = fed.run_all()
    assert rec.num_clients == 2 and rec.noise_shares_added == 3
    assert sorted(m for m, _ in calls) == [1, 1, 1, 2] and all(sat == 0 for _, sat in calls)
    secret = node_secret(fed, 100)
    aggregate, manifest = fed.strategy.history[0]
    m = Manifest.from_bytes(manifest)
    total = dither_total(secret.dither_key, m.run_id, m.round, m.epoch, [(e.node_id, e.kind) for e in m.entries],
                         fed.dim)
    result = AggregateDecryptor(secret, fed.strategy.packing).decrypt(aggregate, dither_total=total)
    assert result.n_updates == 4 and result.contributions == 5 and result.weight_sum == pytest.approx(2.0)
    trained = [v for v in sent if np.any(v)]
    noise = result.mean * 2 - (trained[0] + trained[1])
    assert np.std(noise) == pytest.approx(0.5 / math.sqrt(5) * math.sqrt(3), rel=0.1)  # 3 shares of σC/√5


def test_a_noise_reply_carrying_other_than_the_shares_asked_is_left_out(monkeypatch) -> None:
    real_encode = CkksClientCodec.encode

    def one_contribution(self, vec, weight, noise=None, carry=None, dither=None, contributions=1):
        return real_encode(self, vec, weight, noise, carry, dither)  # the old single-contribution encoding

    monkeypatch.setattr(CkksClientCodec, "encode", one_contribution)
    fed = he_federation(5, **{"dp-mode": "distributed", "num-server-rounds": 1, "noise-multiplier": 1.0})
    for node in (102, 103, 104):
        fed.grid.faults[(node, protocol.TRAIN)] = raise_fault
    (rec,) = fed.run_all()
    assert rec.num_clients == 2 and rec.noise_shares_added == 1  # the survivor asked for 1 share is kept
    (reason,) = drops(rec, "noise").values()
    assert "noise reply carries 1 share(s), 2 were asked" in reason


def test_a_client_update_declaring_several_contributions_is_left_out(monkeypatch) -> None:
    """A hostile node's update that claims to stand for 3 contributions (to eat the headroom, or
    to shift the decoder's offsets) is refused; the honest nodes' round goes on."""
    real_encode = CkksClientCodec.encode
    hostile = []

    def inflate(self, vec, weight, noise=None, carry=None, dither=None, contributions=1):
        if not hostile:
            hostile.append(True)
            return real_encode(self, vec, 0.0, noise, carry, dither, contributions=3)
        return real_encode(self, vec, weight, noise, carry, dither, contributions)

    monkeypatch.setattr(CkksClientCodec, "encode", inflate)
    fed = he_federation(3, **{"num-server-rounds": 1})
    (rec,) = fed.run_all()
    assert rec.num_clients == 2
    (reason,) = drops(rec, "train").values()
    assert "train reply carries 3 share(s), 1 were asked" in reason


def test_fewer_than_min_clients_after_faults_stops_clearly() -> None:
    fed = he_federation(3, **{"min-clients": 3})
    fed.grid.faults[(100, protocol.TRAIN)] = payload_fault(fed.grid, lambda p, m, c: os.urandom(100))
    with pytest.raises(NotEnoughClients, match="2 usable update\\(s\\) < min-clients=3"):
        fed.run_all()


def test_client_level_epsilon_is_accounted_per_round() -> None:
    fed = he_federation(4, **{"dp-mode": "distributed", "num-server-rounds": 3, "fraction-train": 0.5,
                              "noise-multiplier": 1.2})
    recs = fed.run_all()
    from federation.client_accounting import ClientAccountant

    from federation.client_accounting import GaussianAccountant

    acct = ClientAccountant("fixed", 4, 1e-5)  # the default sampler: 2 of 4 without replacement
    node = GaussianAccountant(4, 1e-5, "fixed")
    for rec in recs:
        assert rec.sampled == 2 and rec.population == 4
        acct.step(1.2, 2)
        assert rec.epsilon_client == pytest.approx(acct.epsilon())
        assert rec.epsilon_server == pytest.approx(acct.epsilon_no_amplification())
        # a curious node knows its own share: the other one's, σ·sqrt(1/2), is left; two
        # colluding nodes are both of the round's sampled nodes and know all of its noise
        node.step(1.2 * math.sqrt(1 / 2))
        assert rec.epsilon_node == pytest.approx(node.epsilon()) and rec.epsilon_node > rec.epsilon_server
        assert rec.epsilon_colluding == math.inf and rec.colluding_nodes == 2
        assert rec.rounding_share_steps > 0 and 0 <= rec.rounding_delta <= 1
        assert 0 < rec.saturation_delta == fed.strategy.saturation_delta <= saturation_budget(1e-5)
        assert rec.delta_total == pytest.approx(1e-5 + (1 + math.exp(rec.epsilon_client)) * rec.saturation_delta)
    assert math.isnan(recs[0].epsilon_sample)


# --- provisioning ---------------------------------------------------------------------------


def test_provisioning_failure_keeps_the_node_out_of_the_round() -> None:
    fed = he_federation(3, **{"num-server-rounds": 1})
    fed.grid.faults[(101, key_service.PROVISION)] = lambda msg, ctx: None  # times out
    (rec,) = fed.run_all()
    assert "no reply" in drops(rec, "provision")[101]
    assert rec.num_clients == 2 and 101 not in fed.keys.holders


def test_node_keys_and_ckks_keys_live_in_node_files_not_in_context_state() -> None:
    fed = he_federation(3, **{"num-server-rounds": 1})
    fed.run_all()
    for node_id, ctx in fed.grid.contexts.items():
        store = NodeStore.for_context(ctx)
        files = {p.name: p.stat().st_mode & 0o777 for p in store.root.iterdir()}
        assert files["identity.key"] == 0o600 and files["ckks-0.ctx"] == 0o600
        assert key_service.secret_context(ctx)[0].key_id == fed.keys.key_id
        assert not [k for k in ctx.state.config_records if "key" in k or "ckks" in k]


def test_node_that_connects_later_is_enrolled_when_first_seen_and_catches_up() -> None:
    fed = he_federation(3, **{"num-server-rounds": 3})
    late = fed.grid.contexts.pop(102)
    r1 = fed.round(1)
    assert r1.admitted == [100, 101] and r1.num_clients == 2
    fed.grid.contexts[102] = late
    r2 = fed.round(2)
    assert r2.admitted == [102] and r2.num_clients == 3 and r2.eval_clients == 3
    r3 = fed.round(3)
    assert r3.admitted == [] and r3.num_clients == 3
    for n in (100, 101):
        np.testing.assert_array_equal(_flat_params(fed, n), _flat_params(fed, 102))


def test_keyservice_exposes_public_material_only() -> None:
    fed = he_federation(2, **{"num-server-rounds": 1})
    fed.run_all()
    keys = fed.keys
    assert not load_context(keys.public_context).is_private and len(keys.key_id) == 16
    assert keys.key_origin == {"party": "node", "node": 100, "epoch": 0}
    assert "secret" not in repr(keys).lower()
    plain = KeyService(RunConfig.from_run_config(BASE_CONFIG), run_id=1)
    assert plain.public_context is None


def test_he_config_requires_clipping() -> None:
    with pytest.raises(ValueError, match="clip-norm must be > 0"):
        RunConfig.from_run_config({**BASE_CONFIG, **HE, "clip-norm": 0.0})
