"""The round line a person reads: no nan, the round's wall time, means labelled, δ explained."""

from __future__ import annotations

import math

from federation.results import RoundRecord

SERVING = {"sessions": 4, "turns": 8, "prefix_hit_rate": 0.5,
           "tier_hit_rates": {"hot": 0.9, "warm": math.nan, "cold": 0.0}, "tokens_per_s": 400.0,
           "recomputed_tokens": 3, "invalidated_blocks": 2, "ppl": 70.1, "ppl_fresh": math.nan}


def _dp_round(**kw) -> RoundRecord:
    """A default-DP lm round: train loss, clipped and saturated shares are not sent (nan)."""
    base = dict(round=3, population=100, sampled=32, num_clients=31, eval_clients=10,
                metric="perplexity", eval_metric=50.93, eval_loss=3.93, upload_bytes_mean=12_600.0,
                seconds={"round": 12.43, "train": 1.2, "encrypt": 0.05, "decrypt": 0.01,
                         "eval_decrypt": 0.02, "aggregate": 0.02},
                epsilon_client=3.2, epsilon_server=5.1, delta_total=1.01e-5)
    return RoundRecord(**{**base, **kw})


def test_a_dp_round_line_has_no_nan_and_names_the_population() -> None:
    line = _dp_round(serving=SERVING).summary(5)
    assert "nan" not in line.lower()
    assert line.startswith("round 3/5 · 12.4 s · trained 31/32 of 100 nodes, 10 evaluated · ")
    assert "perplexity 50.93" in line and "train loss" not in line and "clipped" not in line
    assert "ε 3.2 (vs server 5.1) δ 1.01e-05" in line
    assert "per node (mean): train 1.2 s encrypt 50 ms decrypt 30 ms" in line
    assert "server aggregate 20 ms" in line
    assert "hot/warm/cold 0.90/n/a/0.00" in line and "(fresh n/a)" in line


def test_every_observer_is_on_the_round_line() -> None:
    line = _dp_round(epsilon_node=7.25, epsilon_colluding=math.inf, colluding_nodes=3).summary(5)
    assert "ε 3.2 (vs server 5.1, a node 7.25, 3 nodes ∞) δ 1.01e-05" in line
    same = _dp_round(epsilon_server=3.2, epsilon_node=4.0, epsilon_colluding=5.0, colluding_nodes=2).summary(5)
    assert "ε 3.2 (vs a node 4, 2 nodes 5)" in same


def test_delta_total_of_one_is_explained() -> None:
    line = _dp_round(epsilon_client=27_612.3, epsilon_server=27_612.3,
                     delta_total=1.0).summary(5)
    assert "ε 27,612 δ 1 (no guarantee at this ε)" in line


def test_a_node_dropped_in_two_phases_counts_once() -> None:
    dropped = [{"node": 7, "phase": "train", "reason": "killed"},
               {"node": 7, "phase": "noise", "reason": "killed"}]
    line = _dp_round(dropped=dropped).summary(5)
    assert "dropped 1 node: 7 (train)" in line


def test_without_dp_the_training_fields_show() -> None:
    line = _dp_round(train_loss=2.5, clipped_fraction=0.25, epsilon_client=math.nan,
                     epsilon_server=math.nan, delta_total=math.nan).summary(5)
    assert "train loss 2.5" in line and "clipped 0.25" in line and "ε" not in line


def test_a_skipped_poisson_round_says_so() -> None:
    line = RoundRecord(round=1, population=10, sampling_skipped=True).summary(2)
    assert "no training" in line and "of 10 nodes" in line and "nan" not in line


def test_example_level_dp_names_its_unit_before_the_client_level_figures() -> None:
    line = _dp_round(epsilon_sample=7.99, delta=1e-5, epsilon_client=27_612.3, epsilon_server=27_612.3,
                     delta_total=1.0).summary(5)
    assert ("ε 7.99 per training example (δ 1e-05, vs everyone) · per node's update ε 27,612 "
            "δ 1 (no guarantee at this ε)") in line


def test_results_json_names_the_example_level_epsilon_per_round_and_per_run():
    from federation.results import RunResults

    rounds = [RoundRecord(round=1, epsilon_sample=6.27, delta=1e-5), RoundRecord(round=2, epsilon_sample=8.0, delta=1e-5)]
    d = RunResults(config={}, mode="he", rounds=rounds).to_dict()
    assert [r["epsilon_example"] for r in d["rounds"]] == [6.27, 8.0]
    assert d["epsilon_example"] == 8.0 and d["delta"] == 1e-5
    assert RunResults(config={}, mode="he").to_dict()["epsilon_example"] is None
