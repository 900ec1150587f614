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
