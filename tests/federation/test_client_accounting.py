"""federation.client_accounting: each sampler's ε against Opacus or dp-accounting directly, the
replace-one sensitivity (σ/2), and bad input."""

from __future__ import annotations

import math

import pytest

from crypto import PrivacyAccountant
from federation.client_accounting import ClientAccountant, sigma_for_epsilon
from crypto.errors import ParameterError

pytest.importorskip("dp_accounting")


def _eps(sampling: str, population: int, sigma: float, k: int, rounds: int, delta: float = 1e-5) -> ClientAccountant:
    acc = ClientAccountant(sampling, population, delta)
    acc.step(sigma, k, rounds)
    return acc


@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.1, 25), (0.8, 0.05, 100), (2.0, 0.5, 10)])
def test_poisson_matches_opacus(sigma: float, q: float, steps: int) -> None:
    population = 1000
    ours = _eps("poisson", population, sigma, round(q * population), steps).epsilon()
    opacus = PrivacyAccountant("rdp")
    opacus.step(sigma, q, steps)
    assert ours == pytest.approx(opacus.epsilon(1e-5), rel=0.01)


def test_fixed_is_dp_accounting_without_replacement_at_half_sigma() -> None:
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant
    from dp_accounting.privacy_accountant import NeighboringRelation

    direct = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    direct.compose(dp_event.SampledWithoutReplacementDpEvent(100, 10, dp_event.GaussianDpEvent(0.5)), 20)
    ours = _eps("fixed", 100, 1.0, 10, 20)
    assert ours.epsilon() == pytest.approx(min(direct.get_epsilon(1e-5), ours.epsilon_no_amplification()))
    assert ours.epsilon() < ours.epsilon_no_amplification()


def test_fixed_at_q1_is_the_gaussian_with_replace_one_sensitivity() -> None:
    """Everyone sampled: no amplification; the sum moves by 2C under replace-one, so σ counts as σ/2."""
    ours = _eps("fixed", 10, 2.0, 10, 5)
    opacus = PrivacyAccountant("rdp")
    opacus.step(1.0, 1.0, 5)
    assert ours.epsilon() == pytest.approx(opacus.epsilon(1e-5), rel=1e-3)
    assert ours.epsilon_no_amplification() == pytest.approx(ours.epsilon())


def test_poisson_no_amplification_is_the_plain_gaussian() -> None:
    ours = _eps("poisson", 100, 1.5, 10, 8)
    opacus = PrivacyAccountant("rdp")
    opacus.step(1.5, 1.0, 8)
    assert ours.epsilon_no_amplification() == pytest.approx(opacus.epsilon(1e-5), rel=1e-3)
    assert ours.epsilon() < ours.epsilon_no_amplification() / 3


def test_sigma_for_epsilon_reaches_the_target() -> None:
    for sampling in ("poisson", "fixed"):
        sigma = sigma_for_epsilon(4.0, sampling, 50, 10, 6, 1e-5)
        eps = _eps(sampling, 50, sigma, 10, 6).epsilon()
        assert 3.9 < eps <= 4.0, (sampling, sigma, eps)
    assert _eps("fixed", 10, 1.0, 1, 1).steps == 1
    assert ClientAccountant("fixed", 10, 1e-5).epsilon() == 0.0


def test_bad_input() -> None:
    with pytest.raises(ParameterError, match="client sampling"):
        ClientAccountant("uniform", 10, 1e-5)
    with pytest.raises(ParameterError, match="population"):
        ClientAccountant("fixed", 0, 1e-5)
    with pytest.raises(ParameterError, match="delta"):
        ClientAccountant("fixed", 10, 1.0)
    acc = ClientAccountant("poisson", 10, 1e-5)
    with pytest.raises(ParameterError, match="sigma"):
        acc.step(0.0, 2)
    with pytest.raises(ParameterError, match="sample_size"):
        acc.step(1.0, 11)
    with pytest.raises(ParameterError, match="target"):
        sigma_for_epsilon(math.inf, "fixed", 10, 2, 1, 1e-5)
    assert acc.steps == 0 and acc.epsilon() == 0.0  # nothing was composed by the refused steps
