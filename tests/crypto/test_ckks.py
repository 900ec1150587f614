"""Encrypted aggregation: correctness per packing mode, exactness at the headroom limit, sizes,
and that the server-side object holds nothing that decrypts."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tenseal as ts
import torch

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    CkksContext,
    NoSecretKeyError,
    PackingConfig,
    UpdateEncryptor,
    ciphertext_info,
    flatten,
    load_context,
)
from crypto.seal_io import seal_save
from crypto.wire import parse_envelope

MODES = [
    PackingConfig(mode="packed", max_weight=1000.0),
    PackingConfig(mode="packed", bits=12, clip_range=0.5, max_clients=10, max_weight=1000.0),
    PackingConfig(mode="none", max_weight=1000.0),
]


def _round(ctx: CkksContext, pub: bytes, cfg: PackingConfig, updates, weights, seed=0):
    enc = UpdateEncryptor(ctx, cfg, rng=np.random.default_rng(seed))
    agg = CkksAggregator(pub, cfg)
    for u, w in zip(updates, weights):
        agg.add(enc.encrypt(u, w))
    return agg, AggregateDecryptor(ctx, cfg).decrypt(agg.result())


@pytest.mark.parametrize("cfg", MODES, ids=lambda c: f"{c.mode}-{c.bits}b")
def test_weighted_mean_of_10_updates_within_documented_tolerance(secret_ctx, public_bytes, rng, cfg) -> None:
    n, d = 10, 15_000  # > one ciphertext in every mode
    updates = rng.uniform(-cfg.clip_range, cfg.clip_range, (n, d))
    weights = rng.integers(100, 1001, n).astype(float)  # example counts
    agg, res = _round(secret_ctx, public_bytes, cfg, updates, weights)
    expected = (weights[:, None] * updates).sum(0) / weights.sum()
    w_norm = weights.sum() / cfg.max_weight
    err = np.abs(res.mean - expected).max()
    assert err <= cfg.mean_error_bound(w_norm, n), (err, cfg.mean_error_bound(w_norm, n))
    if cfg.mode == "none":
        assert err <= 1e-6
    else:  # stochastic rounding: unbiased, so the typical error is far below the hard bound
        assert np.abs(res.mean - expected).mean() < 0.5 * cfg.step
    assert res.weight_sum == pytest.approx(weights.sum(), rel=1e-9)
    assert res.contributions == n and res.n_updates == n and agg.count == n


@pytest.mark.parametrize(
    "bits,max_clients,expect_fields",
    [(8, 32, 3), (17, 8, 2), (10, 4, 3), (24, 64, 1)],  # 39, 40, 36 and 30 packed bits per part
)
def test_packing_exact_at_maximum_headroom(secret_ctx, public_bytes, rng, bits, max_clients, expect_fields) -> None:
    cfg = PackingConfig(bits=bits, max_clients=max_clients, clip_range=2.0)
    assert cfg.fields_per_part(secret_ctx.params.slot_bits) == expect_fields
    d = 3 * secret_ctx.params.slot_parts  # several ciphertexts
    enc = UpdateEncryptor(secret_ctx, cfg, rng=rng)
    # every contribution at the top level (+R -> q = L), the largest sum the fields must hold,
    # except the last contributions which put random grid values (exactly representable)
    q_expected = np.zeros(d, dtype=np.int64)
    agg = CkksAggregator(public_bytes, cfg)
    for i in range(max_clients):
        q = np.full(d, cfg.levels) if i < max_clients - 2 else rng.integers(0, cfg.levels + 1, d)
        agg.add(enc.encrypt(-cfg.clip_range + q * cfg.step, 1.0))
        q_expected += q
    assert agg.count == max_clients
    dec = AggregateDecryptor(secret_ctx, cfg)
    raw = dec.decrypt_raw(agg.result())
    np.testing.assert_array_equal(raw.sums, q_expected)  # exact integers, no carry between fields
    assert raw.contributions == max_clients and raw.weight_sum == max_clients
    # all at the top: the mean is exactly +R; all at the bottom: exactly -R
    for level, value in ((cfg.levels, cfg.clip_range), (0, -cfg.clip_range)):
        agg = CkksAggregator(public_bytes, cfg)
        for _ in range(max_clients):
            agg.add(enc.encrypt(np.full(d, value), 1.0))
        res = dec.decrypt(agg.result())
        np.testing.assert_allclose(res.mean, value, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(dec.decrypt_raw(agg.result()).sums, level * max_clients)


def test_server_side_object_cannot_decrypt(secret_ctx, public_bytes) -> None:
    agg = CkksAggregator(public_bytes, PackingConfig())
    assert not agg.context.is_private
    (plen,) = struct.unpack(">H", public_bytes[21:23])  # magic(4) flags(1) key_id(16) len(2) params
    raw_public = ts.context_from(public_bytes[23 + plen :])  # the TenSEAL payload itself
    assert not raw_public.has_secret_key() and not raw_public.is_private()
    with pytest.raises(ValueError):
        raw_public.secret_key()
    # the secret key's own bytes (SEAL's serialization of it) occur nowhere in what the server
    # holds; positive control: they do occur in the secret context a node holds
    key_chunks = _chunks(seal_save(secret_ctx.secret_key()))
    assert key_chunks and all(c in secret_ctx.secret_bytes() for c in key_chunks)
    assert not any(c in public_bytes for c in key_chunks)
    with pytest.raises(NoSecretKeyError):
        AggregateDecryptor(agg.context, PackingConfig())
    with pytest.raises(NoSecretKeyError):
        load_context(public_bytes).secret_bytes()


def _chunks(blob: bytes, size: int = 64):
    return [blob[i : i + size] for i in range(0, len(blob) - size, size)]


@pytest.mark.parametrize("mode,max_bpp", [("packed", 2.71), ("none", 8.1)])
def test_bytes_per_parameter(secret_ctx, rng, mode, max_bpp) -> None:
    cfg = PackingConfig(mode=mode)
    k = cfg.fields_per_part(secret_ctx.params.slot_bits)
    d = (secret_ctx.params.slot_parts - 2) * k  # exactly one full ciphertext
    blob = UpdateEncryptor(secret_ctx, cfg, rng=rng).encrypt(rng.uniform(-1, 1, d))
    info = ciphertext_info(blob)
    assert info["n_ciphertexts"] == 1 and info["n_values"] == d
    assert len(blob) / d <= max_bpp
    if mode == "packed":
        assert len(blob) / d <= 4.0  # no larger than fp32


def test_public_key_encryptor_fallback_is_bigger_but_works(secret_ctx, public_bytes, rng) -> None:
    cfg = PackingConfig()
    x = rng.uniform(-1, 1, 1000)
    public_enc = UpdateEncryptor(load_context(public_bytes), cfg, rng=rng)
    blob_pk = public_enc.encrypt(x)
    blob_sym = UpdateEncryptor(secret_ctx, cfg, rng=rng).encrypt(x)
    assert len(blob_pk) > 1.8 * len(blob_sym)  # seeded symmetric halves the ciphertext
    agg = CkksAggregator(public_bytes, cfg)
    agg.add(blob_pk)
    agg.add(blob_sym)
    np.testing.assert_allclose(AggregateDecryptor(secret_ctx, cfg).decrypt_mean(agg.result()), x, atol=cfg.step)


def test_torch_state_dict_roundtrip_through_encryption(secret_ctx, public_bytes) -> None:
    g = torch.Generator().manual_seed(1)
    states = [{"fc.weight": torch.randn(8, 5, generator=g) * 0.1, "fc.bias": torch.randn(8, generator=g) * 0.1}
              for _ in range(3)]
    cfg = PackingConfig(mode="none")
    enc = UpdateEncryptor(secret_ctx, cfg)
    _, layout = flatten(states[0])
    agg = CkksAggregator(public_bytes, cfg)
    for s in states:
        agg.add(enc.encrypt(s, layout=layout))
    mean = AggregateDecryptor(secret_ctx, cfg).decrypt_mean(agg.result(), layout, as_torch=True)
    for name in states[0]:
        expected = sum(s[name] for s in states) / 3
        assert mean[name].dtype == torch.float32 and mean[name].shape == expected.shape
        torch.testing.assert_close(mean[name], expected, atol=1e-6, rtol=0)


def test_single_update_decrypts_too(secret_ctx, rng) -> None:
    cfg = PackingConfig(mode="none")
    x = rng.normal(size=100)
    blob = UpdateEncryptor(secret_ctx, cfg).encrypt(x, 0.5)
    # pre-scaled by 0.5 then saturated to [-1, 1], so the mean saturates at +-2
    np.testing.assert_allclose(AggregateDecryptor(secret_ctx, cfg).decrypt_mean(blob), np.clip(x, -2, 2), atol=1e-7)


def test_saturation_is_counted_and_decodes_to_the_range_edge(secret_ctx, public_bytes) -> None:
    cfg = PackingConfig(clip_range=1.0)
    x = np.array([0.5, 5.0, -7.0, 1e6, -0.25])
    enc = UpdateEncryptor(secret_ctx, cfg, rng=np.random.default_rng(0))
    blob = enc.encrypt(x)
    assert enc.last_report.saturated == 3 and enc.total_saturated == 3
    agg = CkksAggregator(public_bytes, cfg)
    agg.add(blob)
    mean = AggregateDecryptor(secret_ctx, cfg).decrypt_mean(agg.result())
    np.testing.assert_allclose(mean[[1, 2, 3]], [1.0, -1.0, 1.0], atol=1e-12)  # saturated, never wrapped
    np.testing.assert_allclose(mean[[0, 4]], [0.5, -0.25], atol=cfg.step)


def test_zero_weight_client_adds_nothing(secret_ctx, public_bytes, rng) -> None:
    cfg = PackingConfig(mode="none")
    enc = UpdateEncryptor(secret_ctx, cfg)
    agg = CkksAggregator(public_bytes, cfg)
    agg.add(enc.encrypt(np.full(10, 0.5), 1.0))
    agg.add(enc.encrypt(np.full(10, -0.9), 0.0))
    res = AggregateDecryptor(secret_ctx, cfg).decrypt(agg.result())
    np.testing.assert_allclose(res.mean, 0.5, atol=1e-8)
    assert res.contributions == 2


def test_default_preset_noise_is_far_below_the_rounding_threshold(secret_ctx, public_bytes, rng) -> None:
    """32 contributions (the default headroom), mixed seeded and public-key ciphertexts: the CKKS
    error on the packed integers must stay well under 0.5, or rounding would not be exact."""
    cfg = PackingConfig()
    enc = UpdateEncryptor(secret_ctx, cfg, rng=rng)
    agg = CkksAggregator(public_bytes, cfg, rng=rng)
    d = 2 * 3 * secret_ctx.params.slot_parts
    for _ in range(cfg.max_clients - 4):
        agg.add(enc.encrypt(rng.uniform(-1, 1, d)))
    agg.add_noise(0.1, shares=4)  # public-key encrypted, like a server top-up
    dec = AggregateDecryptor(secret_ctx, cfg)
    blobs = parse_envelope(agg.result(), max_ciphertext_bytes=1 << 30).ciphertexts
    parts = dec._ops.decrypt_parts(dec._ops.load_checked(blobs, 2.0**secret_ctx.params.packed_scale_bits))
    assert np.abs(parts - np.rint(parts)).max() < 0.15


# --- a node's noise reply of m shares: m contributions, range ±m·R -----------------------------


def _noise_round(secret_ctx, public_bytes, cfg: PackingConfig, shares: int, share_std: float, rng):
    """Two weight-1 updates and one pure-noise summand of `shares` shares, dithered; returns
    (updates, noise, encryptor of the noise summand, aggregator, decrypted result)."""
    from crypto.dp.dither import dither, dither_total

    dim = 2000
    enc = UpdateEncryptor(secret_ctx, cfg, rng=rng)
    agg = CkksAggregator(public_bytes, cfg)
    updates = [rng.uniform(-0.1, 0.1, dim) for _ in range(2)]
    for i, u in enumerate(updates):
        agg.add(enc.encrypt(u, 1.0, dither=dither(secret_ctx.dither_key, 1, 1, 0, f"n{i}", 1, dim)))
    noise = rng.normal(0.0, share_std * np.sqrt(shares), dim)
    noise_enc = UpdateEncryptor(secret_ctx, cfg, rng=rng)
    blob = noise_enc.encrypt(np.zeros(dim), 0.0, noise=noise, contributions=shares,
                             dither=dither(secret_ctx.dither_key, 1, 1, 0, "n0", 2, dim))
    assert ciphertext_info(blob)["n_updates"] == shares  # what the server's headroom check counts
    agg.add(blob)
    total = dither_total(secret_ctx.dither_key, 1, 1, 0, [("n0", 1), ("n1", 1), ("n0", 2)], dim)
    return updates, noise, noise_enc, agg, AggregateDecryptor(secret_ctx, cfg).decrypt(agg.result(), dither_total=total)


def test_noise_reply_of_m_shares_decodes_to_the_plaintext_sum_without_saturating(secret_ctx, public_bytes, rng) -> None:
    cfg = PackingConfig(clip_range=0.3, max_clients=8, dither=True)
    share_std = 0.15 / np.sqrt(3)  # the sum of 3 shares has std 0.15: 2 std of R, 6 std of 3R
    updates, noise, noise_enc, agg, result = _noise_round(secret_ctx, public_bytes, cfg, 3, share_std, rng)
    assert noise_enc.last_report.saturated == 0
    assert agg.count == 3 and agg.contributions == 5 and result.contributions == 5 and result.n_updates == 3
    want = (updates[0] + updates[1] + noise) / 2.0
    assert result.weight_sum == pytest.approx(2.0)
    # dithered: each of the 3 summands is off by at most step/2 (crypto.dp.dither)
    assert np.max(np.abs(result.mean - want)) <= 3 * cfg.step / 2 / 2 + 1e-9
    # the same noise as ONE contribution of range R saturates about 4.6 % of its values
    single = UpdateEncryptor(secret_ctx, PackingConfig(clip_range=0.3, max_clients=8))
    single.encrypt(np.zeros(noise.shape[0]), 0.0, noise=noise)
    assert single.last_report.saturated > 0.02 * noise.shape[0]


def test_noise_reply_shares_count_against_the_headroom(secret_ctx, public_bytes, rng) -> None:
    from crypto import HeadroomError

    cfg = PackingConfig(clip_range=0.3, max_clients=4)
    enc = UpdateEncryptor(secret_ctx, cfg, rng=rng)
    agg = CkksAggregator(public_bytes, cfg)
    agg.add(enc.encrypt(np.zeros(10), 1.0))
    agg.add(enc.encrypt(np.zeros(10), 1.0))
    three = enc.encrypt(np.zeros(10), 0.0, noise=np.full(10, 0.5), contributions=3)
    with pytest.raises(HeadroomError, match="3 more"):
        agg.add(three)
    assert agg.count == 2 and agg.contributions == 2  # unchanged
    agg.add(enc.encrypt(np.zeros(10), 0.0, noise=np.full(10, 0.5), contributions=2))
    result = AggregateDecryptor(secret_ctx, cfg).decrypt(agg.result())
    assert result.contributions == 4
    np.testing.assert_allclose(result.mean, 0.25, atol=4 * cfg.step / 2)


@pytest.mark.parametrize("weight,contributions", [(1.0, 2), (0.0, 0), (0.0, 33), (0.0, 1.5), (0.0, True)])
def test_bad_contribution_counts_are_refused(secret_ctx, weight, contributions) -> None:
    from crypto import ParameterError

    with pytest.raises(ParameterError, match="contributions"):
        UpdateEncryptor(secret_ctx, PackingConfig()).encrypt(np.zeros(4), weight, contributions=contributions)
