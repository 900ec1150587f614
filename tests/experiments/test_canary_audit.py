"""experiments.canary_audit: a non-private run audits to a high ε, a private one below the
accountant's (fixed seeds); the two-Gaussian ε matches Gaussian DP's closed form; bad input."""

from __future__ import annotations

import math

import pytest
from scipy import optimize, stats

from experiments.canary_audit import EPSILON_CAP, AuditConfig, AuditInputError, gaussian_pair_epsilon, run_canary_audit


def _gdp_epsilon(mu: float, delta: float) -> float:
    """Dong, Roth & Su 2019, Cor. 2.13: δ(ε) of μ-GDP, solved for ε."""
    f = lambda e: stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta  # noqa: E731
    return optimize.brentq(f, 0.0, 100.0)


@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
def test_equal_variance_pair_is_gaussian_dp(mu: float) -> None:
    assert gaussian_pair_epsilon(0.0, 1.0, mu, 1.0, 1e-5) == pytest.approx(_gdp_epsilon(mu, 1e-5), rel=1e-3)


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_non_private_run_audits_high(sampling: str) -> None:
    res = run_canary_audit(AuditConfig(dim=500, population=10, fraction=0.5, sampling=sampling, rounds=3,
                                       sigma=0.0, trials=200, seed=1))
    assert res.epsilon >= 10.0 and res.inserted_mean > 0.8


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_private_run_audits_below_the_accountant(sampling: str) -> None:
    from federation.client_accounting import ClientAccountant

    cfg = AuditConfig(dim=1000, population=10, fraction=0.5, sampling=sampling, rounds=4, sigma=1.0,
                      trials=400, seed=2)
    acc = ClientAccountant(sampling, cfg.population, cfg.delta)
    acc.step(cfg.sigma, 5, cfg.rounds)
    res = run_canary_audit(cfg)
    assert 0.0 < res.epsilon < acc.epsilon() < EPSILON_CAP
    # the canary leaves a trace: the audit is not blind
    assert res.inserted_mean > res.null_mean + res.null_std / 2


def test_bad_input() -> None:
    with pytest.raises(AuditInputError, match="trials"):
        run_canary_audit(AuditConfig(trials=5))
    with pytest.raises(AuditInputError, match="sampling"):
        run_canary_audit(AuditConfig(sampling="uniform"))
    with pytest.raises(AuditInputError, match="std"):
        gaussian_pair_epsilon(0.0, 0.0, 1.0, 1.0, 1e-5)
