"""How often the packed encoding saturates a DP contribution, and the range that makes it rare.

Why: under dp-mode distributed the released sum is the accounted Gaussian mechanism only while
no contribution's coordinate is clipped to the public range ±R (``crypto.packing.saturate``).
``crypto.dp.privacy`` (section "Saturation: the coupling bound") shows that a run whose
saturation event has probability at most δ_sat is (ε, δ + (1 + e^ε)·δ_sat)-DP. This module
computes δ_sat for a range, and the smallest range whose δ_sat fits a budget.

The per-coordinate bound: an L2-clipped update has every coordinate |x| <= C, and a contribution
adds independent N(0, s²) noise, so ``P(|x + Z| > R) = Φ̄((R - x)/s) + Φ̄((R + x)/s)``, which grows
with |x| and is largest at |x| = C: ``p(R) = Φ̄((R - C)/s) + Φ̄((R + C)/s) <= 2·Φ̄((R - C)/s)``.
A pure-noise contribution of m shares (std s·√m, range m·R) saturates with probability
``2·Φ̄(√m·R/s) <= p(R)``, so the same bound covers it. The union bound over ``dim`` coordinates,
``contributions`` per round and ``rounds`` gives ``δ_sat = dim · contributions · rounds · p(R)``.
Computed in log space (``scipy.stats.norm.logsf``) so a tiny δ_sat is not rounded to 0.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm

from crypto.errors import ParameterError
from crypto.dp.privacy import MEANINGFUL_EPSILON

__all__ = ["SATURATION_DELTA_SHARE", "saturation_delta", "dp_clip_range", "saturation_budget", "delta_total"]

SATURATION_DELTA_SHARE = 0.01
"""The share of δ a derived range may add: with δ_sat <= 0.01·δ / (1 + e^MEANINGFUL_EPSILON) the
reported δ grows by at most 1 % at any ε a run may claim (ε <= ``MEANINGFUL_EPSILON``)."""

_BISECTION_STEPS = 200
"""Far more than needed: the interval shrinks to one float ulp in ~60 steps."""


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ParameterError(f"{name} must be finite and > 0, not {value!r}")


def _check_count(name: str, value: int) -> None:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
        raise ParameterError(f"{name} must be an int >= 1, not {value!r}")


def _check_common(clip_norm: float, share_std: float, dim: int, contributions: int, rounds: int) -> None:
    _check_positive("clip_norm", clip_norm)
    if not (isinstance(share_std, (int, float)) and math.isfinite(share_std) and share_std >= 0):
        raise ParameterError(f"share_std must be finite and >= 0, not {share_std!r}")
    _check_count("dim", dim)
    _check_count("contributions", contributions)
    _check_count("rounds", rounds)


def _log_coordinate_probability(clip_range: float, clip_norm: float, share_std: float) -> float:
    """log p(R): the largest probability that one coordinate of one contribution saturates."""
    if share_std == 0:
        return 0.0 if clip_range < clip_norm else -math.inf
    upper = norm.logsf((clip_range - clip_norm) / share_std)
    lower = norm.logsf((clip_range + clip_norm) / share_std)
    return float(np.logaddexp(upper, lower))


def saturation_delta(
    clip_range: float, clip_norm: float, share_std: float, dim: int, contributions: int, rounds: int
) -> float:
    """δ_sat: a bound on P(some coordinate of some contribution in some round saturates).

    clip_range R, clip_norm C (L2 clip of every update), share_std s (per-coordinate noise std of
    the noisiest contribution a round can hold), dim values per update, at most `contributions`
    per round, `rounds` rounds. Capped at 1; 0.0 only when the bound underflows below ~1e-308.
    """
    _check_positive("clip_range", clip_range)
    _check_common(clip_norm, share_std, dim, contributions, rounds)
    log_p = _log_coordinate_probability(float(clip_range), float(clip_norm), float(share_std))
    log_total = log_p + math.log(dim) + math.log(contributions) + math.log(rounds)
    return math.exp(min(log_total, 0.0))


def dp_clip_range(
    clip_norm: float, share_std: float, dim: int, contributions: int, rounds: int, budget: float
) -> float:
    """The smallest R with ``saturation_delta(R, ...) <= budget`` (bisection in log space).

    Bracket: R_lo = C + s·Φ̄⁻¹(b) is too small (p(R_lo) > b, b = budget / (dim·contributions·
    rounds)) and R_hi = C + s·Φ̄⁻¹(b/2) is enough (p <= 2·Φ̄ = b). With s = 0 it is C exactly.
    """
    _check_common(clip_norm, share_std, dim, contributions, rounds)
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and 0 < budget < 1):
        raise ParameterError(f"budget must be in (0, 1), not {budget!r}")
    if share_std == 0:
        return float(clip_norm)
    log_b = math.log(budget) - math.log(dim) - math.log(contributions) - math.log(rounds)
    if log_b < math.log(1e-300):
        raise ParameterError(f"budget {budget:g} over {dim * contributions * rounds} coordinates is below 1e-300")
    b = math.exp(log_b)
    lo = clip_norm + share_std * float(norm.isf(b))
    hi = clip_norm + share_std * float(norm.isf(b / 2))
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _log_coordinate_probability(mid, clip_norm, share_std) <= log_b:
            hi = mid
        else:
            lo = mid
    return float(hi)


def saturation_budget(target_delta: float, share: float = SATURATION_DELTA_SHARE) -> float:
    """δ_sat a derived packing range is sized for: ``share · δ / (1 + e^MEANINGFUL_EPSILON)``."""
    if not (math.isfinite(target_delta) and 0 < target_delta < 1):
        raise ParameterError(f"target_delta must be in (0, 1), not {target_delta!r}")
    if not (math.isfinite(share) and 0 < share <= 1):
        raise ParameterError(f"share must be in (0, 1], not {share!r}")
    return share * target_delta / (1.0 + math.exp(MEANINGFUL_EPSILON))


def delta_total(delta: float, epsilon: float, delta_sat: float) -> float:
    """δ of what runs, ``δ + (1 + e^ε)·δ_sat`` (``crypto.dp.privacy``, the coupling bound); 1 when
    ε is infinite or not accounted and δ_sat > 0 (no finite guarantee), capped at 1."""
    if not (0 <= delta_sat <= 1 and 0 <= delta <= 1):
        raise ParameterError(f"delta={delta!r} and delta_sat={delta_sat!r} must be in [0, 1]")
    if delta_sat == 0:
        return float(delta)
    if math.isnan(epsilon) or epsilon > 700:  # e^ε overflows; the bound is vacuous anyway
        return 1.0
    return min(1.0, delta + (1.0 + math.exp(epsilon)) * delta_sat)
