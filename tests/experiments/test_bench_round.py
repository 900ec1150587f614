import math

import pytest

from experiments.bench_round import main, phase_accounting, summarise


def _results(times, ups, metric):
    rounds = [
        {"seconds": {"train_phase": t - 0.1, "evaluate_phase": 0.1, "train": 0.01, "encrypt": 0.002},
         "upload_bytes_mean": u, "aggregate_bytes": 2 * u, "eval_metric": metric, "eval_loss": 1.0,
         "num_clients": 5, "metric": "accuracy"}
        for t, u in zip(times, ups)
    ]
    return {"status": "completed", "rounds": rounds}


def test_summarise_takes_medians_and_the_last_metric():
    s = summarise(_results([2.0, 0.3, 0.5], [100, 100, 120], 0.8))
    assert s["seconds_per_round"] == pytest.approx(0.5)
    assert s["seconds_per_round_after_first"] == pytest.approx(0.4)
    assert s["upload_bytes_per_client_per_round"] == 100
    assert s["final_metric"] == 0.8 and s["phase_seconds_median"]["encrypt"] == 0.002


@pytest.mark.slow
def test_bench_round_runs_both_modes_through_flwr():
    out = main(["--quick", "--repeats", "1", "--rounds", "2", "--nodes", "3"])
    assert set(out["seconds_per_round"]) == {"plain", "he"}
    for key in ("seconds_per_round_he_vs_plain", "upload_he_vs_plain"):
        assert math.isfinite(out["ratios"][key]) and out["ratios"][key] > 0
    assert 0 <= out["final_metric"]["he"] <= 1


def test_phase_accounting_reports_explained_shares():
    rounds = [{"seconds": {"round": 2.0, "nodes_busy": 1.5},
               "server_seconds": {"wait": 1.2, "eval_wait": 0.6, "verify": 0.1, "other": 0.1},
               "node_seconds": {"train": {"train": 1.0, "handler": 1.1}, "evaluate": {"eval": 0.3, "handler": 0.4}}}]
    acc = phase_accounting(rounds)
    assert acc["round_wall_explained_by_server_phases"] == pytest.approx(0.95)
    assert acc["waits_explained_by_node_handlers"] == pytest.approx(1.5 / 1.8)
    assert acc["server_phase_seconds_median"]["wait"] == 1.2
    assert acc["node_phase_seconds_median"]["train"]["handler"] == 1.1
