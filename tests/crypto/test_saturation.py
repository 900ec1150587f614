"""crypto.dp.saturation: the saturation bound against Monte Carlo, and the range it sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from crypto import (
    SATURATION_DELTA_SHARE,
    PackingConfig,
    UpdateEncryptor,
    delta_total,
    dp_clip_range,
    make_secret_context,
    saturation_budget,
    saturation_delta,
)
from crypto.dp.dither import dither
from crypto.errors import ParameterError
from crypto.packing import saturate
from crypto.dp.privacy import MEANINGFUL_EPSILON

TRIALS = 20_000


def _any_saturated(x: np.ndarray, share_std: float, clip_range: float, rng: np.random.Generator) -> float:
    """Fraction of trials in which some coordinate of some contribution (rows of x) saturates."""
    y = x[None] + rng.normal(0.0, share_std, size=(TRIALS, *x.shape))
    return float(np.mean((np.abs(y) > clip_range).reshape(TRIALS, -1).any(axis=1)))


def test_bound_holds_and_is_tight_at_the_worst_case_update() -> None:
    rng = np.random.default_rng(1)
    c, s, r, dim, contributions = 1.0, 0.5, 2.0, 10, 2
    worst = np.full((contributions, dim), c)  # every coordinate at the clip norm: the largest p
    freq = _any_saturated(worst, s, r, rng)
    bound = saturation_delta(r, c, s, dim, contributions, rounds=1)
    sd = math.sqrt(freq * (1 - freq) / TRIALS)
    assert freq > 0.3  # measurable
    assert freq <= bound + 4 * sd and bound <= 3 * freq  # valid and not vacuous (measured ratio ~1.2)


def test_bound_holds_for_updates_inside_the_clip_ball() -> None:
    rng = np.random.default_rng(2)
    c, s, r, dim = 1.0, 0.3, 1.6, 8
    x = rng.uniform(-c, c, size=(3, dim))
    freq = _any_saturated(x, s, r, rng)
    assert freq <= saturation_delta(r, c, s, dim, 3, 1) + 4 * math.sqrt(max(freq, 1e-4) / TRIALS)


def test_a_pure_noise_contribution_of_m_shares_at_range_m_r_is_covered() -> None:
    rng = np.random.default_rng(3)
    c, s, r, m = 1.0, 1.0, 1.15, 3
    z = rng.normal(0.0, s * math.sqrt(m), size=200_000)
    freq = float(np.mean(np.abs(z) > m * r))
    assert freq == pytest.approx(2 * norm.sf(math.sqrt(m) * r / s), rel=0.15)
    assert freq <= saturation_delta(r, c, s, 1, 1, 1)


def test_rounds_and_contributions_multiply_the_union_bound() -> None:
    one = saturation_delta(2.0, 1.0, 0.2, 100, 1, 1)
    assert saturation_delta(2.0, 1.0, 0.2, 100, 4, 5) == pytest.approx(20 * one, rel=1e-12)
    assert saturation_delta(0.5, 1.0, 0.2, 100, 4, 5) == 1.0  # capped


def test_tiny_bounds_do_not_underflow_to_zero() -> None:
    d = saturation_delta(1.0 + 30 * 0.1, 1.0, 0.1, 4810, 32, 25)  # Φ̄(30) ~ 5e-198
    assert 0 < d < 1e-190
    assert math.log(d) == pytest.approx(float(norm.logsf(30)) + math.log(4810 * 32 * 25), rel=1e-9)


def test_no_noise_saturates_only_below_the_clip_norm() -> None:
    assert saturation_delta(1.0, 1.0, 0.0, 10, 2, 3) == 0.0
    assert saturation_delta(0.99, 1.0, 0.0, 10, 2, 3) == 1.0
    assert dp_clip_range(1.0, 0.0, 10, 2, 3, 1e-9) == 1.0


@pytest.mark.parametrize("s,dim,contributions,rounds,budget", [
    (0.235, 4810, 32, 25, 4.5e-12), (0.0141, 100_000, 32, 5, 4.5e-12), (2.0, 3, 1, 1, 0.1), (1e-3, 1, 1, 1, 0.5),
])
def test_dp_clip_range_is_the_smallest_range_meeting_the_budget(s, dim, contributions, rounds, budget) -> None:
    r = dp_clip_range(1.0, s, dim, contributions, rounds, budget)
    assert saturation_delta(r, 1.0, s, dim, contributions, rounds) <= budget
    assert saturation_delta(r * (1 - 1e-6), 1.0, s, dim, contributions, rounds) > budget
    assert r > 1.0


def test_budget_and_delta_total() -> None:
    b = saturation_budget(1e-5)
    assert b == pytest.approx(SATURATION_DELTA_SHARE * 1e-5 / (1 + math.exp(MEANINGFUL_EPSILON)))
    # at any claimable ε the reported δ grows by at most the share
    assert delta_total(1e-5, MEANINGFUL_EPSILON, b) == pytest.approx(1e-5 * (1 + SATURATION_DELTA_SHARE))
    assert delta_total(1e-5, 1.0, b) < 1e-5 * (1 + SATURATION_DELTA_SHARE)
    assert delta_total(1e-5, math.inf, b) == 1.0 and delta_total(1e-5, math.inf, 0.0) == 1e-5
    assert delta_total(1e-5, math.nan, b) == 1.0


@pytest.mark.parametrize("call", [
    lambda: saturation_delta(0.0, 1.0, 0.1, 1, 1, 1),
    lambda: saturation_delta(1.0, -1.0, 0.1, 1, 1, 1),
    lambda: saturation_delta(1.0, 1.0, math.nan, 1, 1, 1),
    lambda: saturation_delta(1.0, 1.0, 0.1, 0, 1, 1),
    lambda: saturation_delta(1.0, 1.0, 0.1, 1, 1.5, 1),
    lambda: saturation_delta(1.0, 1.0, 0.1, 1, 1, True),
    lambda: dp_clip_range(1.0, 0.1, 1, 1, 1, 0.0),
    lambda: dp_clip_range(1.0, 0.1, 1, 1, 1, 1.0),
    lambda: dp_clip_range(1.0, 0.1, 10**6, 10**6, 10**6, 1e-290),
    lambda: saturation_budget(0.0),
    lambda: delta_total(1e-5, 1.0, 2.0),
])
def test_bad_arguments_raise_parameter_error(call) -> None:
    with pytest.raises(ParameterError):
        call()


def test_worst_case_update_through_the_encryptor_saturates_only_below_the_derived_range() -> None:
    """All of the norm in one coordinate (= C) plus a distributed share, through the real
    encryptor (the digits setting): never saturates at dp_clip_range's R; the old heuristic range
    (4 share std and 12 signal RMS: 0.956 < C) saturates it in about 2 trials of 3."""
    c, s, dim, trials = 1.0, 1.33 / math.sqrt(32), 4810, 100
    r = dp_clip_range(c, s, dim, 32, 25, saturation_budget(1e-5))
    heuristic = min(math.hypot(4 * s, 12 * c / math.sqrt(dim)), c + 4 * s)
    ctx, rng = make_secret_context(), np.random.default_rng(4)
    update = np.zeros(dim)
    update[0] = c
    counts = {}
    for name, rng_range in (("derived", r), ("heuristic", heuristic)):
        enc = UpdateEncryptor(ctx, PackingConfig(clip_range=float(rng_range), dither=True))
        for t in range(trials):
            u = dither(ctx.dither_key, 1, t, 0, "n", 1, dim)
            enc.encrypt(update, 1.0, noise=rng.normal(0.0, s, dim), dither=u)
        counts[name] = enc.total_saturated
    assert counts["derived"] == 0
    assert heuristic < c and counts["heuristic"] > trials / 3  # P(C + N(0, s) > 0.956) ≈ 0.57


def test_saturate_is_what_the_bound_counts() -> None:
    y, n = saturate(np.array([0.5, -2.0, 2.0, 1.0]), 1.0)
    assert n == 2 and y.tolist() == [0.5, -1.0, 1.0, 1.0]
