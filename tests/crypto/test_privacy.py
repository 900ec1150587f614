"""Clipping, noise placement variances (also through the encrypted path), the sample-level (DP-SGD)
accountant, and the client-level ε the main job's run reports."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    NonFiniteUpdateError,
    PackingConfig,
    ParameterError,
    UpdateEncryptor,
    clip_update,
    dp_sgd_epsilon,
    dp_sgd_noise_multiplier,
    gaussian_noise,
    global_l2_norm,
    noise_std,
)
from crypto.dp.privacy import MEANINGFUL_EPSILON, NO_MEANINGFUL_EPSILON, privacy_claim


def test_clip_whole_update_across_tensors() -> None:
    update = {"a": torch.full((3, 4), 1.0), "b": np.full(4, 2.0)}  # norm sqrt(12 + 16) = sqrt(28)
    clipped, norm, was = clip_update(update, 1.0)
    assert was and norm == pytest.approx(math.sqrt(28))
    assert global_l2_norm(clipped) == pytest.approx(1.0)
    assert isinstance(clipped["a"], torch.Tensor) and isinstance(clipped["b"], np.ndarray)
    # direction preserved: every tensor scaled by the same factor
    assert float(clipped["a"][0, 0]) / clipped["b"][0] == pytest.approx(0.5)
    small, norm, was = clip_update(np.array([0.3, 0.4]), 1.0)
    assert not was and norm == pytest.approx(0.5) and small.tolist() == [0.3, 0.4]


def test_clip_rejects_non_finite_and_bad_norm() -> None:
    with pytest.raises(NonFiniteUpdateError):
        clip_update({"a": np.array([1.0, np.nan])}, 1.0)
    with pytest.raises(ParameterError):
        clip_update(np.ones(3), 0.0)


def test_noise_std_per_placement() -> None:
    assert noise_std(2.0, 0.5, "local") == pytest.approx(1.0)
    assert noise_std(2.0, 0.5, "distributed", n_clients=4) == pytest.approx(0.5)
    assert noise_std(2.0, 0.5, "server", n_clients=4, missing=1) == pytest.approx(0.5)
    assert noise_std(2.0, 0.5, "server", n_clients=4, missing=4) == pytest.approx(1.0)
    with pytest.raises(ParameterError):
        noise_std(1.0, 1.0, "everywhere")  # type: ignore[arg-type]
    with pytest.raises(ParameterError):
        noise_std(1.0, 1.0, "server", n_clients=2, missing=3)


def test_noise_variance_plaintext() -> None:
    rng = np.random.default_rng(7)
    sigma, C, n, d = 1.5, 2.0, 8, 200_000
    local = gaussian_noise(d, sigma, C, "local", rng=rng)
    shares = sum(gaussian_noise(d, sigma, C, "distributed", n, rng=rng) for _ in range(n))
    topped = sum(gaussian_noise(d, sigma, C, "distributed", n, rng=rng) for _ in range(5)) + gaussian_noise(
        d, sigma, C, "server", n, rng=rng, missing=3
    )
    for x in (local, shares, topped):  # the aggregate always carries std sigma*C
        assert x.std() == pytest.approx(sigma * C, rel=0.02)
        assert abs(x.mean()) < 5 * sigma * C / math.sqrt(d)


@pytest.mark.parametrize("mode", ["packed", "none"])
def test_distributed_noise_plus_server_top_up_through_encryption(secret_ctx, public_bytes, mode) -> None:
    """6 of 10 clients send zero updates with their shares; the server tops up 4 missing shares.
    The decrypted sum must carry variance (sigma*C)^2 and no bias from the packing offsets."""
    rng = np.random.default_rng(11)
    sigma, C, n, present, d = 1.0, 1.0, 10, 6, 30_000
    share = noise_std(sigma, C, "distributed", n)
    cfg = PackingConfig(mode=mode, clip_range=5 * share, max_clients=n)
    enc = UpdateEncryptor(secret_ctx, cfg, rng=rng)
    agg = CkksAggregator(public_bytes, cfg, rng=np.random.default_rng(12))
    saturated = 0
    for _ in range(present):
        agg.add(enc.encrypt(np.zeros(d), 1.0, noise=gaussian_noise(d, sigma, C, "distributed", n, rng=rng)))
        saturated += enc.last_report.saturated
    saturated += agg.add_noise(share, shares=n - present)
    res = AggregateDecryptor(secret_ctx, cfg).decrypt(agg.result())
    assert res.contributions == n and res.n_updates == present
    total = res.mean * res.weight_sum  # the noisy sum
    assert total.std() == pytest.approx(sigma * C, rel=0.05)
    assert abs(total.mean()) < 5 * sigma * C / math.sqrt(d)
    assert saturated < d * 1e-3  # 5 std range: saturation is rare (and counted)


# -- sample level: the one DP-SGD accountant (node, lira_dp_sgd, privacy_accuracy) -----------------
def test_abadi_example() -> None:
    # Abadi et al. 2016: q = 0.01, sigma = 4, delta = 1e-5, 10,000 steps: eps ~ 1.26 (moments acc.)
    eps = dp_sgd_epsilon(4.0, 0.01, 10_000, 1e-5)
    assert 0.9 <= eps <= 1.26


@pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus' secure-RNG and hook notices
def test_dp_sgd_epsilon_is_what_the_privacy_engine_reports() -> None:
    from opacus import PrivacyEngine

    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0,
    )
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    steps = sum(h[2] for h in engine.accountant.history)
    assert steps > 0 and dp_sgd_epsilon(1.1, 1 / len(loader), steps, 1e-5) == pytest.approx(engine.get_epsilon(1e-5))


def test_dp_sgd_noise_multiplier_reaches_target() -> None:
    sigma = dp_sgd_noise_multiplier(1.0, 1e-5, 0.01, 10_000)
    assert 0.95 <= dp_sgd_epsilon(sigma, 0.01, 10_000, 1e-5) <= 1.0
    assert sigma == pytest.approx(4.2, abs=0.15)


def test_dp_sgd_rejects_bad_input() -> None:
    for args in [(-1.0, 0.1, 1, 1e-5), (1.0, 0.0, 1, 1e-5), (1.0, 1.5, 1, 1e-5), (1.0, 0.1, 1, 0.0)]:
        with pytest.raises(ParameterError):
            dp_sgd_epsilon(*args)
    assert dp_sgd_epsilon(0.0, 0.1, 3, 1e-5) == math.inf and dp_sgd_epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    with pytest.raises(ParameterError):
        dp_sgd_noise_multiplier(math.inf, 1e-5, 0.1, 10)


def test_the_retired_client_level_accountant_is_gone() -> None:
    """Issue 21: every client-level ε is federation.client_accounting's; crypto has none."""
    import crypto
    import crypto.dp.privacy

    for name in ("PrivacyAccountant", "noise_multiplier_for", "rdp_orders", "client_sample_rate"):
        assert not hasattr(crypto, name) and not hasattr(crypto.dp.privacy, name), name


# -- client level: what the main job's run reports -------------------------------------------------
MAIN_JOB_EPSILON = 27_612
"""ε after 5 rounds of the main job (docs/configuration.md: noise-multiplier), as the run
reports it: recomputed by ``test_main_job_epsilon_is_what_the_run_reports``."""


def _main_job_run_epsilons() -> list[float]:
    """ε per round as the run's strategy accounts it: the default RunConfig (5 nodes, the fixed
    sampler taking all 5, dp-mode distributed under he=true with every share present, σ 0.02,
    δ 1e-5, 5 rounds)."""
    from federation.config import RunConfig
    from federation.privacy_ledger import RoundRelease
    from federation.results import RoundRecord
    from federation.strategy import OpaqueFedAvg, sampler_for

    cfg = RunConfig(task="digits")
    assert (cfg.noise_multiplier, cfg.target_delta, cfg.num_server_rounds, cfg.client_sampling, cfg.he,
            cfg.dp_mode) == (0.02, 1e-5, 5, "fixed", True, "distributed")
    s = OpaqueFedAvg.__new__(OpaqueFedAvg)
    s.cfg, s.sampler, s.ledger, s.client_epsilon, s.saturation_delta = cfg, sampler_for(cfg), None, 0.0, 0.0
    s.packing, s.dim, s._topup_by_node = None, 10, {}
    assert s.sampler.fixed_size(5) == 5
    every_share = RoundRelease(5, {n: 1 for n in range(5)})
    return [s._account(RoundRecord(round=r, population=5, sampled=5), every_share) for r in range(1, 6)]


def _main_job_key_holder_epsilons() -> tuple[float, float]:
    """ε against one node and two colluding nodes: each knows its own share, σ·sqrt((5-t)/5)
    is left, replace-one (σ/2), 5 rounds, no amplification."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    out = []
    for t in (1, 2):
        acc = RdpAccountant()
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(0.01 * math.sqrt((5 - t) / 5)), 5))
        out.append(acc.get_epsilon(1e-5))
    return out[0], out[1]


def test_main_job_epsilon_is_what_the_run_reports() -> None:
    """Replace-one adjacency: the sum moves by 2C, so the Gaussian has noise multiplier σ/2 = 0.01,
    composed 5 times (q = 1: no amplification). Reference: dp-accounting's RDP (the bound the
    run's accountant uses) and the exact Gaussian-DP curve (tight: 25,953; dp-accounting's PLD
    cannot discretise a privacy loss this large in memory)."""
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant
    from scipy.special import log_ndtr

    def gdp_delta(e: float, mu: float) -> float:  # Dong, Roth & Su: exact δ(ε) of μ-GDP
        return math.exp(log_ndtr(-e / mu + mu / 2)) - math.exp(e + log_ndtr(-e / mu - mu / 2))

    mu = math.sqrt(5) / 0.01
    lo, hi = 0.0, 1e6
    for _ in range(200):
        lo, hi = ((lo + hi) / 2, hi) if gdp_delta((lo + hi) / 2, mu) > 1e-5 else (lo, (lo + hi) / 2)
    exact = hi

    eps = _main_job_run_epsilons()
    assert all(a < b for a, b in zip(eps, eps[1:]))
    event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(0.01), 5)
    rdp = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    rdp.compose(event)
    assert eps[-1] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-9)
    assert exact == pytest.approx(25_953, abs=1) and exact < eps[-1]
    assert round(eps[-1]) == MAIN_JOB_EPSILON  # the figure docs/configuration.md quotes
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text().split())
    node, colluding = _main_job_key_holder_epsilons()
    assert f"{round(node):,} against one node, {round(colluding):,} against two colluding nodes" in doc
    assert privacy_claim(eps[-1], "distributed") == NO_MEANINGFUL_EPSILON


# -- privacy_claim ------------------------------------------------------------------------------------
def test_privacy_claim_labels() -> None:
    assert privacy_claim(math.nan, "none") == "none: no DP"
    assert privacy_claim(2.314, "distributed") == "client-level (ε=2.31, δ)"
    assert privacy_claim(2.314, "local", delta=1e-5) == "client-level (ε=2.31, δ=1e-05)"
    assert privacy_claim(MEANINGFUL_EPSILON, "flower-central") == "client-level (ε=10, δ)"
    assert privacy_claim(0.5, "none", level="sample") == "sample-level (ε=0.5, δ)"
    for eps in (10.01, 6800.0, math.inf, math.nan):
        assert privacy_claim(eps, "distributed") == "clipping and noise, no meaningful ε at this population"
    assert NO_MEANINGFUL_EPSILON == "clipping and noise, no meaningful ε at this population"


def test_privacy_claim_rejects_bad_input() -> None:
    for args, kwargs in [((1.0, "central"), {}), ((-1.0, "local"), {}), ((1.0, "local"), {"delta": 0.0}),
                         ((1.0, "local"), {"level": "node"})]:
        with pytest.raises(ParameterError):
            privacy_claim(*args, **kwargs)


# --- the sampler's seed: OS entropy through secrets, never the public seed ----------------------


def test_numpy_default_rng_seeds_from_secrets(monkeypatch) -> None:
    """numpy's SeedSequence() draws its 128 entropy bits from secrets.randbits (os.urandom);
    gaussian_noise without an rng uses such a fresh generator (crypto.dp.privacy docstring)."""
    import secrets

    import numpy.random.bit_generator as bit_generator

    assert bit_generator.randbits is secrets.randbits
    asked: list[int] = []

    def fixed(bits: int) -> int:
        asked.append(bits)
        return 12345

    monkeypatch.setattr(bit_generator, "randbits", fixed)
    got = gaussian_noise(50, 1.0, 1.0)
    assert asked == [128]  # one fresh SeedSequence per call
    np.testing.assert_array_equal(got, np.random.default_rng(np.random.SeedSequence(12345)).normal(0, 1.0, 50))
    monkeypatch.undo()
    assert not np.array_equal(gaussian_noise(50, 1.0, 1.0), gaussian_noise(50, 1.0, 1.0))
