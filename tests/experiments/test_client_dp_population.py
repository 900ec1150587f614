"""experiments.client_dp_population: Poisson clients, clipped updates, the server's accountant."""

from __future__ import annotations

import math

import pytest
import torch

from experiments import client_dp_population as cdp
from federation.client_accounting import ClientAccountant

TINY = cdp.PopulationConfig(population=20, per_round=4, rounds=1, local_steps=1, batch=2, eval_windows=2)


def test_client_slices_are_disjoint_equal_and_refuse_too_many_clients():
    data = bytes(range(256)) * 10
    slices = cdp.client_slices(data, 8, 64)
    assert len(slices) == 8 and {len(s) for s in slices} == {320} and b"".join(slices) == data[:2560]
    with pytest.raises(ValueError, match="fewer than one window"):
        cdp.client_slices(data, 100, 64)


def test_a_round_clips_each_update_and_adds_noise_of_sigma_c_to_the_sum(monkeypatch):
    """Every sampled client moves the weights by exactly C (clipped); the noise is σ·C per value."""
    cfg = cdp.PopulationConfig(population=4, per_round=4, rounds=1, local_steps=1, clip=0.5)
    model = torch.nn.Linear(3, 2)
    weights = cdp._flat(model).clone()

    def far_training(m, *args):  # every client's raw update has norm 10 (> C)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(10.0 / math.sqrt(8))
    monkeypatch.setattr(cdp, "train_lm", far_training)
    new, signal, n = cdp._round(cfg, [b"x"] * 4, model, weights, 0.0, torch.Generator().manual_seed(0))
    assert n == 4 and signal == pytest.approx(0.5) and float((new - weights).norm()) == pytest.approx(0.5)
    noisy, _, _ = cdp._round(cfg, [b"x"] * 4, model, weights, 2.0, torch.Generator().manual_seed(0))
    noise = (noisy - new) * cfg.per_round
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.6)  # 8 values: loose, but not 0 and not σ


def test_points_spend_their_target_under_the_servers_accountant():
    private = cdp.run_point(TINY, 8.0, seed=0)
    free = cdp.run_point(TINY, math.inf, seed=0)
    assert private["noise_multiplier"] > 0 and free["noise_multiplier"] == 0.0 and free["epsilon"] == "inf"
    acc = ClientAccountant("poisson", TINY.population, TINY.delta)
    acc.step(private["noise_multiplier"], TINY.per_round, TINY.rounds)
    assert private["epsilon_spent"] == pytest.approx(acc.epsilon()) and private["epsilon_spent"] <= 8.0
    assert math.isfinite(private["perplexity"]) and free["signal_norm"] > 0
    assert free["perplexity"] != private["perplexity"]


def test_summary_keys_and_population_table():
    pts = [{"epsilon": e, "seed": s, "perplexity": 10.0 + s, "noise_multiplier": 1.0, "epsilon_spent": None,
            "noise_to_signal": 2.0 + s} for e in ("8", "inf") for s in (0, 1)]
    out = cdp.summarise(pts)
    assert list(out) == ["8", "inf"] and out["8"]["perplexity_mean"] == pytest.approx(10.5)
    assert out["8"]["noise_to_signal"] == pytest.approx(2.5) and out["8"]["seeds"] == [0, 1]
    assert out["8"]["perplexity_ratio_mean"] == pytest.approx(1.0) and out["inf"]["perplexity_ratio_mean"] == 1.0
    pts[0]["perplexity"] = 20.0  # ε 8, seed 0: twice its own ε = ∞ point
    assert cdp.summarise(pts)["8"]["perplexity_ratio_mean"] == pytest.approx(1.5)
    rows = cdp.population_table(TINY, dim=10_000, signal=0.5)
    ratios = [r["noise_to_signal"] for r in rows]
    assert ratios == sorted(ratios, reverse=True) and rows[-1]["population"] == 1_000_000


@pytest.mark.slow
def test_quick_run_writes_results(tmp_path):
    out = cdp.main(["--quick", "--out", str(tmp_path)])
    assert set(out["by_epsilon"]) == {"1", "3", "8", "inf"} and out["signal_norm"] > 0
    assert (next(tmp_path.glob("client_dp_population/*/results.json"))).is_file()
