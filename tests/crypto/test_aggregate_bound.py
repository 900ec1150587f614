"""crypto.aggregate_bound: honest aggregates stay inside the public bound, crafted ones do not.

* the tail bound itself, on the three kinds of error it is applied to (Gaussian noise, dithered
  and stochastic rounding), at a β large enough to count exceedances;
* Monte Carlo with the real encoder (encrypt -> aggregate -> decrypt) in each dp-mode's regime, at
  the worst honest signal (every update of norm exactly C, all in one direction): no trial comes
  near the bound; one node's update of every coordinate at +R (issue 20) is far beyond it;
* the decrypted header against the manifest.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from crypto import AggregateDecryptor, CkksAggregator, PackingConfig, UpdateEncryptor
from crypto.aggregate_bound import BETA, MeanBound, norm_tail
from crypto.errors import ParameterError
from crypto.dp.saturation import dp_clip_range

DIM = 2000
C = 1.0


# --- the tail bound ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gaussian", "dither", "stochastic"])
def test_the_tail_bound_holds_for_each_error_at_a_countable_beta(kind) -> None:
    """‖V‖ <= √v(√d + √(2 ln 1/β)) fails with probability <= β: checked at β = 0.05 (d = 6, 40,000
    draws), for a Gaussian (v = s²), a subtractive-dither error (uniform on a step, v = step²/12)
    and a stochastic-rounding error (two points a step apart, v = step²/4, at the worst p = ½),
    each summed over 5 summands."""
    rng = np.random.default_rng(7)
    d, trials, summands, beta, step = 6, 40_000, 5, 0.05, 0.3
    if kind == "gaussian":
        draws = rng.normal(0.0, 0.7, (trials, summands, d))
        v = summands * 0.7**2
    elif kind == "dither":
        draws = rng.uniform(-step / 2, step / 2, (trials, summands, d))
        v = summands * step**2 / 12
    else:
        draws = step * (rng.random((trials, summands, d)) < 0.5) - step / 2
        v = summands * step**2 / 4
    norms = np.linalg.norm(draws.sum(axis=1), axis=1)
    rate = float(np.mean(norms > norm_tail(v, d, beta)))
    assert rate <= beta / 4, rate  # the bound is conservative: far fewer than β


def test_the_tail_bound_at_beta_1e_9_is_close_to_the_norms_own_scale() -> None:
    """At β = 1e-9 the allowance is √v·(√d + 6.44): 9 % above √(v·d) at d = 4810 (digits)."""
    assert norm_tail(1.0, 4810) / math.sqrt(4810) == pytest.approx(1 + math.sqrt(2 * math.log(1e9)) / math.sqrt(4810))
    assert norm_tail(1.0, 4810) / math.sqrt(4810) < 1.1
    with pytest.raises(ParameterError):
        norm_tail(-1.0, 10)


# --- Monte Carlo with the real encoder ---------------------------------------------------------


def _worst_signal() -> np.ndarray:
    """Norm exactly C, every coordinate C/√d: all updates point the same way (the mean of clipped
    updates has norm C, the most it can) and nothing saturates."""
    return np.full(DIM, C / math.sqrt(DIM))


def _run(secret_ctx, packing: PackingConfig, bound: MeanBound, trials: int, n: int, *, noise_std: float = 0.0,
         weights=None, noise_replies: int = 0, carry: bool = False, crafted: bool = False) -> list[bool | float]:
    """``trials`` aggregates of n updates (+ noise replies), decrypted; for each, ‖mean‖ / B (or
    whether the bound admits it, when one update is the crafted one)."""
    rng = np.random.default_rng(11)
    encs = [UpdateEncryptor(secret_ctx, packing) for _ in range(n + noise_replies)]
    dec = AggregateDecryptor(secret_ctx, packing)
    carries = [None] * n
    out: list[bool | float] = []
    for _ in range(trials):
        agg = CkksAggregator(secret_ctx.public_bytes(), packing, expected_values=DIM)
        total = np.zeros(DIM)
        w_norm = []
        for i in range(n):
            u = rng.random(DIM) if packing.dither else None
            w = float(weights[i]) if weights is not None else 1.0
            w_norm.append(w / packing.max_weight)
            vec = np.full(DIM, packing.clip_range) if (crafted and i == 0) else _worst_signal()
            z = rng.normal(0.0, noise_std, DIM) if noise_std else None
            agg.add(encs[i].encrypt(vec, w, noise=z, dither=u, carry=carries[i] if carry else None))
            carries[i] = encs[i].last_residual
            if u is not None:
                total += u - 0.5
        for j in range(noise_replies):
            u = rng.random(DIM) if packing.dither else None
            z = rng.normal(0.0, noise_std, DIM)
            agg.add(encs[n + j].encrypt(np.zeros(DIM), 0.0, noise=z, dither=u))
            if u is not None:
                total += u - 0.5
        result = dec.decrypt(agg.result(), dither_total=total if packing.dither else None)
        w_sum = result.weight_sum / packing.max_weight
        assert w_sum == pytest.approx(sum(w_norm), abs=1e-4)
        j_all = n + noise_replies
        if crafted:
            out.append(bound.admits(result.mean, n, j_all, w_sum, result.contributions))
        else:
            assert bound.admits(result.mean, n, j_all, w_sum, result.contributions)
            out.append(float(np.linalg.norm(result.mean)) / bound.radius(n, j_all, w_sum))
    return out


def _distributed(n_sampled: int, sigma: float) -> tuple[PackingConfig, MeanBound, float]:
    share = sigma * C / math.sqrt(n_sampled)
    r = dp_clip_range(C, share, DIM, 32, 1, 1e-9)
    packing = PackingConfig(clip_range=float(f"{r:.6g}") * 1.000001, dither=True)
    bound = MeanBound(DIM, C, shared_noise_var=(sigma * C) ** 2, rounding_proxy=packing.step**2 / 12,
                      noise_replies=True)
    return packing, bound, share


def test_honest_distributed_aggregates_stay_inside_the_bound(secret_ctx) -> None:
    """dp-mode distributed: 4 updates with dithered rounding and their shares of σC, all at norm
    C in one direction; and 3 updates plus a noise reply for the node that left."""
    packing, bound, share = _distributed(4, 0.5)
    ratios = _run(secret_ctx, packing, bound, 40, 4, noise_std=share)
    ratios += _run(secret_ctx, packing, bound, 20, 3, noise_std=share, noise_replies=1)
    assert max(ratios) < 0.9, max(ratios)


def test_honest_local_aggregates_with_error_feedback_stay_inside_the_bound(secret_ctx) -> None:
    """dp-mode local: 3 updates each with N(0, (σC)²), stochastic rounding, and each node's carry
    from its previous round (the trials follow each other like rounds)."""
    sigma = 0.3
    r = dp_clip_range(C, sigma * C, DIM, 32, 1, 1e-9)
    packing = PackingConfig(clip_range=float(f"{r:.6g}") * 1.000001)
    bound = MeanBound(DIM, C, update_noise_var=(sigma * C) ** 2, rounding_proxy=packing.step**2 / 4,
                      carry_proxy=packing.step**2 / 4)
    ratios = _run(secret_ctx, packing, bound, 40, 3, noise_std=sigma * C, carry=True)
    assert max(ratios) < 0.9, max(ratios)


def test_honest_weighted_aggregates_without_noise_stay_inside_the_bound(secret_ctx) -> None:
    """dp-mode none: weights from 1 to max-weight examples, the heuristic range 12·C/√d, stochastic
    rounding with error feedback, no noise: the mean of clipped updates, within C plus rounding."""
    packing = PackingConfig(clip_range=12 * C / math.sqrt(DIM), max_weight=300.0)
    bound = MeanBound(DIM, C, rounding_proxy=packing.step**2 / 4, carry_proxy=packing.step**2 / 4,
                      unit_weights=False, max_weight=300.0)
    ratios = _run(secret_ctx, packing, bound, 20, 3, weights=[1.0, 40.0, 300.0], carry=True)
    ratios += _run(secret_ctx, packing, bound, 10, 3, weights=[1.0, 1.0, 1.0], carry=True)  # W at its floor
    assert max(ratios) < 1.0, max(ratios)


def test_one_update_at_the_encoders_range_is_refused(secret_ctx) -> None:
    """Issue 20: every coordinate at +R passes the encoder (R per coordinate is its range) and the
    MAC, but its norm is R·√d; the mean of 4 is far beyond B in every trial."""
    packing, bound, share = _distributed(4, 0.5)
    assert _run(secret_ctx, packing, bound, 5, 4, noise_std=share, crafted=True) == [False] * 5


# --- the header against the manifest ------------------------------------------------------------


def test_the_decrypted_header_must_be_the_manifests() -> None:
    dp = MeanBound(10, C, noise_replies=True, max_clients=8)
    assert dp.header_matches(3, 4, 3.0, 5)  # 3 updates, a noise reply of 2 shares
    assert not dp.header_matches(3, 4, 2.0, 5)  # a weight of 0 on an update (or 2 on another)
    assert not dp.header_matches(3, 4, 3.0, 3)  # fewer contributions than summands
    assert not dp.header_matches(3, 4, 3.0, 9)  # more than max-clients
    local = MeanBound(10, C)
    assert local.header_matches(3, 3, 3.0, 3) and not local.header_matches(3, 3, 3.0, 2)
    none = MeanBound(10, C, unit_weights=False, max_weight=100.0)
    assert none.header_matches(2, 2, 0.02, 2) and none.header_matches(2, 2, 2.0, 2)
    assert not none.header_matches(2, 2, 0.019, 2)  # below 1 example each: B would grow as 1/W
    assert not none.header_matches(2, 2, 2.01, 2)
    assert not local.admits(np.full(10, np.nan), 3, 3, 3.0, 3)
    assert BETA == 1e-9
