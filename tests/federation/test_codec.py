"""Plaintext codec: the contract the CKKS codec will keep (bytes in, weighted mean out)."""

from __future__ import annotations

import numpy as np
import pytest

from federation.codec import HEADER_BYTES, CodecError, PlainAggregator, PlainClientCodec, make_aggregator, make_client_codec

DIM = 7


def test_weighted_mean_roundtrip() -> None:
    codec, agg = PlainClientCodec(DIM), PlainAggregator(DIM)
    a, b = np.arange(DIM, dtype=np.float32), -np.ones(DIM, dtype=np.float32)
    agg.add(codec.encode(a, 3.0))
    agg.add(codec.encode(b, 1.0))
    assert agg.count == 2
    mean = codec.decode_mean(agg.result())
    np.testing.assert_allclose(mean, (3 * a + b) / 4, rtol=1e-6)


def test_update_size_is_fp32_plus_header() -> None:
    blob = PlainClientCodec(DIM).encode(np.zeros(DIM), 1.0)
    assert len(blob) == 4 * DIM + HEADER_BYTES


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:-4], "length"),
        (lambda b: b[:10], "shorter"),
        (lambda b: b[:4] + b"A" + b[5:], "kind"),
        (lambda b: b[:-4] + np.float32(np.nan).tobytes(), "NaN"),
    ],
)
def test_aggregator_rejects_bad_bytes_and_keeps_state(mutate, match) -> None:
    codec, agg = PlainClientCodec(DIM), PlainAggregator(DIM)
    good = codec.encode(np.ones(DIM), 2.0)
    agg.add(good)
    with pytest.raises(CodecError, match=match):
        agg.add(mutate(good))
    assert agg.count == 1
    np.testing.assert_allclose(codec.decode_mean(agg.result()), np.ones(DIM))


def test_wrong_dimension_and_weight_rejected() -> None:
    with pytest.raises(CodecError, match="dim"):
        PlainAggregator(DIM + 1).add(PlainClientCodec(DIM).encode(np.ones(DIM), 1.0))
    with pytest.raises(CodecError, match="weight"):
        PlainClientCodec(DIM).encode(np.ones(DIM), 0.0)
    with pytest.raises(CodecError, match="shape"):
        PlainClientCodec(DIM).encode(np.ones(DIM + 1), 1.0)
    with pytest.raises(CodecError, match="NaN"):
        PlainClientCodec(DIM).encode(np.full(DIM, np.inf), 1.0)


def test_oversized_blob_rejected() -> None:
    agg = PlainAggregator(DIM, max_bytes=16)
    with pytest.raises(CodecError, match="exceeds"):
        agg.add(PlainClientCodec(DIM).encode(np.ones(DIM), 1.0))


def test_client_cannot_decode_an_update_as_aggregate() -> None:
    codec = PlainClientCodec(DIM)
    with pytest.raises(CodecError, match="kind"):
        codec.decode_mean(codec.encode(np.ones(DIM), 1.0))


def test_empty_aggregate_and_noise() -> None:
    agg = PlainAggregator(DIM)
    with pytest.raises(CodecError, match="no updates"):
        agg.result()
    codec = PlainClientCodec(DIM)
    agg.add(codec.encode(np.zeros(DIM), 1.0))
    agg.add_noise(1.0, rng=np.random.default_rng(0))
    assert np.any(codec.decode_mean(agg.result()) != 0)


def test_noise_shares_add_variance() -> None:
    """add_noise(std, shares=k) adds k shares of std each: N(0, k·std²) (crypto's semantics)."""
    codec = PlainClientCodec(20000)
    agg = PlainAggregator(20000)
    agg.add(codec.encode(np.zeros(20000), 1.0))
    agg.add_noise(0.5, shares=4, rng=np.random.default_rng(1))
    assert agg.noise_shares == 4
    assert np.std(codec.decode_mean(agg.result())) == pytest.approx(1.0, rel=0.03)


def test_he_needs_keys_and_packing() -> None:
    with pytest.raises(CodecError, match="secret CKKS context"):
        make_client_codec(True, DIM)
    with pytest.raises(CodecError, match="public CKKS context"):
        make_aggregator(True, DIM)
