"""experiments.lira: AUC ≈ 1 on a memorising model, ≈ 0.5 on one that ignores its data; the
pieces against hand-made inputs; the Clopper–Pearson ε lower bound against its closed form and
on random scores; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from experiments.lira import (
    LiraInputError,
    auc_with_ci,
    epsilon_lower_bound,
    lira_attack,
    lira_scores,
    logit_confidence,
    tpr_at_fpr,
)


def _pool(n: int = 100, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 10, (n,), generator=g)  # random labels


def _memorise(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _ignore_data(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 10))


def test_memorising_model_is_caught() -> None:
    res = lira_attack(_memorise, *_pool(), n_models=8, seed=0)
    assert res.auc > 0.97 and res.auc_ci_low > 0.9 and res.tpr_at_0_1pct_fpr > 0.2
    assert 0.9 * 8 * 100 < res.samples <= 8 * 100
    assert res.epsilon_lb > 2.0  # ~400 members told apart at low FPR: a large provable ε


def test_model_that_ignores_its_data_is_at_chance() -> None:
    res = lira_attack(_ignore_data, *_pool(), n_models=8, seed=1)
    assert res.auc_ci_low < 0.5 < res.auc_ci_high and abs(res.auc - 0.5) < 0.06
    assert res.epsilon_lb < 0.3


def test_pieces() -> None:
    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.zero_(); model.bias.copy_(torch.tensor([0.0, 0.0, np.log(2.0)]))  # noqa: E702
    phi = logit_confidence(model, torch.zeros(1, 2), torch.tensor([2]))
    assert phi[0] == pytest.approx(0.0, abs=1e-6)  # p = 2/4 = 1/2
    shadow = np.array([[1.0, 1.0], [-1.0, -1.0], [1.0, -1.0], [-1.0, 1.0]])
    masks = np.array([[True, False], [False, True], [True, True], [False, False]])
    scores = lira_scores(np.array([1.0, 1.0]), shadow, masks)  # col 0: IN ~ +1, col 1: IN ~ -1
    assert scores[0] > 0 > scores[1]
    labels = np.array([0] * 1000 + [1])
    assert tpr_at_fpr(labels, np.r_[np.zeros(1000), 1.0]) == 1.0
    auc, lo, hi = auc_with_ci(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.8, 0.9]))
    assert auc == 1.0 and lo <= hi <= 1.0


def _perfect(n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.r_[np.ones(n), np.zeros(n)]
    return labels, labels.copy()


def test_epsilon_lower_bound_of_a_perfect_separation() -> None:
    # the top threshold holds n of n members and 0 of n non-members; 2 thresholds x 2 tests, so
    # Bonferroni takes each one-sided CP bound at 0.05/4: TPR >= a^(1/n) and FPR <= 1 - a^(1/n)
    # with a = 0.0125, so ε_lb = log((a^(1/n) - δ) / (1 - a^(1/n)))
    bounds = []
    for n in (10, 100, 1000, 10_000):
        low = (0.05 / 4) ** (1 / n)
        bounds.append(epsilon_lower_bound(*_perfect(n), delta=1e-5))
        assert bounds[-1] == pytest.approx(np.log((low - 1e-5) / (1 - low)), rel=1e-6)
        assert np.log(n / 8) < bounds[-1] < np.log(n)  # ≈ log(n / 4.4) for large n: bounded by the sample size
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)  # more samples prove more


def test_epsilon_lower_bound_of_random_scores_is_zero() -> None:
    labels = np.r_[np.ones(1000), np.zeros(1000)]
    eps = [epsilon_lower_bound(labels, np.random.default_rng(seed).random(2000), 1e-5) for seed in range(20)]
    # the Bonferroni-adjusted scan over ~2,000 thresholds proves nothing on any seed
    assert sum(e == 0.0 for e in eps) >= 19 and max(eps) < 0.3
    # δ eats the TPR: with δ = 1 - 1e-9 nothing is provable
    assert epsilon_lower_bound(*_perfect(100), delta=1 - 1e-9) == 0.0
    # ties: one threshold for equal scores (all equal: TPR = FPR, nothing provable)
    assert epsilon_lower_bound(np.r_[np.ones(50), np.zeros(50)], np.zeros(100), 1e-5) == 0.0


def test_bad_input() -> None:
    with pytest.raises(LiraInputError, match="4 models"):
        lira_attack(_memorise, *_pool(), n_models=3)
    with pytest.raises(LiraInputError, match="IN and one OUT"):
        lira_scores(np.zeros(2), np.zeros((2, 2)), np.ones((2, 2), dtype=bool))
    with pytest.raises(LiraInputError, match="shape"):
        lira_scores(np.zeros(3), np.zeros((2, 2)), np.ones((2, 2), dtype=bool))
    with pytest.raises(LiraInputError, match="both"):
        auc_with_ci(np.ones(4), np.zeros(4))
    with pytest.raises(LiraInputError, match="both"):
        epsilon_lower_bound(np.ones(4), np.zeros(4), 1e-5)
    with pytest.raises(LiraInputError, match="delta"):
        epsilon_lower_bound(*_perfect(4), delta=1.0)


def test_bootstrap_auc_matches_sklearn() -> None:
    from sklearn.metrics import roc_auc_score

    from experiments.lira import _rank_auc

    rng = np.random.default_rng(0)
    labels = rng.random((6, 200)) < 0.5
    scores = np.round(rng.normal(size=(6, 200)) + labels, 1)  # rounded: ties are averaged
    want = [roc_auc_score(lab, sc) for lab, sc in zip(labels, scores)]
    assert _rank_auc(labels, scores) == pytest.approx(want, abs=1e-12)
    assert np.isnan(_rank_auc(np.ones((1, 5), dtype=bool), np.zeros((1, 5))))[0]
    auc, lo, hi = auc_with_ci(labels[0].astype(int), scores[0])
    assert auc == pytest.approx(want[0]) and lo < auc < hi and hi - lo < 0.3
