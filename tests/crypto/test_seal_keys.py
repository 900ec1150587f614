"""The N=2048 single-prime ring (raw SEAL keys): 128-bit bound enforced, round trips, bad bytes
refused, and packed sums exact at the headroom limit."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    NotAContextError,
    PackingConfig,
    ParameterError,
    UpdateEncryptor,
    load_context,
    make_secret_context,
    preset_for,
)
from crypto.context import CkksParams
from crypto.seal_keys import load_seal_keys, make_seal_keys


@pytest.fixture(scope="module")
def small_ctx():
    return make_secret_context("fedkv-2048")


def test_above_the_128_bit_bound_is_refused() -> None:
    with pytest.raises(ParameterError):
        make_seal_keys(2048, (55,))  # MaxBitCount(2048, tc128) = 54
    with pytest.raises(ParameterError):
        make_secret_context(CkksParams(name="x", poly_modulus_degree=2048, coeff_mod_bit_sizes=(56,),
                                       packed_scale_bits=17, real_scale_bits=34, slot_bits=35))


def test_secret_and_public_contexts_round_trip_with_the_same_key_id(small_ctx) -> None:
    sec, pub = load_context(small_ctx.secret_bytes()), load_context(small_ctx.public_bytes())
    assert sec.key_id == pub.key_id == small_ctx.key_id
    assert sec.is_private and not pub.is_private
    assert sec.secret_bytes() == small_ctx.secret_bytes()


@pytest.mark.parametrize("cut", [5, 9, 100, -1])
def test_truncated_or_altered_key_records_are_refused(small_ctx, cut: int) -> None:
    body = small_ctx.tenseal.serialize(save_secret_key=True)
    with pytest.raises(NotAContextError):
        load_seal_keys(body[:cut])
    with pytest.raises(NotAContextError):
        load_seal_keys(b"FKX\x01" + body[4:])


def test_a_tampered_public_key_does_not_match_its_key_id(small_ctx) -> None:
    data = bytearray(small_ctx.public_bytes())
    data[-40] ^= 1
    with pytest.raises(NotAContextError):
        load_context(bytes(data))


def test_sum_of_max_clients_updates_is_exact_at_the_smallest_ring(small_ctx) -> None:
    packing = PackingConfig(clip_range=1.0, max_clients=8)
    rng = np.random.default_rng(3)
    enc = UpdateEncryptor(small_ctx, packing, rng=rng)
    agg = CkksAggregator(small_ctx.public_bytes(), packing)
    xs = [np.full(4810, 1.0) if i % 2 else np.full(4810, -1.0) for i in range(7)] + [rng.uniform(-1, 1, 4810)]
    for x in xs:  # values at the range's ends fill the headroom
        agg.add(enc.encrypt(x))
    res = AggregateDecryptor(small_ctx, packing).decrypt(agg.result())
    assert np.abs(res.mean - np.mean(xs, axis=0)).max() <= packing.mean_error_bound(8.0, 8)
    assert enc.last_report.n_ciphertexts == 1


def test_preset_for_picks_the_smallest_updates() -> None:
    packing = PackingConfig(max_clients=8)
    assert preset_for(4810, packing) == "fedkv-2048"  # digits: one 16.6 KB ciphertext
    assert preset_for(6138, packing) == "fedkv-2048" and preset_for(6139, packing) == "fedkv-4096"  # 2 header parts
    assert preset_for(141_000, packing) == "fedkv-4096"  # many ciphertexts: the larger ring
    assert preset_for(4810, PackingConfig(max_clients=32)) == "fedkv-4096"  # 13-bit fields: 2 per part
