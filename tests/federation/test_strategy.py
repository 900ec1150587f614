"""OpaqueFedAvg + the real ClientApp handlers, in process (FakeGrid), incl. fault paths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crypto import NodeKeys, sign_update
from federation import node_host, protocol
from federation.codec import HEADER_BYTES
from federation.strategy import NotEnoughClients
from node.cache_node import build_model, model_layout
from tests.federation.fakes import FakeGrid, Federation, payload_fault, raise_fault, tamper_fault, timeout_fault

DIM = model_layout("digits", 42).size
SIGNED_OVERHEAD = len(sign_update(NodeKeys.generate("100"), "100", 1, b""))
"""Signed-update framing around the codec payload for a 3-digit node id (91 bytes)."""


def make(num_nodes: int = 3, **overrides):
    fed = Federation(num_nodes, **overrides)
    return fed.cfg, fed.grid, fed


def run_all(grid, fed: Federation):
    return fed.run_all()


def node_params(grid: FakeGrid, node_id: int) -> np.ndarray:
    return node_host.stored_params(grid.contexts[node_id])


def test_happy_path_nodes_stay_in_lockstep_and_learn() -> None:
    _, grid, strategy = make(num_nodes=3, **{"num-server-rounds": 3})
    recs = run_all(grid, strategy)
    assert [r.num_clients for r in recs] == [3, 3, 3]
    assert all(r.dropped == [] and r.eval_clients == 3 for r in recs)
    assert recs[-1].eval_loss < recs[0].eval_loss
    assert all(r.upload_bytes_mean == 4 * DIM + HEADER_BYTES + SIGNED_OVERHEAD for r in recs)
    # every node applied the same 3 aggregates -> identical global weights
    params = [node_params(grid, n) for n in grid.contexts]
    for p in params[1:]:
        np.testing.assert_array_equal(params[0], p)
    assert all(int(c.state.config_records[node_host.META_KEY]["version"]) == 3 for c in grid.contexts.values())
    # the ClientApp hosts one object per node, reused across rounds
    assert recs[1].node_sources == {"reused": 6}
    assert len(node_host.RUNTIME.nodes) == 3


def test_node_rebuilt_from_context_state_gives_identical_results() -> None:
    """Simulation moves nodes between Ray actors: state must live in context.state."""
    _, grid_a, strat_a = make(num_nodes=3, **{"num-server-rounds": 3})
    recs_a = run_all(grid_a, strat_a)
    node_host.forget_all()
    _, grid_b, strat_b = make(num_nodes=3, **{"num-server-rounds": 3})
    recs_b = []
    for rnd in range(1, 4):
        node_host.forget_all()  # every round in a "fresh process"
        recs_b.append(strat_b.round(rnd))
    assert recs_b[2].node_sources.get("reused", 0) == 3  # eval right after train, same process
    assert recs_b[2].node_sources["restored"] == 3
    assert [r.eval_loss for r in recs_a] == pytest.approx([r.eval_loss for r in recs_b], rel=1e-6)


def test_client_that_raises_is_left_out() -> None:
    _, grid, strategy = make(num_nodes=3)
    grid.faults[(101, protocol.TRAIN)] = raise_fault
    recs = run_all(grid, strategy)
    assert [r.num_clients for r in recs] == [2, 2]
    reasons = [d for d in recs[0].dropped if d["phase"] == "train"]
    assert reasons == [{"node": 101, "phase": "train", "reason": "client error: ClientAppException: injected failure"}]
    assert 101 not in recs[0].upload_bytes
    # it still evaluates (and catches up on the aggregates it missed)
    assert recs[1].eval_clients == 3


def test_client_that_times_out_is_left_out() -> None:
    _, grid, strategy = make(num_nodes=3)
    grid.faults[(102, protocol.TRAIN)] = timeout_fault
    recs = run_all(grid, strategy)
    assert recs[0].num_clients == 2
    assert "no reply within round-timeout" in recs[0].dropped[0]["reason"]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b, m, c: b"EVIL" + b[4:], "bad magic"),
        (lambda b, m, c: b[: len(b) // 2], "length"),
        (lambda b, m, c: b[:-4] + np.float32(np.nan).tobytes(), "NaN"),
    ],
)
def test_update_rejected_by_aggregator_is_left_out(mutate, reason) -> None:
    """Validly signed by its node, but the payload is not a good update."""
    _, grid, strategy = make(num_nodes=3)
    grid.faults[(100, protocol.TRAIN)] = payload_fault(grid, mutate)
    recs = run_all(grid, strategy)
    assert recs[0].num_clients == 2
    (drop,) = [d for d in recs[0].dropped if d["phase"] == "train"]
    assert drop["node"] == 100 and "update rejected" in drop["reason"] and reason in drop["reason"]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b"EVIL" + b[4:], "SignatureError: not a signed fedkv update"),
        (lambda b: b[:-70] + bytes([b[-70] ^ 1]) + b[-69:], "SignatureError: signature of the update"),
        (lambda b: b[: len(b) // 2], "SignatureError: truncated"),
    ],
)
def test_update_whose_signature_fails_is_left_out(mutate, reason) -> None:
    _, grid, strategy = make(num_nodes=3)
    grid.faults[(100, protocol.TRAIN)] = tamper_fault(grid, mutate)
    recs = run_all(grid, strategy)
    assert [r.num_clients for r in recs] == [2, 2]
    (drop,) = [d for d in recs[0].dropped if d["phase"] == "train"]
    assert drop["node"] == 100 and "signature check failed" in drop["reason"] and reason in drop["reason"]


def test_handler_exception_is_reported_not_raised_and_node_recovers() -> None:
    """A real handler failure (corrupted aggregate for one node) -> error reply; next round OK."""
    _, grid, strategy = make(num_nodes=3, **{"num-server-rounds": 3})
    real = grid.deliver

    def corrupt_aggregates(msg, ctx):
        rec = msg.content.array_records[protocol.AGGREGATES]
        for key in list(rec.keys()):
            rec[key] = protocol.bytes_to_array(b"garbage")
        return real(msg)

    grid.faults[(100, protocol.EVALUATE)] = timeout_fault  # node 100 stays at v0 ...
    strategy.round(1)
    del grid.faults[(100, protocol.EVALUATE)]
    grid.faults[(100, protocol.TRAIN)] = corrupt_aggregates  # ... and gets a garbage v1
    rec2 = strategy.round(2)
    del grid.faults[(100, protocol.TRAIN)]
    (drop,) = rec2.dropped
    # one generic answer, whatever was wrong with the aggregate (no decode detail leaves a node)
    assert rec2.num_clients == 2 and drop["node"] == 100 and drop["reason"].endswith("AggregateRejected: aggregate rejected")
    assert rec2.eval_clients == 3  # its evaluate message resent v1 + v2: caught up
    rec3 = strategy.round(3)
    assert rec3.num_clients == 3 and rec3.dropped == []
    np.testing.assert_array_equal(node_params(grid, 100), node_params(grid, 101))


def test_fewer_than_min_clients_stops_the_run() -> None:
    _, grid, strategy = make(num_nodes=3, **{"min-clients": 3})
    grid.faults[(101, protocol.TRAIN)] = raise_fault
    with pytest.raises(NotEnoughClients, match="min-clients=3"):
        run_all(grid, strategy)


def test_not_enough_connected_nodes_stops_the_run() -> None:
    _, grid, strategy = make(num_nodes=2, **{"min-clients": 3})
    with pytest.raises(NotEnoughClients, match="connected"):
        run_all(grid, strategy)


def test_sampled_subset_and_catch_up() -> None:
    """fraction-train < 1: unsampled nodes skip training but catch up in evaluate."""
    _, grid, strategy = make(num_nodes=5, **{"fraction-train": 0.4, "num-server-rounds": 3})
    recs = run_all(grid, strategy)
    assert [r.sampled for r in recs] == [2, 2, 2]
    assert all(r.eval_clients == 5 for r in recs)
    versions = {int(c.state.config_records[node_host.META_KEY]["version"]) for c in grid.contexts.values()}
    assert versions == {3}


def test_node_that_missed_evaluate_catches_up_on_next_train() -> None:
    _, grid, strategy = make(num_nodes=3, **{"num-server-rounds": 3})
    grid.faults[(102, protocol.EVALUATE)] = timeout_fault
    strategy.round(1)
    strategy.round(2)
    del grid.faults[(102, protocol.EVALUATE)]
    rec3 = strategy.round(3)
    assert rec3.num_clients == 3 and rec3.eval_clients == 3
    last_train = [m for m in grid.sent if m.metadata.dst_node_id == 102 and m.metadata.message_type == protocol.TRAIN][-1]
    assert sorted(last_train.content.array_records[protocol.AGGREGATES].keys()) == ["v1", "v2"]
    np.testing.assert_array_equal(node_params(grid, 100), node_params(grid, 102))


def test_local_dp_clips_and_reports() -> None:
    _, grid, strategy = make(num_nodes=3, **{"dp-mode": "local", "clip-norm": 0.01, "noise-multiplier": 0.0})
    recs = run_all(grid, strategy)
    assert math.isnan(recs[0].clipped_fraction)  # under DP the clipped bit is private: not sent
    mean_norm = np.linalg.norm(node_params(grid, 100) - build_flat())
    assert mean_norm <= 2 * 0.01 + 1e-6  # two rounds of a mean of clipped updates


def test_distributed_dp_server_makes_up_noise_for_dropped(caplog) -> None:
    _, grid, strategy = make(num_nodes=3, **{"dp-mode": "distributed", "noise-multiplier": 1.0, "clip-norm": 0.5})
    grid.faults[(101, protocol.TRAIN)] = raise_fault
    with caplog.at_level("INFO", logger="flwr"):
        recs = run_all(grid, strategy)
    assert recs[0].num_clients == 2
    assert recs[0].noise_shares_added == 1 and recs[1].noise_shares_added == 1
    assert any("added 1 of 1 missing noise share(s)" in r.getMessage() for r in caplog.records)
    # client-level epsilon grows; he=false distributed: accounted with sigma/sqrt(n)
    assert 0 < recs[0].epsilon_client < recs[1].epsilon_client < math.inf


def test_dp_sgd_reports_epsilon() -> None:
    _, grid, strategy = make(num_nodes=2, **{"dp-sgd": True, "noise-multiplier": 1.0, "clip-norm": 1.0})
    recs = run_all(grid, strategy)
    assert 0 < recs[0].epsilon_sample < recs[1].epsilon_sample < math.inf
    assert math.isnan(recs[0].epsilon_client)  # dp-mode none: no client-level DP


def build_flat() -> np.ndarray:
    from crypto import flatten

    return flatten(build_model("digits", 42).state_dict())[0].astype(np.float32)


def test_reply_metrics_match_the_documented_protocol() -> None:
    _, grid, fed = make(num_nodes=2, **{"num-server-rounds": 1})
    strategy = fed.strategy
    assert fed.admit() == [100, 101]
    replies = grid.send_and_receive(strategy.configure(protocol.TRAIN, 1, [100]))
    # dp-mode none: the private-data statistics are sent too (under DP they are not)
    assert set(replies[0].content[protocol.METRICS]) == set(protocol.TRAIN_METRICS + protocol.TRAIN_METRICS_NON_DP)
    replies = grid.send_and_receive(strategy.configure(protocol.EVALUATE, 1, [100]))
    assert set(replies[0].content[protocol.METRICS]) == set(protocol.EVAL_METRICS)


def test_reply_with_incomplete_metrics_is_left_out_before_aggregation() -> None:
    _, grid, fed = make(num_nodes=3, **{"num-server-rounds": 1})

    def strip(msg, ctx):
        reply = grid.deliver(msg)
        metrics = reply.content[protocol.METRICS]
        del metrics["num-values"]
        return reply

    grid.faults[(102, protocol.TRAIN)] = strip
    (rec,) = fed.run_all()
    assert rec.num_clients == 2 and "missing field 'num-values'" in rec.dropped[0]["reason"]


def test_flowers_node_unavailable_reply_is_charged_to_the_dead_node() -> None:
    """The SuperLink answers for a dead node itself (src node 1): the drop names the node."""
    from flwr.app import Error, Message

    _, grid, strategy = make(num_nodes=3, **{"num-server-rounds": 1})

    def unavailable(msg, ctx):
        reply = Message(Error(code=5, reason="Error: Node Unavailable"), reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = 1
        return reply

    grid.faults[(101, protocol.TRAIN)] = unavailable
    (rec,) = run_all(grid, strategy)
    reasons = {d["node"]: d["reason"] for d in rec.dropped if d["phase"] == "train"}
    assert set(reasons) == {101} and "Node Unavailable" in reasons[101]


def test_lm_nodes_in_fresh_processes_warm_start_their_kv_from_disk() -> None:
    """Deployment starts a ClientApp process per message: the node's cache directory carries
    its K/V blocks (and parameters) from one message to the next."""
    _, grid, strat = make(num_nodes=2, task="lm", **{"num-server-rounds": 2})
    node_host.forget_all()
    recs = []
    for rnd in range(1, 3):
        node_host.forget_all()  # a "fresh process" for the round
        recs.append(strat.round(rnd))
    assert recs[0].kv_blocks_on_disk == 0  # nothing served yet when round 1 trained
    assert recs[1].kv_blocks_on_disk >= 2 * 3  # round 1's chat turn: 3 prompt blocks/node
    assert recs[1].node_sources["restored"] == 2


def test_round_seconds_are_accounted_phase_by_phase() -> None:
    """Server phases sum to the round's wall time; node phases lie inside their handlers."""
    _, _, fed = make(num_nodes=3, **{"num-server-rounds": 1})
    rec = fed.round(1)
    assert sum(rec.server_seconds.values()) == pytest.approx(rec.seconds["round"], rel=1e-6)
    assert rec.server_seconds["other"] <= 0.1 * rec.seconds["round"]
    for phase, names in (("train", protocol.NODE_TRAIN_PHASES), ("evaluate", protocol.NODE_EVAL_PHASES)):
        sums = rec.node_seconds[phase]
        assert set(sums) == {*names, "handler", "other"}
        assert sum(sums[n] for n in names) <= sums["handler"] + 1e-9
        assert sums["handler"] > 0
    assert rec.seconds["nodes_busy"] == pytest.approx(
        rec.node_seconds["train"]["handler"] + rec.node_seconds["evaluate"]["handler"])
