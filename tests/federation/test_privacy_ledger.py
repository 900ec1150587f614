"""federation.privacy_ledger: the noise each observer does not know, and its ε against
dp-accounting directly (issue 21 item 3: no reported ε held against a node)."""

from __future__ import annotations

import math

import pytest

from federation.privacy_ledger import PrivacyLedger, RoundRelease, observer_sigmas, rounding_delta

pytest.importorskip("dp_accounting")


def _plain_rdp(noise: float, rounds: int, delta: float = 1e-5) -> float:
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(noise), rounds)
    return acc.get_epsilon(delta)


def test_each_observer_sees_the_noise_it_does_not_know() -> None:
    full = RoundRelease(5, {n: 1 for n in range(5)})
    s = observer_sigmas("distributed", True, 2.0, full, colluding=2)
    assert s["third_party"] == s["server"] == pytest.approx(2.0)
    assert s["node"] == pytest.approx(2.0 * math.sqrt(4 / 5))  # σ·sqrt((n-1)/n)
    assert s["colluding"] == pytest.approx(2.0 * math.sqrt(3 / 5))  # σ·sqrt((n-t)/n)


def test_top_up_shares_a_node_made_are_known_to_it() -> None:
    # 3 of 5 survived; node 0 made the 2 missing shares: it knows 3 of the 5
    topped = RoundRelease(5, {0: 3, 1: 1, 2: 1})
    s = observer_sigmas("distributed", True, 1.0, topped, colluding=2)
    assert s["third_party"] == pytest.approx(1.0)
    assert s["node"] == pytest.approx(math.sqrt(2 / 5))
    assert s["colluding"] == pytest.approx(math.sqrt(1 / 5))


def test_without_he_the_server_sees_single_updates_and_local_noise_is_everyones() -> None:
    release = RoundRelease(4, {n: 1 for n in range(3)}, server_shares=1)
    s = observer_sigmas("distributed", False, 1.0, release, colluding=1)
    assert s["server"] == pytest.approx(0.5) and s["third_party"] == pytest.approx(1.0)
    assert s["node"] == pytest.approx(math.sqrt(3 / 4))  # the server's top-up is unknown to nodes
    assert set(observer_sigmas("local", True, 1.5, release, colluding=3).values()) == {1.5}


def test_ledger_matches_dp_accounting_and_knowing_all_noise_is_infinite() -> None:
    ledger = PrivacyLedger("fixed", 10, 1e-5, "distributed", True, colluding=2)
    for _ in range(3):
        ledger.record(RoundRelease(2, {0: 1, 1: 1}), 1.0, sample_size=2)
    eps = ledger.epsilons()
    # fixed sampling is replace-one: sensitivity 2C, so dp-accounting's multiplier is σ/2
    assert eps["server"] == pytest.approx(_plain_rdp(0.5, 3), rel=1e-9)
    assert eps["node"] == pytest.approx(_plain_rdp(0.5 * math.sqrt(1 / 2), 3), rel=1e-9)
    assert eps["colluding"] == math.inf  # both sampled nodes collude: no noise unknown to them
    assert eps["third_party"] < eps["server"] < eps["node"]


def test_rounding_delta_needs_a_share_of_about_one_step() -> None:
    assert rounding_delta(1.0, 1) == pytest.approx(math.exp(-2 * math.pi**2), rel=1e-6)
    assert rounding_delta(2.0, 10**6) < 1e-20
    assert rounding_delta(0.2, 100) == 1.0 and rounding_delta(0.0, 1) == 1.0


def _poisson_pld(sigma: float, q: float, rounds: int, delta: float = 1e-5) -> float:
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    pld = pld_lib.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=1e-4)
    return pld.self_compose(rounds).get_epsilon_for_delta(delta)


def test_a_poisson_window_that_never_binds_costs_nothing_and_one_that_does_is_charged() -> None:
    """``federation.poisson_window``: 1000 nodes, q 0.25, min-clients 1 (a draw of none: 0.75^999)
    is the Poisson-subsampled Gaussian; min-clients 230 (P(m = 229) ~ 9e-3) puts q·6e-3 of
    +∞ loss a round into δ, far above 1e-5, so ε is ∞; 60 nodes, min-clients 2 (P(m = 1) ~ 8e-7)
    costs a little: above the Gaussian, finite."""
    from federation.poisson_window import WindowedPoissonAccountant, window_masses

    def ledger_eps(population: int, lo: int, hi: int | None, rounds: int) -> float:
        ledger = PrivacyLedger("poisson", population, 1e-5, "distributed", True, 1, lo, hi)
        for _ in range(rounds):
            ledger.record(RoundRelease(3, {n: 1 for n in range(3)}), 5.0, sample_rate=0.25)
        return ledger.epsilons()["third_party"]

    gaussian = _poisson_pld(5.0, 0.25, 30)
    assert ledger_eps(1000, 1, None, 30) == pytest.approx(gaussian, rel=1e-3)
    assert ledger_eps(1000, 230, None, 2) == math.inf
    assert ledger_eps(1000, 1, 260, 2) == math.inf  # max-clients 260 (P(m = 260) ~ 0.02) the same way
    assert gaussian * 1.02 < ledger_eps(60, 2, None, 30) < gaussian * 1.2
    everyone = WindowedPoissonAccountant(1e-5, 2)
    everyone.step(2.0, 1.0, 2)  # q = 1, 2 nodes, min-clients 2: the round goes ahead only with the target
    assert everyone.epsilon() == math.inf
    everyone = WindowedPoissonAccountant(1e-5, 2)
    everyone.step(2.0, 1.0, 10, rounds=3)  # q = 1, 10 nodes: the plain Gaussian (μ = 0.5·√3)
    assert everyone.epsilon() == pytest.approx(_poisson_pld(2.0, 1.0, 3), rel=1e-3)
    inner, edge, outside = window_masses(59, 0.25, 2, None)
    assert edge == pytest.approx(59 * 0.25 * 0.75**58) and inner + edge + outside == pytest.approx(1.0)
    with pytest.raises(ValueError, match="min-clients"):
        WindowedPoissonAccountant(1e-5, 3, 2)
    with pytest.raises(ValueError, match="sample_rate"):
        PrivacyLedger("poisson", 10, 1e-5, "distributed", True).record(RoundRelease(1, {0: 1}), 1.0, sample_size=1)
