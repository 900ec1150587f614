"""Evaluation is sampled like training: its cost stops growing with the population."""

from __future__ import annotations

import math

import pytest

from federation.config import ConfigError, RunConfig
from federation.local import InProcessGrid, run_local
from federation.sampling import evaluation_size

DIGITS = {"task": "digits", "he": True, "dp-mode": "none", "num-server-rounds": 3,
          "min-clients": 2, "seed": 7, "max-weight": 200.0}


@pytest.mark.parametrize("population, fraction, cap, expected", [
    (5, 1.0, 10, 5),      # the main job: everyone evaluates
    (20, 1.0, 10, 10),    # capped
    (100, 1.0, 10, 10),   # the same cost at 100 nodes
    (100, 0.05, 10, 5),   # the fraction below the cap
    (100, 0.01, 10, 2),   # at least min-clients
    (100, 1.0, 0, 100),   # 0 = no cap
    (3, 0.1, 10, 2),
    (100, 1.0, 10, 32),   # min-clients above the cap wins (here min-clients 32)
])
def test_evaluation_size(population: int, fraction: float, cap: int, expected: int) -> None:
    assert evaluation_size(population, fraction, 32 if expected == 32 else 2, cap) == expected


def test_config_refuses_a_negative_cap_and_a_bad_fraction() -> None:
    with pytest.raises(ConfigError, match="max-evaluate-clients must be >= 0"):
        RunConfig.from_run_config({"max-evaluate-clients": -1})
    assert RunConfig.from_run_config({"min-clients": 32, "max-evaluate-clients": 10}).min_clients == 32
    with pytest.raises(ConfigError, match="fraction-evaluate must be in"):
        RunConfig.from_run_config({"fraction-evaluate": 0.0})
    assert RunConfig.from_run_config({"max-evaluate-clients": 0}).max_evaluate_clients == 0


@pytest.mark.slow  # end-to-end (40-125 s): .ci/run runs it in its slow step
def test_a_capped_run_evaluates_a_fresh_sample_each_round_and_every_node_catches_up() -> None:
    cfg = {**DIGITS, "max-evaluate-clients": 2, "num-server-rounds": 4}
    grid = InProcessGrid(6, cfg)
    results = run_local(cfg, 6, grid=grid)

    assert results.status == "completed", results.status
    assert [r.eval_clients for r in results.rounds] == [2, 2, 2, 2]
    assert all(r.num_clients == 6 for r in results.rounds)  # training is not capped by it
    assert all(math.isfinite(r.eval_metric) for r in results.rounds)
    # every node trained each round, so each caught up to the version before the last round
    assert sorted(grid.node(n).version for n in grid.node_ids)[0] >= 3


def test_without_a_cap_every_node_evaluates() -> None:
    cfg = {**DIGITS, "max-evaluate-clients": 0, "num-server-rounds": 1}
    results = run_local(cfg, 4)
    assert [r.eval_clients for r in results.rounds] == [4]
