"""Client-level privacy audit with canary clients (Andrew et al. 2024, "One-shot Empirical Privacy
Estimation for Federated Learning").

A canary client always sends the same random direction c (norm = clip norm C). After the run, the
auditor measures cos(Δ, c) between the final model change Δ and each inserted canary, and the
same cosine for canaries that were never inserted (the null). Fitting a Gaussian to each set
gives two distributions an adversary would have to tell apart; the ε of that pair at δ is the
empirical estimate. It is an estimate, not a bound: the accountant's ε must stay above it, and
an estimate above the accountant's ε is a bug in the mechanism or the accounting.

Both Gaussians get the null's std (the shift is measured in null standard deviations, i.e. a
μ-GDP fit). Why not each its own std: under sampling the inserted cosines are a Binomial
mixture (0, 1, ... rounds with the canary), not a Gaussian; a wider fitted Gaussian has a
privacy loss that grows quadratically in the tails, and at δ = 1e-5 that extrapolation alone
put the estimate above the accountant's ε (8.9 vs 7.4: Poisson, q = 0.5, 4 rounds, σ = 1,
d = 1000, 400 trials) — an artefact of the fit, not of the mechanism.

What is audited: fedkv's client-level mechanism as it runs — the sampler
(``federation.sampling.ClientSampler``, the same draws), L2 clipping (``crypto.clip_update``),
each sampled client's distributed noise share (``crypto.gaussian_noise``, placement
distributed) and the fixed denominator — on vectors of the model's dimension. The other
clients send zero updates: the canary competes with the noise alone, the adversary's easiest
case. Many independent trials run at once (one canary per trial, a row of a matrix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from crypto import clip_update, gaussian_noise

__all__ = ["AuditConfig", "AuditInputError", "AuditResult", "gaussian_pair_epsilon", "run_canary_audit", "EPSILON_CAP"]

EPSILON_CAP = 50.0
"""Estimates are capped here (the two fitted Gaussians are then practically disjoint)."""


class AuditInputError(ValueError):
    """An audit configuration or cosine sample that cannot give an estimate."""


@dataclass(frozen=True)
class AuditConfig:
    """One audited point; defaults are a small CI-sized audit."""

    dim: int = 1000
    """Model dimension (the digits MLP has 4,810 parameters)."""
    population: int = 20
    """N: the canary takes the place of one of the N clients."""
    fraction: float = 0.5
    """fraction-train: k = ceil(fraction·N) (fixed) or probability per client (poisson)."""
    sampling: str = "fixed"
    rounds: int = 5
    sigma: float = 1.0
    """Noise multiplier of the sum (0 = non-private)."""
    clip_norm: float = 1.0
    trials: int = 400
    """Independent runs, one inserted and one held-out canary each."""
    delta: float = 1e-5
    seed: int = 0


@dataclass(frozen=True)
class AuditResult:
    epsilon: float
    inserted_mean: float
    null_mean: float
    null_std: float
    trials: int


def _rounds_sampled(cfg: AuditConfig, rng: np.random.Generator) -> tuple[np.ndarray, int, float]:
    """(per trial and round: canary sampled?, clients per round, denominator) for the sampler."""
    if cfg.sampling == "fixed":
        k = max(1, math.ceil(cfg.fraction * cfg.population))
        p, denom = k / cfg.population, float(k)
    elif cfg.sampling == "poisson":
        p = cfg.fraction
        k = max(1, round(cfg.fraction * cfg.population))
        denom = float(k)
    else:
        raise AuditInputError(f"sampling must be fixed or poisson, not {cfg.sampling!r}")
    # fixed-size without replacement: a given client is in the sample with probability k/N
    # each round, independently across rounds; that marginal is all one canary's trial needs.
    return rng.random((cfg.trials, cfg.rounds)) < p, k, denom


def _unit_rows(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    v = rng.standard_normal((n, dim))
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dots = np.einsum("ij,ij->i", a, b)
    return np.where(na * nb > 0, dots / np.maximum(na * nb, 1e-300), 0.0)


def final_deltas(cfg: AuditConfig, canaries: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Δ of every trial: the sum over rounds of (clipped canary if sampled + noise shares) / denominator."""
    sampled, k, denom = _rounds_sampled(cfg, rng)
    clipped = np.stack([clip_update(row, cfg.clip_norm).clipped for row in canaries])  # one update per trial
    delta = np.zeros_like(clipped)
    for t in range(cfg.rounds):
        total = clipped * sampled[:, t:t + 1]
        if cfg.sigma > 0:
            for _ in range(k):  # each sampled client's share sigma*C/sqrt(k): the sum carries sigma*C
                total += gaussian_noise(total.shape, cfg.sigma, cfg.clip_norm, "distributed", k, rng)
        delta += total / denom
    return delta


def gaussian_pair_epsilon(mu0: float, s0: float, mu1: float, s1: float, delta: float) -> float:
    """ε at which N(mu0, s0²) and N(mu1, s1²) are (ε, δ)-indistinguishable (both directions).

    δ(ε) = ∫ max(0, p(x) − e^ε q(x)) dx on a fine grid; the smallest ε with δ(ε) <= δ by bisection.
    """
    if not (s0 > 0 and s1 > 0 and math.isfinite(mu0) and math.isfinite(mu1)):
        raise AuditInputError("both fitted Gaussians need a finite mean and a std > 0")
    lo_x = min(mu0 - 12 * s0, mu1 - 12 * s1)
    hi_x = max(mu0 + 12 * s0, mu1 + 12 * s1)
    x = np.linspace(lo_x, hi_x, 200_001)
    lp, lq = stats.norm.logpdf(x, mu1, s1), stats.norm.logpdf(x, mu0, s0)
    dx = x[1] - x[0]

    def delta_of(eps: float) -> float:
        a = np.exp(lp) - np.exp(np.minimum(lq + eps, 700))
        b = np.exp(lq) - np.exp(np.minimum(lp + eps, 700))
        return float(max(np.clip(a, 0, None).sum(), np.clip(b, 0, None).sum()) * dx)

    if delta_of(EPSILON_CAP) > delta:
        return EPSILON_CAP
    if delta_of(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, EPSILON_CAP
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def run_canary_audit(cfg: AuditConfig) -> AuditResult:
    """Empirical client-level ε of ``cfg``'s mechanism (see the module docstring)."""
    if cfg.trials < 20 or cfg.dim < 2 or cfg.rounds < 1 or not 0 < cfg.fraction <= 1:
        raise AuditInputError("need trials >= 20, dim >= 2, rounds >= 1, fraction in (0, 1]")
    if cfg.sigma < 0:
        raise AuditInputError("sigma must be >= 0")
    rng = np.random.default_rng(cfg.seed)
    inserted = _unit_rows(cfg.trials, cfg.dim, rng) * cfg.clip_norm
    held_out = _unit_rows(cfg.trials, cfg.dim, rng)
    deltas = final_deltas(cfg, inserted, rng)
    cos_in, cos_null = _cosines(deltas, inserted), _cosines(deltas, held_out)
    s_null = float(cos_null.std(ddof=1))
    eps = gaussian_pair_epsilon(float(cos_null.mean()), s_null, float(cos_in.mean()), s_null, cfg.delta)
    return AuditResult(eps, float(cos_in.mean()), float(cos_null.mean()), s_null, cfg.trials)
