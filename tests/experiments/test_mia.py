import numpy as np
import pytest
import torch
from torch import nn

from experiments.mia import attack_auc, loss_threshold_auc


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 20, generator=g), torch.randint(0, 10, (n,), generator=g)


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 10))


def _fit(model, x, y, epochs):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(epochs):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def test_overfit_model_is_caught():
    members, others = _data(100, 0), _data(100, 1)
    model = _fit(_mlp(0), *members, epochs=300)  # random labels: pure memorisation
    assert attack_auc(model, members, others) > 0.95


def test_model_that_never_saw_the_members_is_at_chance():
    model = _fit(_mlp(0), *_data(200, 2), epochs=300)
    aucs = [attack_auc(model, _data(400, 10 + i), _data(400, 20 + i)) for i in range(3)]
    assert abs(float(np.mean(aucs)) - 0.5) < 0.05


def test_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        loss_threshold_auc(np.array([]), np.array([1.0]))
    with pytest.raises(ValueError, match="finite"):
        loss_threshold_auc(np.array([np.nan]), np.array([1.0]))
    assert loss_threshold_auc(np.array([0.1, 0.2]), np.array([1.0, 2.0])) == 1.0
