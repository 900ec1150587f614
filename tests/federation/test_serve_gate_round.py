"""The gate before serving through a whole run (real ClientApp handlers and strategy, in process):
an honest round's model is published to every node's serving agents; a poisoned aggregate is kept
unserved, the previous version stays published, and the round line and results JSON say so."""

from __future__ import annotations

import pytest

from federation import catch_up, messages
from federation.config import ConfigError, RunConfig
from federation.gate_report import line, node_fields, parse, summarize
from federation.local import InProcessGrid, run_local
from federation.node_policy import NodePolicy, PolicyError
from federation.results import RoundRecord
from node.serving import param_channel
from node.serve_gate import GateScores, GateVerdict

RUN = {"task": "digits", "he": False, "dp-mode": "none", "num-server-rounds": 2, "min-clients": 2,
       "seed": 42, "sampler-seed": 0, "local-epochs": 1}


def _poison_the_second_aggregate(monkeypatch) -> None:
    """The aggregate that makes v2 comes out of decryption as -300 x itself (a scaled honest mean:
    updates are clipped to C = 1, so a norm of at most 300, inside the bound a run with a large
    clip-norm admits), as a poisoning key holder could make it."""
    opened = catch_up._open
    seen: dict[bytes, int] = {}

    def poisoned(cfg, context, dim, blob, manifest, timer, *replay_state):
        mean, made_in = opened(cfg, context, dim, blob, manifest, timer, *replay_state)
        return (mean * -300.0 if seen.setdefault(blob, len(seen)) == 1 else mean), made_in

    monkeypatch.setattr(catch_up, "_open", poisoned)


def test_a_poisoned_aggregate_is_kept_unserved_and_the_round_says_so(monkeypatch, one_thread, tmp_path) -> None:
    _poison_the_second_aggregate(monkeypatch)
    grid = InProcessGrid(2, RUN)
    results = run_local(RUN, 2, grid=grid, results_dir=str(tmp_path))
    assert results.status == "completed", results.status
    honest, poisoned = results.rounds
    assert honest.gate["served"] and honest.gate["nodes"] == 2 and honest.gate["unserved_nodes"] == 0
    assert "gate: served (2/2 nodes)" in honest.summary(2)
    assert not poisoned.gate["served"] and poisoned.gate["unserved_nodes"] == 2
    assert poisoned.gate["reason"] == "heldout"
    assert poisoned.gate["heldout_after"] - poisoned.gate["heldout_before"] > RunConfig().serve_gate_tolerance
    summary = poisoned.summary(2)
    assert "gate: NOT SERVED by 2/2 nodes (heldout; held-out " in summary and "previous version served" in summary
    assert "nan" not in summary.lower()
    for node_id in grid.node_ids:
        node = grid.node(node_id)
        assert node.version == 2  # training goes on from the aggregate
        assert param_channel.load(node.cache_dir, node._cache_key)[1] == 1  # its agents serve v1
    import json
    written = json.loads(next(tmp_path.glob("run-*.json")).read_text())
    assert written["rounds"][1]["gate"]["served"] is False
    assert written["rounds"][0]["gate"]["served"] is True


def test_gate_fields_round_trip_and_summarize() -> None:
    before, after = GateScores(2.0, (1.0, 0.2)), GateScores(2.1, (-0.5, 0.3))
    fields = node_fields((3, GateVerdict(False, "probes", before, after)), 3)
    assert fields == {"gate-served": 0, "gate-reason": 2, "gate-heldout-before": 2.0, "gate-heldout-after": 2.1,
                      "gate-probe-before": 1.0, "gate-probe-after": -0.5}  # the probe that fell most
    assert node_fields((2, GateVerdict(True, "", before, after)), 3) == {}  # not this version's verdict
    from flwr.app import MetricRecord

    got = parse(MetricRecord(fields), "metrics")
    with pytest.raises(messages.BadReply, match="gate-reason"):
        parse(MetricRecord({**fields, "gate-reason": 9}), "metrics")
    gate = summarize([got, {"gate-served": 1.0, "gate-reason": 0.0, "gate-heldout-before": 2.0,
                            "gate-heldout-after": 1.9}, {}])
    assert gate["served"] is False and gate["nodes"] == 2 and gate["unserved_nodes"] == 1
    assert gate["reason"] == "probes" and gate["probe_before"] == 1.0
    text = RoundRecord(round=1, gate=gate).summary(2)
    assert "gate: NOT SERVED by 1/2 nodes (probes; held-out 2→2, probe margin 1→-0.5; previous version served)" in text
    assert summarize([{}, {}]) == {} and line({}) == ""


def test_the_tolerance_is_checked_and_a_node_can_cap_it() -> None:
    with pytest.raises(ConfigError, match="serve-gate-tolerance must be >= 0"):
        RunConfig(serve_gate_tolerance=-1)
    policy = NodePolicy.of({"max-serve-gate-tolerance": "0.2"})
    with pytest.raises(PolicyError, match="serve-gate-tolerance <= 0.2"):
        policy.check(RunConfig(serve_gate_tolerance=0.5))
    policy.check(RunConfig(serve_gate_tolerance=0.1))
