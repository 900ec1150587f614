"""Issue 30.5: with he=false a node applied any mean the server sent.

The plaintext aggregate carries its own header (weight sum, update count) and a float32 sum; a
hostile server writes all of it. A node now applies the same public bound to a plaintext mean
that it applies to a decrypted CKKS mean (``crypto.aggregate_bound``, with the plaintext's terms:
no rounding, no CKKS error) and refuses anything beyond it, or non-finite, with the one digit-free
``AggregateRejected``. And the node's policy: ``require-he`` is on wherever a node has a kit
(deployment), on every path (the flower-central array handlers too); without a kit (simulation)
the run config decides.
"""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from federation import node_host, protocol
from federation.codec import MAGIC, PlainAggregator, PlainClientCodec
from federation.node_policy import NodePolicy
from tests.federation.fakes import Federation, timeout_fault
from tests.federation.test_trust import _ask, drops, kit_federation

PLAIN = {"he": False, "dp-mode": "none"}
NODES = (100, 101, 102)
_HEADER = struct.Struct("<4sc3xIdI4x")  # federation.codec's plaintext header, written by hand


def _one_round(**overrides) -> Federation:
    """One he=false round in which nobody evaluates: every node is still at v0, so each query
    below offers it a fresh v1."""
    fed = Federation(3, **{**PLAIN, "num-server-rounds": 1, **overrides})
    for node in NODES:
        fed.grid.faults[(node, protocol.EVALUATE)] = timeout_fault
    fed.run_all()
    return fed


def _aggregate(dim: int, updates: list[np.ndarray], weight: float = 1.0) -> bytes:
    """What a server makes of these updates with the real plaintext aggregator."""
    agg = PlainAggregator(dim)
    for u in updates:
        agg.add(PlainClientCodec(dim).encode(u, weight))
    return agg.result()


def _refused_by_every_node(fed: Federation, aggregate: bytes, manifest: bytes) -> None:
    before = {n: node_host.stored_params(fed.grid.contexts[n]) for n in NODES}
    answers = {n: _ask(fed, n, 1, aggregate, manifest) for n in NODES}
    assert set(answers.values()) == {(False, answers[100][1])}, answers
    assert answers[100][1].endswith(protocol.AGGREGATE_REJECTED), answers
    assert not re.search(r"\d", answers[100][1].split(":", 1)[-1]), answers
    for n, params in before.items():  # nothing was written back
        np.testing.assert_array_equal(node_host.stored_params(fed.grid.contexts[n]), params)
        assert node_host.peek_node(fed.grid.contexts[n]).version == 0


def test_a_hostile_server_pushing_a_mean_of_norm_a_million_is_refused_by_every_node() -> None:
    """The red team's attack: three "updates" of norm 10⁶ summed by the real aggregator (so the
    header is consistent: three updates, weight three), a mean of norm 10⁶ against C = 1."""
    fed = _one_round()
    _, manifest = fed.strategy.history[-1]
    big = np.full(fed.dim, 1e6 / math.sqrt(fed.dim), dtype=np.float32)
    aggregate = _aggregate(fed.dim, [big, big, big])
    assert np.linalg.norm(PlainClientCodec(fed.dim).decode_mean(aggregate)) > 0.99e6  # what it would apply
    _refused_by_every_node(fed, aggregate, manifest)


@pytest.mark.parametrize("weight", [math.nan, 1e-320, 0.5], ids=["NaN weight", "Inf mean", "weight below one"])
def test_a_plaintext_header_that_no_honest_round_has_is_refused_by_every_node(weight) -> None:
    """The server writes the header: a NaN weight sum makes the mean NaN, a subnormal one makes
    it infinite, and a weight sum below the update count (every honest weight is at least one
    example) inflates a small sum. Each gets the one answer, never a write-back."""
    fed = _one_round()
    _, manifest = fed.strategy.history[-1]
    payload = np.full(fed.dim, 1e-3, dtype="<f4").tobytes()
    aggregate = _HEADER.pack(MAGIC, b"A", fed.dim, weight, 3) + payload
    _refused_by_every_node(fed, aggregate, manifest)


def test_a_plaintext_mean_of_fewer_updates_than_min_clients_is_refused() -> None:
    """One node's update passed off as the round's mean (the header says one update)."""
    fed = _one_round()
    _, manifest = fed.strategy.history[-1]
    small = np.full(fed.dim, 1e-3, dtype=np.float32)
    _refused_by_every_node(fed, _aggregate(fed.dim, [small]), manifest)


def test_under_poisson_a_plaintext_count_beyond_the_population_is_refused() -> None:
    """Under Poisson sampling the node rescales the mean by count / (q·N): a header claiming 1,000
    updates of three nodes (weight 1,000, a mean of norm 1, inside B) would be applied ~300 times
    over. No honest round holds more updates than there are partitions. (q = 1: every node is
    drawn, so the honest round 1 is never skipped.)"""
    fed = _one_round(**{"dp-mode": "distributed", "noise-multiplier": 1.0, "client-sampling": "poisson",
                        "fraction-train": 1.0})
    _, manifest = fed.strategy.history[-1]
    unit = np.full(fed.dim, 1000.0 / math.sqrt(fed.dim), dtype="<f4")  # the sum: mean of norm 1
    _refused_by_every_node(fed, _HEADER.pack(MAGIC, b"A", fed.dim, 1000.0, 1000) + unit.tobytes(), manifest)


@pytest.mark.parametrize("overrides", [
    {},
    {"dp-mode": "local", "noise-multiplier": 0.5},
    {"dp-mode": "distributed", "noise-multiplier": 1.0},
])
def test_an_honest_plaintext_mean_is_applied_by_every_node(overrides) -> None:
    """The control: the round's own aggregate passes the bound on every node, and so does a
    server's sum of three updates at exactly C (the mean at C, the edge of the ball)."""
    fed = _one_round(**overrides)
    honest, manifest = fed.strategy.history[-1]
    for n in NODES:
        assert _ask(fed, n, 1, honest, manifest) == (True, "")
    fed = _one_round()
    _, manifest = fed.strategy.history[-1]
    at_c = np.full(fed.dim, fed.cfg.clip_norm / math.sqrt(fed.dim), dtype=np.float32)
    assert _ask(fed, 100, 1, _aggregate(fed.dim, [at_c, at_c, at_c], weight=7.0), manifest) == (True, "")


@pytest.mark.parametrize("overrides", [
    {},
    {"dp-mode": "distributed", "noise-multiplier": 1.0, "client-sampling": "poisson", "fraction-train": 0.8,
     "sampler-seed": 7},
])
def test_honest_plaintext_runs_complete_with_no_round_refused(overrides) -> None:
    """Whole he=false runs, every node training for real (the updates clipped to C): no round
    is refused, every node reaches the last version."""
    fed = Federation(3, **{**PLAIN, "num-server-rounds": 3, **overrides})
    recs = fed.run_all()
    assert [r.aggregate_discarded for r in recs] == [False] * 3
    assert any(not r.sampling_skipped for r in recs)
    assert all(r.eval_clients >= 1 for r in recs if not r.sampling_skipped)


def test_without_dp_a_plaintext_update_is_clipped_to_clip_norm() -> None:
    """The bound needs a clipping ball: with he=false and dp-mode none the node clips its update
    to clip-norm, as it does under HE (before, the plaintext update went out unclipped)."""
    fed = Federation(3, **{**PLAIN, "num-server-rounds": 1, "lr": 5.0, "clip-norm": 0.01})
    (rec,) = fed.run_all()
    assert rec.num_clients == 3 and not rec.aggregate_discarded
    clipped = [m.content["metrics"]["clipped"] for m in fed.grid.received
               if m.metadata.message_type == protocol.TRAIN and not m.has_error()]
    assert clipped and all(clipped)


def test_a_node_whose_plaintext_update_is_beyond_its_ball_costs_the_round_not_the_model() -> None:
    """he=false, an honest server, a node that sends an unclipped update of norm 10⁶ (signed with
    its own key): every node refuses the mean, the round is discarded as under HE, the model
    stays at the last accepted version and the run stops after max-rejected-rounds."""
    from tests.federation.fakes import payload_fault

    fed = Federation(3, **{**PLAIN, "num-server-rounds": 2, "max-rejected-rounds": 1})
    big = np.full(fed.dim, 1e6 / math.sqrt(fed.dim), dtype=np.float32)
    fed.grid.faults[(102, protocol.TRAIN)] = payload_fault(
        fed.grid, lambda _p, _m, _c: PlainClientCodec(fed.dim).encode(big, 1.0))
    rec = fed.round(1)
    assert rec.num_clients == 3 and rec.aggregate_discarded
    assert set(drops(rec, "evaluate")) == set(NODES)
    assert all(r.endswith(protocol.AGGREGATE_REJECTED) for r in drops(rec, "evaluate").values())
    assert fed.strategy.history == [] and all(node_host.peek_node(fed.grid.contexts[n]).version == 0 for n in NODES)


# --- require-he: on in deployment (kits), the run config decides in simulation ------------------


def test_require_he_defaults_on_with_a_kit_and_off_without() -> None:
    """A kit (deployment) requires HE unless its node-policy.json says otherwise, even a policy
    file that omits the key; a node without a kit (simulation) leaves it to the run config; the
    node config can only make it stricter."""
    assert NodePolicy.of({}, {}).require_he
    assert NodePolicy.of({}, {"min-noise-multiplier": 0.5}).require_he
    assert NodePolicy.of({"require-he": "false"}, {}).require_he  # the stricter wins
    assert not NodePolicy.of({}, {"require-he": False}).require_he  # the provisioner's explicit choice
    assert not NodePolicy.of({}).require_he
    assert NodePolicy.of({"require-he": "true"}).require_he


def test_kit_nodes_refuse_a_plaintext_run_from_a_server_without_a_kit(tmp_path) -> None:
    """A server that runs its own ServerApp with he=false against provisioned nodes: every node
    refuses at enrollment, nobody trains."""
    fed = kit_federation(tmp_path, **{"num-server-rounds": 1})
    fed.run_config.update(PLAIN)
    fed.run_config.pop("server-kit")
    for ctx in fed.grid.contexts.values():
        ctx.run_config.update(PLAIN)
        ctx.run_config.pop("server-kit")
    from federation.config import RunConfig
    from federation.run import key_service
    from federation.strategy import OpaqueFedAvg

    fed.cfg = RunConfig.from_run_config(fed.run_config)
    fed.keys = key_service(fed.cfg, fed.grid.run_id, fed.dim)
    fed.strategy = OpaqueFedAvg(fed.cfg, fed.dim, fed.keys, wait_for_nodes_s=0.0)
    with pytest.raises(Exception, match="min-clients"):
        fed.run_all()
    reasons = [m.error.reason for m in fed.grid.received if m.has_error()]
    assert len(reasons) == 3 and all("node policy requires he=true" in r for r in reasons), reasons
    assert not any(m.metadata.message_type == protocol.TRAIN for m in fed.grid.sent)


def test_the_flower_central_handlers_refuse_a_run_below_the_node_policy() -> None:
    """dp-mode flower-central (Flower's array protocol, he=false) sends plaintext weights that the
    node would load as they come: a node whose policy requires HE refuses it too."""
    fed = Federation(1, **{"he": False, "dp-mode": "flower-central", "num-server-rounds": 1})
    ctx = fed.grid.contexts[100]
    ctx.node_config["require-he"] = "true"
    weights = node_host.peek_node(ctx).get_weights()
    for mtype in ("train", "evaluate"):
        content = RecordDict({"arrays": ArrayRecord(weights),
                              "config": ConfigRecord({"server-round": 1, "clipping_norm": 1.0})})
        reply = fed.grid.deliver(Message(content, dst_node_id=100, message_type=mtype))
        assert reply.has_error() and "node policy requires he=true" in reply.error.reason, mtype


@pytest.mark.parametrize(("overrides", "v"), [
    ({}, 0.0),
    ({"dp-mode": "local", "noise-multiplier": 0.5}, 3 * 0.5**2),
    ({"dp-mode": "distributed", "noise-multiplier": 1.0}, 1.0),
])
def test_the_plaintext_bound_is_the_formula_with_no_rounding_term(overrides, v) -> None:
    """B = (C + √v·(√d + √(2 ln 1/β)) / W)·(1 + 2^-20) for three updates at C = 1: v the run's
    noise only (local: three updates' own, distributed: one sum's), nothing for rounding or CKKS."""
    from crypto.aggregate_bound import BETA, PLAIN_RELATIVE_ERROR
    from federation.codec import mean_bound_for
    from federation.config import RunConfig

    cfg = RunConfig.from_run_config({"task": "digits", **PLAIN, **overrides})
    dim = 4810
    bound = mean_bound_for(cfg, dim)
    tail = math.sqrt(v) * (math.sqrt(dim) + math.sqrt(2 * math.log(1 / BETA)))
    expected = (1.0 + tail / 3) * (1 + PLAIN_RELATIVE_ERROR)
    assert bound.radius(3, 3, 3.0) == pytest.approx(expected, rel=1e-12)
    assert bound.rounding_proxy == bound.carry_proxy == bound.ckks_error == 0.0
