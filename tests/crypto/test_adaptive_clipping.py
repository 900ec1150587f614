"""crypto.dp.adaptive_clipping: Andrew et al.'s split of σ and the norm update, as arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crypto import AdaptiveClipping
from crypto.errors import ParameterError


def test_update_noise_matches_flowers_split() -> None:
    """The same z_Δ Flower 1.42 computes for its adaptive wrapper (one formula, two places)."""
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    for z, sb in [(1.33, 1.6), (0.8, 0.5), (3.0, 2.0)]:
        _, flower = compute_adaptive_noise_params(z, 20.0, sb)
        assert AdaptiveClipping(z, sb).update_noise_multiplier == pytest.approx(flower, rel=1e-12)


def test_the_joint_release_is_a_gaussian_at_the_charged_multiplier() -> None:
    """[Δ/C, a(b−½)] has L2 sensitivity sqrt(1 + a²/4); with noise z_Δ on every coordinate its
    noise multiplier is exactly z, the one the accountant charges."""
    for z, sb in [(1.33, 1.6), (0.7, 2.0), (5.0, 2.6)]:
        ac = AdaptiveClipping(z, sb)
        sensitivity = math.hypot(1.0, ac.count_scale / 2)
        assert ac.update_noise_multiplier / sensitivity == pytest.approx(z, rel=1e-12)
        # and the count coordinate's noise, read back in count units, is σ_b
        assert ac.update_noise_multiplier / ac.count_scale == pytest.approx(sb, rel=1e-12)


def test_count_round_trip_without_noise() -> None:
    ac = AdaptiveClipping(0.0, 1.0)
    bits = [True, False, True, True, False, True, True]
    total = sum(ac.count_coordinate(b) for b in bits)
    assert ac.unclipped_fraction(total, len(bits), len(bits)) == pytest.approx(5 / 7)
    # a fixed denominator (Poisson: q·N) divides the same count by the expected size
    assert ac.unclipped_fraction(total, len(bits), 10.0) == pytest.approx(0.5)


def test_noisy_count_has_std_sigma_b() -> None:
    ac = AdaptiveClipping(1.33, 1.6)
    rng = np.random.default_rng(0)
    n, trials = 20, 20000
    shares = rng.normal(0.0, ac.update_noise_multiplier / math.sqrt(n), size=(trials, n)).sum(axis=1)
    coords = n * ac.count_coordinate(True) + shares
    fractions = np.array([ac.unclipped_fraction(c, n, n) for c in coords])
    assert fractions.mean() == pytest.approx(1.0, abs=0.01)
    assert (fractions * n).std() == pytest.approx(1.6, rel=0.03)


def test_norm_moves_towards_the_target_quantile() -> None:
    ac = AdaptiveClipping(0.0, 1.0, target_quantile=0.5, learning_rate=0.2)
    assert ac.next_clip_norm(1.0, 0.0) == pytest.approx(math.exp(0.1))  # all clipped: grow
    assert ac.next_clip_norm(1.0, 1.0) == pytest.approx(math.exp(-0.1))  # none clipped: shrink
    assert ac.next_clip_norm(2.0, 0.5) == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs", [
    {"noise_multiplier": -1.0, "count_stddev": 1.0},
    {"noise_multiplier": 1.0, "count_stddev": 0.0},
    {"noise_multiplier": 2.0, "count_stddev": 1.0},  # σ_b must exceed z/2
    {"noise_multiplier": 1.0, "count_stddev": 1.0, "target_quantile": 1.0},
    {"noise_multiplier": 1.0, "count_stddev": 1.0, "learning_rate": math.nan},
])
def test_bad_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ParameterError):
        AdaptiveClipping(**kwargs)


def test_bad_inputs_are_refused() -> None:
    ac = AdaptiveClipping(1.0, 1.0)
    with pytest.raises(ParameterError):
        ac.unclipped_fraction(math.nan, 3, 3)
    with pytest.raises(ParameterError):
        ac.unclipped_fraction(0.0, 3, 0)
    with pytest.raises(ParameterError):
        ac.next_clip_norm(0.0, 0.5)
