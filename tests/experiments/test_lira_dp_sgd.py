"""experiments.lira_dp_sgd: LiRA of the DP-SGD trainer is at chance under heavy noise and well
above it without noise on a tiny pool; the mechanism's ε against Opacus' own calibration; the
trainer is reproducible per seed; bad input. Fixed seeds, small sizes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from experiments.lira import lira_attack
from experiments.lira_dp_sgd import DpSgdMechanism, MechanismError, dp_sgd_trainer, train_dp_sgd


@pytest.fixture(scope="module")
def pool() -> tuple[torch.Tensor, torch.Tensor]:
    from node.tasks import digits

    x, y = digits.load_partition(0, digits.DigitsConfig(num_partitions=2, alpha=10.0, seed=0))[0].dataset.tensors
    return x[:40], y[:40]


def _attack(mech: DpSgdMechanism, x: torch.Tensor, y: torch.Tensor):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG and hook notices
        return lira_attack(dp_sgd_trainer(mech), x, y, n_models=8, seed=0)


def test_heavy_noise_is_at_chance(pool) -> None:
    mech = DpSgdMechanism(noise_multiplier=20.0, batches=2, steps=20, lr=0.5)
    res = _attack(mech, *pool)
    assert res.auc_ci_low < 0.5 < res.auc_ci_high and abs(res.auc - 0.5) < 0.08
    assert res.epsilon_lb <= mech.epsilon(1e-5)


def test_no_noise_on_a_tiny_pool_is_caught(pool) -> None:
    x, y = pool
    res = _attack(DpSgdMechanism(noise_multiplier=0.0, batches=1, steps=60, lr=0.5), x[:20], y[:20])
    assert res.auc > 0.8 and res.auc_ci_low > 0.7  # the σ = 20 model above sits at 0.5
    assert res.epsilon_lb > 1.0


def test_epsilon_matches_opacus_calibration() -> None:
    from opacus.accountants.utils import get_noise_multiplier

    sigma = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.25, steps=200,
                                 accountant="rdp", epsilon_tolerance=0.001)
    assert DpSgdMechanism(sigma, batches=4, steps=200).epsilon(1e-5) == pytest.approx(4.0, abs=0.01)
    assert DpSgdMechanism(0.0).epsilon(1e-5) == math.inf
    assert DpSgdMechanism(1.0, batches=4).sample_rate == 0.25


def test_trainer_is_reproducible_per_seed(pool) -> None:
    mech = DpSgdMechanism(noise_multiplier=1.0, batches=2, steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b, c = (train_dp_sgd(mech, *pool, seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)


def test_bad_input() -> None:
    for kwargs, match in (({"noise_multiplier": -1.0}, "noise multiplier"),
                          ({"noise_multiplier": math.nan}, "noise multiplier"),
                          ({"noise_multiplier": 1.0, "clip_norm": 0.0}, "clip norm"),
                          ({"noise_multiplier": 1.0, "steps": 0}, "step"),
                          ({"noise_multiplier": 1.0, "batches": 0}, "batch")):
        with pytest.raises(MechanismError, match=match):
            DpSgdMechanism(**kwargs)
    with pytest.raises(MechanismError, match="at least 4 examples, got 0"):
        train_dp_sgd(DpSgdMechanism(1.0), torch.zeros(0, 64), torch.zeros(0, dtype=torch.long), seed=0)
    with pytest.raises(MechanismError, match="at least 4 examples, got 3"):
        train_dp_sgd(DpSgdMechanism(1.0, batches=4), torch.zeros(3, 64), torch.zeros(3, dtype=torch.long), seed=0)
