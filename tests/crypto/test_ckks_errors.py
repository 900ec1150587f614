"""Every bad input gets its own exception, and a rejected input leaves the aggregator unchanged."""

from __future__ import annotations

import os

import numpy as np
import pytest

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    ContextMismatchError,
    DecryptionError,
    EmptyAggregateError,
    HeadroomError,
    LayoutMismatchError,
    NoSecretKeyError,
    NonFiniteUpdateError,
    NotACiphertextError,
    NotAContextError,
    PackingConfig,
    PackingMismatchError,
    ParameterError,
    SaturationError,
    SecretKeyPresentError,
    UpdateEncryptor,
    WeightRangeError,
    flatten,
    load_context,
    make_secret_context,
)
from crypto.wire import Envelope, pack_envelope, parse_envelope

CFG = PackingConfig()
D = 5000


@pytest.fixture
def enc(secret_ctx):
    return UpdateEncryptor(secret_ctx, CFG, rng=np.random.default_rng(3))


@pytest.fixture
def good(enc):
    return enc.encrypt(np.full(D, 0.25), 1.0)


def _assert_unchanged_after(agg: CkksAggregator, secret_ctx, bad, exc) -> None:
    """Reject `bad`, then check the sum still decrypts to exactly the good updates' mean."""
    before = agg.count, agg.contributions
    with pytest.raises(exc):
        agg.add(bad)
    assert (agg.count, agg.contributions) == before
    mean = AggregateDecryptor(secret_ctx, CFG).decrypt_mean(agg.result())
    np.testing.assert_allclose(mean, 0.25, atol=CFG.step)


def _corrupt_bytes(good: bytes) -> dict[str, bytes]:
    env = parse_envelope(good, max_ciphertext_bytes=1 << 30)
    ct0 = env.ciphertexts[0]
    seal_hdr_flip = ct0[:20] + bytes([ct0[20] ^ 0xFF]) + ct0[21:]
    return {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "one byte short": good[:-1],
        "trailing": good + b"\x00",
        "random": os.urandom(len(good)),
        "random with our magic": good[:60] + os.urandom(len(good) - 60),
        "bad seal header": pack_envelope(Envelope(**{**env.__dict__, "ciphertexts": (seal_hdr_flip,)})),
        "seal bytes cut": pack_envelope(Envelope(**{**env.__dict__, "ciphertexts": (ct0[:-64],)})),
        "claims more values": pack_envelope(Envelope(**{**env.__dict__, "n_values": 10**9})),
    }


@pytest.mark.parametrize(
    "name",
    ["empty", "truncated", "one byte short", "trailing", "random", "random with our magic",
     "bad seal header", "seal bytes cut", "claims more values"],
)
def test_malformed_bytes_are_not_a_ciphertext(secret_ctx, public_bytes, enc, good, name) -> None:
    agg = CkksAggregator(public_bytes, CFG)
    agg.add(good)
    bad = _corrupt_bytes(good)[name]
    _assert_unchanged_after(agg, secret_ctx, bad, NotACiphertextError)
    with pytest.raises(NotACiphertextError):
        AggregateDecryptor(secret_ctx, CFG).decrypt(bad)


def test_non_bytes_input(public_bytes) -> None:
    with pytest.raises(NotACiphertextError):
        CkksAggregator(public_bytes, CFG).add("not bytes")  # type: ignore[arg-type]


def test_ciphertext_of_another_key_or_parameter_set(secret_ctx, public_bytes, other_ctx, good) -> None:
    agg = CkksAggregator(public_bytes, CFG)
    agg.add(good)
    foreign = UpdateEncryptor(other_ctx, CFG).encrypt(np.zeros(D))
    _assert_unchanged_after(agg, secret_ctx, foreign, ContextMismatchError)
    # another parameter set, even with our key id pasted in, fails SEAL's validation
    other_params = make_secret_context("fedkv-8192")
    blob = UpdateEncryptor(other_params, CFG).encrypt(np.zeros(D))
    env = parse_envelope(blob, max_ciphertext_bytes=1 << 30)
    n_ct = -(-(D // 3 + 3) // 4096)
    forged = pack_envelope(Envelope(**{**env.__dict__, "key_id": secret_ctx.key_id,
                                       "ciphertexts": env.ciphertexts * n_ct}))
    _assert_unchanged_after(agg, secret_ctx, blob, ContextMismatchError)
    _assert_unchanged_after(agg, secret_ctx, forged, NotACiphertextError)


def test_decrypt_with_wrong_or_public_context(secret_ctx, public_bytes, other_ctx, good) -> None:
    agg = CkksAggregator(public_bytes, CFG)
    agg.add(good)
    result = agg.result()
    with pytest.raises(ContextMismatchError):
        AggregateDecryptor(other_ctx, CFG).decrypt(result)
    with pytest.raises(NoSecretKeyError):
        AggregateDecryptor(load_context(public_bytes), CFG)
    # a right-key-id aggregate that does not decrypt to packed integers (forged key id)
    foreign = CkksAggregator(other_ctx.public_bytes(), CFG)
    foreign.add(UpdateEncryptor(other_ctx, CFG).encrypt(np.zeros(D)))
    env = parse_envelope(foreign.result(), max_ciphertext_bytes=1 << 30)
    forged = pack_envelope(Envelope(**{**env.__dict__, "key_id": secret_ctx.key_id}))
    with pytest.raises(DecryptionError):
        AggregateDecryptor(secret_ctx, CFG).decrypt(forged)


def test_server_refuses_a_secret_context(secret_ctx) -> None:
    with pytest.raises(SecretKeyPresentError):
        CkksAggregator(secret_ctx.secret_bytes(), CFG)


@pytest.mark.parametrize("blob", [b"", b"FKC\x01" + os.urandom(100), os.urandom(300)])
def test_bad_context_bytes(blob) -> None:
    with pytest.raises(NotAContextError):
        load_context(blob)


def test_tampered_context_key_id(public_bytes) -> None:
    tampered = public_bytes[:5] + bytes([public_bytes[5] ^ 1]) + public_bytes[6:]
    with pytest.raises(NotAContextError, match="key_id"):
        load_context(tampered)


def test_packing_mismatch(secret_ctx, public_bytes, good) -> None:
    agg = CkksAggregator(public_bytes, PackingConfig(bits=7))
    with pytest.raises(PackingMismatchError):
        agg.add(good)
    assert agg.count == 0
    with pytest.raises(PackingMismatchError):
        AggregateDecryptor(secret_ctx, PackingConfig(mode="none")).decrypt(good)


def test_layout_mismatches(secret_ctx, public_bytes, enc, good) -> None:
    agg = CkksAggregator(public_bytes, CFG)
    agg.add(good)
    _assert_unchanged_after(agg, secret_ctx, enc.encrypt(np.zeros(D + 1)), LayoutMismatchError)
    with pytest.raises(LayoutMismatchError):
        enc.encrypt(np.zeros((10, 10)))
    _, layout_a = flatten({"a": np.zeros((50, 100))})
    _, layout_b = flatten({"a": np.zeros((100, 50))})  # same size, other shape
    with pytest.raises(LayoutMismatchError):
        enc.encrypt(np.zeros(D + 1), layout=layout_a)
    agg2 = CkksAggregator(public_bytes, CFG)
    agg2.add(enc.encrypt(np.zeros(D), layout=layout_a))
    with pytest.raises(LayoutMismatchError):
        agg2.add(enc.encrypt(np.zeros(D), layout=layout_b))
    dec = AggregateDecryptor(secret_ctx, CFG)
    with pytest.raises(LayoutMismatchError):
        dec.decrypt_mean(agg2.result(), layout_b)
    _, small = flatten({"a": np.zeros(10)})
    with pytest.raises(LayoutMismatchError):
        dec.decrypt_mean(agg2.result(), small)
    assert dec.decrypt_mean(agg2.result(), layout_a)["a"].shape == (50, 100)
    with pytest.raises(LayoutMismatchError):
        agg2.add(good)  # no layout digest vs an aggregate that has one
    with pytest.raises(NotACiphertextError):
        agg2.add(agg2.result())  # an aggregate is not a client update


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rejected_before_encryption(enc, bad) -> None:
    x = np.zeros(D)
    x[17] = bad
    with pytest.raises(NonFiniteUpdateError):
        enc.encrypt(x)
    with pytest.raises(NonFiniteUpdateError):
        enc.encrypt({"w": x})
    with pytest.raises(NonFiniteUpdateError):
        enc.encrypt(np.zeros(D), noise=x)
    with pytest.raises(NonFiniteUpdateError):
        enc.encrypt(np.zeros(D), bad)
    assert enc.last_report is None  # nothing was encrypted


@pytest.mark.parametrize("weight", [-0.1, 1.5, "heavy"])
def test_weight_out_of_range(enc, weight) -> None:
    with pytest.raises(WeightRangeError):
        enc.encrypt(np.zeros(D), weight)


def test_saturation_can_raise(secret_ctx) -> None:
    strict = UpdateEncryptor(secret_ctx, PackingConfig(on_saturation="raise"))
    with pytest.raises(SaturationError):
        strict.encrypt(np.array([0.0, 2.0]))


def test_headroom_is_enforced(secret_ctx, public_bytes) -> None:
    cfg = PackingConfig(max_clients=2)
    enc = UpdateEncryptor(secret_ctx, cfg)
    agg = CkksAggregator(public_bytes, cfg)
    agg.add(enc.encrypt(np.ones(10)))
    agg.add(enc.encrypt(np.ones(10)))
    with pytest.raises(HeadroomError):
        agg.add(enc.encrypt(np.ones(10)))
    with pytest.raises(HeadroomError):
        agg.add_noise(0.1, shares=1)
    assert agg.count == 2 and agg.noise_shares == 0
    np.testing.assert_allclose(AggregateDecryptor(secret_ctx, cfg).decrypt_mean(agg.result()), 1.0, atol=1e-12)


def test_empty_aggregate(public_bytes) -> None:
    agg = CkksAggregator(public_bytes, CFG)
    with pytest.raises(EmptyAggregateError):
        agg.result()
    with pytest.raises(EmptyAggregateError):
        agg.add_noise(1.0)


def test_bad_parameters() -> None:
    with pytest.raises(ParameterError):
        make_secret_context("no-such-preset")
    from crypto import CkksParams

    with pytest.raises(ParameterError):  # beyond the 128-bit bound for N=4096: SEAL refuses
        make_secret_context(CkksParams(name="insecure", coeff_mod_bit_sizes=(60, 60)))
    with pytest.raises(ParameterError):  # would wrap: 44 + 18 > 60 - 2
        CkksParams(slot_bits=44)
    with pytest.raises(ParameterError):  # a 41-bit field (24 + 17 headroom bits) fits no 40-bit part
        UpdateEncryptor(make_secret_context(), PackingConfig(bits=24, max_clients=2**17))
    with pytest.raises(ParameterError):  # mode none: R * max_clients must stay far below q0
        UpdateEncryptor(make_secret_context(), PackingConfig(mode="none", clip_range=1e5))
