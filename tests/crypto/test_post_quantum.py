"""The post-quantum presets (he-security post-quantum): within the HE standard's post-quantum
128-bit column, exact packed sums at the headroom limit, and chosen by ``auto``."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import (
    PQ_AUTO_PRESETS,
    PRESETS,
    AggregateDecryptor,
    CkksAggregator,
    PackingConfig,
    UpdateEncryptor,
    make_secret_context,
)
from crypto.context import PQ_LOG_Q_BOUND
from federation.codec import ckks_preset_for
from federation.config import ConfigError, RunConfig


@pytest.mark.parametrize("name", PQ_AUTO_PRESETS)
def test_pq_presets_stay_within_the_post_quantum_column(name: str) -> None:
    p = PRESETS[name]
    assert sum(p.coeff_mod_bit_sizes) <= PQ_LOG_Q_BOUND[p.poly_modulus_degree]


@pytest.mark.parametrize("name", ["fedkv-2048", "fedkv-4096"])
def test_the_classical_presets_are_not_post_quantum(name: str) -> None:
    p = PRESETS[name]
    assert sum(p.coeff_mod_bit_sizes) > PQ_LOG_Q_BOUND[p.poly_modulus_degree]


@pytest.mark.parametrize("name", PQ_AUTO_PRESETS)
def test_sum_of_max_clients_updates_is_exact_on_the_pq_rings(name: str) -> None:
    ctx = make_secret_context(name)
    packing = PackingConfig(clip_range=1.0, max_clients=8)
    rng = np.random.default_rng(3)
    enc = UpdateEncryptor(ctx, packing, rng=rng)
    agg = CkksAggregator(ctx.public_bytes(), packing)
    dim = 3000
    xs = [np.full(dim, 1.0) if i % 2 else np.full(dim, -1.0) for i in range(7)] + [rng.uniform(-1, 1, dim)]
    for x in xs:  # values at the range's ends fill the headroom
        agg.add(enc.encrypt(x))
    res = AggregateDecryptor(ctx, packing).decrypt(agg.result())
    assert np.abs(res.mean - np.mean(xs, axis=0)).max() <= packing.mean_error_bound(8.0, 8)


def test_auto_picks_a_pq_ring_under_post_quantum_and_refuses_a_classical_one() -> None:
    cfg = RunConfig(he_security="post-quantum")
    assert ckks_preset_for(cfg, 4810) in PQ_AUTO_PRESETS
    assert ckks_preset_for(cfg, 141_000) == "fedkv-4096-pq"
    assert ckks_preset_for(RunConfig(), 141_000) == "fedkv-4096"
    with pytest.raises(ConfigError, match="post-quantum"):
        RunConfig(he_security="post-quantum", ckks_preset="fedkv-4096")
