"""federation.sampling: the samplers the accountant assumes, OS entropy by default, the fixed
denominator of Poisson rounds, and the end-to-end effect in a run."""

from __future__ import annotations

import random
import secrets

import numpy as np
import pytest

from federation.sampling import ClientSampler, SampleOutsideBounds, expected_sample_size, poisson_mean_scale

NODES = list(range(100, 140))


def test_fixed_draws_k_without_replacement_and_is_seedable() -> None:
    s = ClientSampler("fixed", 0.25, min_clients=2, seed=7)
    a = s.sample(NODES)
    assert len(a) == 10 == len(set(a)) and set(a) <= set(NODES) and a == sorted(a)
    assert ClientSampler("fixed", 0.25, 2, seed=7).sample(NODES) == a
    assert ClientSampler("fixed", 0.25, 2, max_clients=4, seed=7).fixed_size(40) == 4
    assert ClientSampler("fixed", 0.01, 3, seed=7).fixed_size(40) == 3


def test_normal_runs_draw_from_os_entropy() -> None:
    s = ClientSampler("fixed", 0.5)
    assert isinstance(s._rng, secrets.SystemRandom)
    assert type(ClientSampler("poisson", 0.5, seed=1)._rng) is random.Random


def test_poisson_includes_each_node_with_probability_q() -> None:
    s = ClientSampler("poisson", 0.3, min_clients=1, seed=11)
    counts = np.zeros(len(NODES))
    draws = 2000
    sizes = []
    for _ in range(draws):
        chosen = s.sample(NODES)
        sizes.append(len(chosen))
        counts[[n - 100 for n in chosen]] += 1
    freq = counts / draws
    # binomial sd of one node's frequency: sqrt(0.3*0.7/2000) ~ 0.0102; 5 sd
    assert np.all(np.abs(freq - 0.3) < 0.052)
    assert len(set(sizes)) > 5  # the size varies: not a fixed-size sampler in disguise


def test_poisson_draw_outside_bounds_is_refused_not_redrawn() -> None:
    s = ClientSampler("poisson", 0.05, min_clients=10, seed=3)
    with pytest.raises(SampleOutsideBounds, match="min-clients=10"):
        s.sample(NODES)
    big = ClientSampler("poisson", 0.9, min_clients=1, max_clients=5, seed=3)
    with pytest.raises(SampleOutsideBounds, match="max-clients=5"):
        big.sample(NODES)


def test_fixed_denominator() -> None:
    assert expected_sample_size(0.25, 40) == 10 and expected_sample_size(0.001, 40) == pytest.approx(0.04)
    assert poisson_mean_scale(12, 0.25, 40) == pytest.approx(1.2)  # mean over 12 -> sum / 10
    # q·N = 2.5 is the denominator as it is, not rounded to 2 (the accountant charges q = 0.25)
    assert poisson_mean_scale(3, 0.25, 10) == pytest.approx(1.2)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="client-sampling"):
        ClientSampler("uniform", 0.5)
    with pytest.raises(ValueError, match="fraction-train"):
        ClientSampler("fixed", 0.0)


def test_poisson_aggregate_is_divided_by_the_expected_count() -> None:
    """A node turns the realised-count mean of a plaintext aggregate into sum / (q·N)."""
    from flwr.app import Context, RecordDict

    from federation.catch_up import fixed_denominator_scale
    from federation.codec import PlainAggregator, make_client_codec
    from federation.config import RunConfig

    dim, updates = 5, [np.full(5, 1.0), np.full(5, 2.0), np.full(5, 4.0)]
    codec, agg = make_client_codec(False, dim), PlainAggregator(dim)
    for u in updates:
        agg.add(codec.encode(u, 1.0))
    blob = agg.result()
    ctx = Context(run_id=1, node_id=1, node_config={"num-partitions": 10}, state=RecordDict(), run_config={})
    cfg = RunConfig(task="digits", he=False, fraction_train=0.2, client_sampling="poisson")
    mean = codec.decode_mean(blob) * fixed_denominator_scale(cfg, ctx, dim, blob, b"")
    assert np.allclose(mean, sum(updates) / 2)  # q·N = 2, not the 3 that came
    fixed = RunConfig(task="digits", he=False, fraction_train=0.2)
    assert fixed_denominator_scale(fixed, ctx, dim, blob, b"") == 1.0


@pytest.mark.slow  # end-to-end (40-125 s): .ci/run runs it in its slow step
def test_runs_account_for_their_sampler() -> None:
    """ε is the configured sampler's accountant: amplified for third parties (they see
    the released sum, σ), not for the server (he=false distributed: it sees each update with
    its share, σ/√k); a seeded sampler repeats its draws (experiments), and flower-central uses
    the fixed sampler's accountant (the server, which sees updates in clear: ∞)."""
    from federation.client_accounting import ClientAccountant, GaussianAccountant
    from federation.local import run_local

    base = {"task": "digits", "he": False, "dp-mode": "distributed", "noise-multiplier": 2.0,
            "num-server-rounds": 3, "fraction-train": 0.5, "min-clients": 1, "seed": 1, "sampler-seed": 9}
    for sampling in ("fixed", "poisson"):
        runs = [run_local({**base, "client-sampling": sampling}, 6) for _ in range(2)]
        assert [r.sampled for r in runs[0].rounds] == [r.sampled for r in runs[1].rounds]
        last = runs[0].rounds[-1]
        ref, server = ClientAccountant(sampling, 6, 1e-5), GaussianAccountant(6, 1e-5, sampling)
        for r in runs[0].rounds:
            ref.step(2.0, r.sampled)
            server.step(2.0 / np.sqrt(r.sampled))
        assert last.epsilon_server == pytest.approx(server.epsilon()) and last.epsilon_server < np.inf
        if sampling == "fixed":
            assert 0 < last.epsilon_client <= last.epsilon_server
            assert last.epsilon_client == pytest.approx(ref.epsilon())
        else:  # no other node drawn with 0.5^5: the skip bit gives a node away with 0.5·0.5^5 > δ
            assert last.epsilon_client == np.inf  # a round (federation.poisson_window)
    central = run_local({**base, "dp-mode": "flower-central", "client-sampling": "fixed"}, 6)
    ref = ClientAccountant("fixed", 6, 1e-5)
    ref.step(2.0, 3, 3)
    assert central.rounds[-1].epsilon_client == pytest.approx(ref.epsilon())
    assert central.rounds[-1].epsilon_server == np.inf
    assert central.rounds[-1].epsilon_node == pytest.approx(ref.epsilon_no_amplification())
