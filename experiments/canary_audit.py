"""Client-level privacy audit with canary clients (after Andrew et al. 2024, "One-shot Empirical
Privacy Estimation for Federated Learning"), probing the worst-case pair of the accounted
adjacency.

The pair: the accountant (``federation.client_accounting``) charges ``fixed`` sampling under
replace-one adjacency and ``poisson`` under add-or-remove. Replace-one's worst case is a canary
client whose clipped update x (norm C) is replaced by −x: the two worlds' sums differ by 2C, the
sensitivity the accountant charges. Add-or-remove's is x against the canary absent (C apart). So
every trial runs the mechanism twice, independently: world A with the canary sending +x, world B
with it sending −x (``fixed``) or nothing (``poisson``); everything else is equal. (The previous
audit probed x against 0 under replace-one as well, half the accounted distance: it could not
catch an accountant that under-reported ε by 1.5×.)

The mechanism as it runs: the client sampler (``federation.sampling.ClientSampler``, same class
and method; the audit draws its own samples from its own seed, it does not replay a run's draws),
L2 clipping (``crypto.clip_update``) of the canary, one distributed noise share
(``crypto.gaussian_noise``, placement distributed, σC/√m each) per sampled client, m the
round's sample size, so the sum carries σC, and the fixed denominator. The other clients send
zero updates: the canary competes with the noise alone, the adversary's easiest case.

The score: the projection of the released sums (summed over rounds: the final model change) on
x/‖x‖, the test the adversary who knows the canary would run. The noise is isotropic, so its
projection on a unit vector is exactly N(0, share std²) and the other d − 1 coordinates are
independent of the score: the audit draws the projection itself (``dim`` no longer changes the
result; it sizes the canary that is clipped). Scores are in units of C on the sum, rounded to a
fixed grid of 1/20 of the score's noise std (the threshold grid below).

Two figures:

* ``epsilon``: a point estimate, the ε of two equal-variance Gaussians fitted to the two worlds'
  scores (both get world B's std: a μ-GDP fit). An estimate, not a bound. Why not each its own
  std: under sampling the scores are Binomial mixtures (0, 1, ... rounds with the canary), not
  Gaussians; a wider fitted Gaussian has a privacy loss that grows quadratically in the tails,
  and at δ = 1e-5 that extrapolation alone put the estimate above the accountant's ε.
* ``epsilon_lower``: a one-sided lower bound at ``confidence`` (default 95 %):
  ``experiments.lira.epsilon_lower_bound`` (Clopper–Pearson bounds on TPR and FPR, Bonferroni
  over the thresholds, both test directions), world A as members. Its level is 1 − 2α, so the
  audit passes α = (1 − confidence)/2. Trials are independent runs, so here the level is not
  nominal as in LiRA's leave-one-out. A lower bound above the accountant's ε is a bug in the
  mechanism or the accounting at that confidence (``experiments.privacy_accuracy`` lists it as
  an audit failure).

What it can catch (``tests/experiments/test_canary_audit.py`` recomputes these): fixed sampling,
N = k = 10 (q = 1), one round, σ = 2, δ = 1e-3, 200,000 trials. Exact ε of the pair
(μ-GDP, μ = 2/σ = 1): 3.14; the accountant's (RDP): 3.54; an accountant under-reporting by 1.5×
would say 2.36; the 95 % lower bound is 2.60–2.72 (seeds 0–2), above 2.36 and below 3.54 (point estimate 3.13–3.16).
The x vs absent pair at the same settings bounds 1.09–1.19: it would not have caught it. About 5 s
per audit here (the sampler's draws, one Python call per trial and round).

What it cannot catch: no scores of n trials give more than ``audit_ceiling(n, K)`` ≈
ln n − ln ln(4K/0.05) (K thresholds scanned; each result carries it as ``epsilon_ceiling``). At
docs/privacy.md's ε = 8 points (100 clients, 12 rounds, 1,000 trials, seed 0) the ceiling is
4.7 and the bound 0.60 (fixed) / 1.22 (Poisson): the 1.5× under-reporter's 5.33 goes uncaught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from crypto import clip_update, gaussian_noise

__all__ = ["AuditConfig", "AuditInputError", "AuditResult", "audit_ceiling", "gaussian_pair_epsilon",
           "run_canary_audit", "audit_scores", "EPSILON_CAP", "PAIRS"]

EPSILON_CAP = 50.0
"""Estimates are capped here (the two fitted Gaussians are then practically disjoint)."""

PAIRS = ("auto", "negated", "absent")
"""World B's canary: auto = the accounted adjacency's worst case (fixed: negated, poisson: absent)."""

GRID = 20
"""Score grid: GRID steps per noise std of the score (a fixed threshold set for the bound)."""


class AuditInputError(ValueError):
    """An audit configuration or score sample that cannot give an estimate."""


@dataclass(frozen=True)
class AuditConfig:
    """One audited point; defaults are a small CI-sized audit."""

    dim: int = 1000
    """Dimension of the canary (the digits MLP has 4,810 parameters); the score does not depend on it."""
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
    """Independent trials, each one run of world A and one of world B."""
    delta: float = 1e-5
    seed: int = 0
    confidence: float = 0.95
    """Level of the one-sided lower bound ``epsilon_lower``."""
    pair: str = "auto"
    """See ``PAIRS``; ``absent`` under ``fixed`` is the old, weaker probe (for comparison only)."""


@dataclass(frozen=True)
class AuditResult:
    epsilon: float
    """Point estimate (equal-variance Gaussian fit)."""
    inserted_mean: float
    """World A's mean score (units of C on the sum)."""
    null_mean: float
    """World B's mean score."""
    null_std: float
    """World B's score std."""
    trials: int
    epsilon_lower: float = 0.0
    """One-sided Clopper–Pearson lower bound at ``confidence`` (0 = the scores prove nothing)."""
    confidence: float = 0.95
    pair: str = "negated"
    epsilon_ceiling: float = math.inf
    """The most ``epsilon_lower`` could have been with these trials and thresholds, whatever the
    scores (``audit_ceiling``): an accountant's ε above it cannot be refuted by this audit."""

    def fails(self, accountant_epsilon: float) -> bool:
        """True when the lower bound proves more ε than the accountant reports (a bug)."""
        return self.epsilon_lower > accountant_epsilon


def _pair(cfg: AuditConfig) -> str:
    if cfg.pair not in PAIRS:
        raise AuditInputError(f"pair must be one of {PAIRS}, not {cfg.pair!r}")
    if cfg.pair != "auto":
        return cfg.pair
    return "negated" if cfg.sampling == "fixed" else "absent"


def _sampler(cfg: AuditConfig, rng: np.random.Generator):
    """fedkv's sampler, seeded from the audit's seed; bounds off (min 0, no max): the accountant
    assumes no skipped or redrawn rounds."""
    from federation.sampling import ClientSampler

    if cfg.sampling not in ("fixed", "poisson"):
        raise AuditInputError(f"sampling must be fixed or poisson, not {cfg.sampling!r}")
    return ClientSampler(cfg.sampling, cfg.fraction, min_clients=0, max_clients=None,
                         seed=int(rng.integers(2**63)))


def _denominator(cfg: AuditConfig, sampler) -> float:
    """The fixed denominator: k (fixed), the expected count q·N rounded, >= 1 (poisson)."""
    if cfg.sampling == "fixed":
        return float(sampler.fixed_size(cfg.population))
    return float(max(1, round(cfg.fraction * cfg.population)))


def _world(cfg: AuditConfig, sign: float, norm: float, sampler, rng: np.random.Generator) -> np.ndarray:
    """Per trial: the projection on x/‖x‖ of Σ_rounds (canary·sign if sampled + noise shares),
    in units of C (the fixed denominator divided out: a public constant changes no test)."""
    nodes = list(range(cfg.population))  # the canary is node 0
    score = np.zeros(cfg.trials)
    for _ in range(cfg.rounds):
        drawn = [sampler.sample(nodes) for _ in range(cfg.trials)]
        m = np.fromiter((len(s) for s in drawn), dtype=np.int64, count=cfg.trials)
        has = np.fromiter((bool(s) and s[0] == 0 for s in drawn), dtype=bool, count=cfg.trials)
        score += sign * norm * has
        if cfg.sigma > 0:
            for size in np.unique(m):
                idx = np.flatnonzero(m == size)
                for _ in range(max(int(size), 1)):  # an empty round: the server's noise alone
                    score[idx] += gaussian_noise(idx.size, cfg.sigma, cfg.clip_norm, "distributed",
                                                 max(int(size), 1), rng)
    return score / cfg.clip_norm


def audit_scores(cfg: AuditConfig) -> tuple[np.ndarray, np.ndarray]:
    """(world A scores, world B scores), ``cfg.trials`` each."""
    if cfg.trials < 20 or cfg.dim < 2 or cfg.rounds < 1 or not 0 < cfg.fraction <= 1:
        raise AuditInputError("need trials >= 20, dim >= 2, rounds >= 1, fraction in (0, 1]")
    if cfg.sigma < 0:
        raise AuditInputError("sigma must be >= 0")
    if not 0 < cfg.confidence < 1:
        raise AuditInputError(f"confidence must be in (0, 1), not {cfg.confidence}")
    pair = _pair(cfg)
    rng = np.random.default_rng(cfg.seed)
    sampler = _sampler(cfg, rng)
    v = rng.standard_normal(cfg.dim)
    canary = clip_update(v / np.linalg.norm(v) * cfg.clip_norm, cfg.clip_norm).clipped
    norm = float(np.linalg.norm(canary))  # its projection on its own direction
    a = _world(cfg, +1.0, norm, sampler, rng)
    b = _world(cfg, -1.0 if pair == "negated" else 0.0, norm, sampler, rng)
    return a, b


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


def audit_ceiling(trials: int, thresholds: int = 1, delta: float = 0.0, confidence: float = 0.95) -> float:
    """The largest ``epsilon_lower`` any scores of ``trials`` per world can give when the bound
    scans ``thresholds`` thresholds: the two worlds perfectly apart, TPR n/n and FPR 0/n. Each
    Clopper–Pearson bound is at level a = (1 − confidence)/(4K) (``experiments.lira``: α split
    over the thresholds of both tests), so TPR >= p and FPR <= 1 − p with p = a^(1/n), and the
    ceiling is ln((p − δ)/(1 − p)) ≈ ln n − ln ln(1/a) = ln n − ln ln(4K/(1 − confidence)).
    It grows like ln n: a larger ε is out of reach of n trials, whatever the mechanism."""
    if trials < 1 or thresholds < 1 or not 0 < confidence < 1 or not 0 <= delta < 1:
        raise AuditInputError("need trials >= 1, thresholds >= 1, confidence in (0, 1), delta in [0, 1)")
    each = (1 - confidence) / (4 * thresholds)
    p = math.exp(math.log(each) / trials)
    return math.log((p - delta) / -math.expm1(math.log(each) / trials)) if p > delta else 0.0


def run_canary_audit(cfg: AuditConfig) -> AuditResult:
    """Point estimate and lower bound of ``cfg``'s client-level ε (see the module docstring)."""
    from experiments.lira import epsilon_lower_bound

    a, b = audit_scores(cfg)
    mean_a, mean_b, s_b = float(a.mean()), float(b.mean()), float(b.std(ddof=1))
    if s_b > 0:
        eps = gaussian_pair_epsilon(mean_b, s_b, mean_a, s_b, cfg.delta)
    else:  # no noise and no sampling variance: the worlds are point masses
        eps = EPSILON_CAP if mean_a != mean_b else 0.0
    # a fixed grid (GRID steps per noise std of the score) bounds the number of thresholds
    step = (cfg.sigma * math.sqrt(cfg.rounds) if cfg.sigma > 0 else 1.0) / GRID
    scores = np.round(np.r_[a, b] / step)
    labels = np.r_[np.ones(a.size, bool), np.zeros(b.size, bool)]
    lower = epsilon_lower_bound(labels, scores, cfg.delta, alpha=(1 - cfg.confidence) / 2)
    ceiling = audit_ceiling(cfg.trials, np.unique(scores).size, cfg.delta, cfg.confidence)
    return AuditResult(eps, mean_a, mean_b, s_b, cfg.trials, float(min(lower, EPSILON_CAP)), cfg.confidence,
                       _pair(cfg), ceiling)
