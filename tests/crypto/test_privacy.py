"""Clipping, noise placement variances (also through the encrypted path), Opacus accounting."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    NonFiniteUpdateError,
    PackingConfig,
    ParameterError,
    PrivacyAccountant,
    UpdateEncryptor,
    client_sample_rate,
    clip_update,
    gaussian_noise,
    global_l2_norm,
    noise_multiplier_for,
    noise_std,
)
from crypto.privacy import MEANINGFUL_EPSILON, NO_MEANINGFUL_EPSILON, privacy_claim, rdp_orders


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


def test_abadi_example_with_both_opacus_accountants() -> None:
    # Abadi et al. 2016: q = 0.01, sigma = 4, delta = 1e-5, 10,000 steps: eps ~ 1.26 (moments acc.)
    eps = {}
    for mech in ("rdp", "prv"):
        acc = PrivacyAccountant(mech)
        acc.step(noise_multiplier=4.0, sample_rate=0.01, steps=10_000)
        eps[mech] = acc.epsilon(1e-5)
        assert 0.9 <= eps[mech] <= 1.26, (mech, eps[mech])
    assert eps["prv"] < eps["rdp"]  # PRV is the tighter of the two
    assert eps["rdp"] == pytest.approx(1.04, abs=0.02)


def test_client_level_accounting_grows_per_round_and_matches_opacus_step() -> None:
    from opacus.accountants import RDPAccountant

    q = client_sample_rate(10, 100)
    ours, theirs = PrivacyAccountant("rdp"), RDPAccountant()
    eps = []
    for _ in range(5):
        ours.step(1.2, q)
        theirs.step(noise_multiplier=1.2, sample_rate=q)
        eps.append(ours.epsilon(1e-5))
    assert all(a < b for a, b in zip(eps, eps[1:]))
    assert eps[-1] == pytest.approx(theirs.get_epsilon(1e-5))
    assert ours.steps == 5 and PrivacyAccountant("rdp").epsilon(1e-5) == 0.0
    restored = PrivacyAccountant.from_state_dict(ours.state_dict())
    assert restored.epsilon(1e-5) == pytest.approx(eps[-1])
    assert PrivacyAccountant.from_opacus(theirs, "prv").epsilon(1e-5) < eps[-1]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus' secure-RNG and hook notices
def test_sample_level_history_from_opacus_privacy_engine() -> None:
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
    wrapped = PrivacyAccountant.from_opacus(engine.accountant)
    assert wrapped.epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5))
    assert wrapped.steps == sum(h[2] for h in engine.accountant.history) > 0


def test_noise_multiplier_for_reaches_target() -> None:
    sigma = noise_multiplier_for(1.0, 1e-5, 0.01, 10_000)
    acc = PrivacyAccountant("rdp")
    acc.step(sigma, 0.01, 10_000)
    assert 0.95 <= acc.epsilon(1e-5) <= 1.0
    assert sigma == pytest.approx(4.14, abs=0.05)


def test_accountant_rejects_bad_input() -> None:
    acc = PrivacyAccountant("rdp")
    for args in [(0.0, 0.1), (1.0, 0.0), (1.0, 1.5)]:
        with pytest.raises(ParameterError):
            acc.step(*args)
    with pytest.raises(ParameterError):
        acc.epsilon(0.0)
    with pytest.raises(ParameterError):
        PrivacyAccountant("moments")  # type: ignore[arg-type]


# -- RDP orders: no "Optimal order is the smallest/largest alpha", consistent ε ---------------------
MAIN_JOB = (0.02, 1.0, 5)
"""The default job: sigma 0.02, all 5 nodes every round (q = 1), 5 rounds, delta 1e-5."""
SWEEP_SIGMAS = (0.5, 2.0, 5.0)
SWEEP_STEPS = (25, 50, 100)
SWEEP_Q = 0.1


def _alpha_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "Optimal order" in str(w.message)]


def test_opacus_default_orders_miss_the_main_job() -> None:
    """The problem being fixed: Opacus' own orders stop at 1.1, the main job's optimum is ~1.04."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [MAIN_JOB]
    with pytest.warns(UserWarning, match="Optimal order is the smallest alpha"):
        acc.get_epsilon(1e-5)


def test_main_job_accounting_emits_no_alpha_warning_and_a_tighter_epsilon() -> None:
    from opacus.accountants import RDPAccountant

    sigma, q, rounds = MAIN_JOB
    acc = PrivacyAccountant("rdp")
    eps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(rounds):  # as the server accountant does: one step per round
            acc.step(sigma, q)
            eps.append(acc.epsilon(1e-5))
    assert _alpha_warnings(caught) == []
    assert all(a < b for a, b in zip(eps, eps[1:]))
    opacus_default = RDPAccountant()
    opacus_default.history = [MAIN_JOB]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loose = opacus_default.get_epsilon(1e-5)
    assert eps[-1] < loose  # a valid bound at a better order: strictly tighter
    assert eps[-1] == pytest.approx(6800, rel=0.01)  # huge: sigma 0.02 buys no meaningful client-level ε


def test_sweep_accounting_emits_no_alpha_warning_and_is_consistent() -> None:
    from opacus.accountants import RDPAccountant

    eps: dict[tuple[float, int], float] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sigma in SWEEP_SIGMAS:
            for steps in SWEEP_STEPS:
                acc = PrivacyAccountant("rdp")
                acc.step(sigma, SWEEP_Q, steps)
                eps[sigma, steps] = acc.epsilon(1e-5)
    assert _alpha_warnings(caught) == []
    for sigma in SWEEP_SIGMAS:  # monotone in steps
        series = [eps[sigma, k] for k in SWEEP_STEPS]
        assert all(0 < a < b for a, b in zip(series, series[1:])), (sigma, series)
    for steps in SWEEP_STEPS:  # decreasing in sigma
        series = [eps[s, steps] for s in SWEEP_SIGMAS]
        assert all(a > b for a, b in zip(series, series[1:])), (steps, series)
    for (sigma, steps), value in eps.items():  # optimum inside Opacus' range: the same ε as Opacus
        theirs = RDPAccountant()
        theirs.history = [(sigma, SWEEP_Q, steps)]
        assert value == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-9)


def test_prv_uses_the_same_orders_without_warning() -> None:
    from opacus.accountants import PRVAccountant

    abadi = PrivacyAccountant("prv")
    abadi.step(4.0, 0.01, 10_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eps = abadi.epsilon(1e-5)
        sweep = []
        for sigma in (0.5, 5.0):
            acc = PrivacyAccountant("prv")
            acc.step(sigma, SWEEP_Q, 25)
            sweep.append(acc.epsilon(1e-5))
    assert _alpha_warnings(caught) == []
    theirs = PRVAccountant()
    theirs.history = [(4.0, 0.01, 10_000)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' own domain bound stops at order 63 here
        assert eps == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-6)
    assert sweep[0] > sweep[1] > 0


def test_noise_multiplier_for_the_sweep_emits_no_alpha_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sigmas = [noise_multiplier_for(e, 1e-5, SWEEP_Q, 25) for e in (1.0, 2.0)]
    assert _alpha_warnings(caught) == []
    assert sigmas[0] > sigmas[1] > 0


def test_rdp_orders() -> None:
    from opacus.accountants import RDPAccountant

    sub = rdp_orders([(1.0, 0.1, 3)])
    full = rdp_orders([(1.0, 1.0, 3), (2.0, 1.0, 1)])
    assert list(sub) == sorted(sub) and set(RDPAccountant.DEFAULT_ALPHAS) <= set(sub)
    assert min(sub) < 1.0001 and max(sub) == 1024  # Opacus' series overflows above ~1029 for q < 1
    assert max(full) >= 2**20 and set(sub) < set(full)
    assert rdp_orders() == sub


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


def test_privacy_claim_of_the_main_job_is_honest() -> None:
    sigma, q, rounds = MAIN_JOB
    acc = PrivacyAccountant("rdp")
    acc.step(sigma, q, rounds)
    assert privacy_claim(acc.epsilon(1e-5), "distributed") == NO_MEANINGFUL_EPSILON


def test_privacy_claim_rejects_bad_input() -> None:
    for args, kwargs in [((1.0, "central"), {}), ((-1.0, "local"), {}), ((1.0, "local"), {"delta": 0.0}),
                         ((1.0, "local"), {"level": "node"})]:
        with pytest.raises(ParameterError):
            privacy_claim(*args, **kwargs)


# --- the sampler's seed: OS entropy through secrets, never the public seed ----------------------


def test_numpy_default_rng_seeds_from_secrets(monkeypatch) -> None:
    """numpy's SeedSequence() draws its 128 entropy bits from secrets.randbits (os.urandom);
    gaussian_noise without an rng uses such a fresh generator (crypto.privacy docstring)."""
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
