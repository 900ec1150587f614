"""experiments.lira: AUC ≈ 1 on a memorising model, ≈ 0.5 on one that ignores its data; the
pieces against hand-made inputs; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from experiments.lira import LiraInputError, auc_with_ci, lira_attack, lira_scores, logit_confidence, tpr_at_fpr


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


def test_model_that_ignores_its_data_is_at_chance() -> None:
    res = lira_attack(_ignore_data, *_pool(), n_models=8, seed=1)
    assert res.auc_ci_low < 0.5 < res.auc_ci_high and abs(res.auc - 0.5) < 0.06


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


def test_bad_input() -> None:
    with pytest.raises(LiraInputError, match="4 models"):
        lira_attack(_memorise, *_pool(), n_models=3)
    with pytest.raises(LiraInputError, match="IN and one OUT"):
        lira_scores(np.zeros(2), np.zeros((2, 2)), np.ones((2, 2), dtype=bool))
    with pytest.raises(LiraInputError, match="shape"):
        lira_scores(np.zeros(3), np.zeros((2, 2)), np.ones((2, 2), dtype=bool))
    with pytest.raises(LiraInputError, match="both"):
        auc_with_ci(np.ones(4), np.zeros(4))
