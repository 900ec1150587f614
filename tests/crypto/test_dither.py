"""Subtractive dither: the rounding error is uniform whatever the value (so distributed DP's sum
stays a post-processing of the Gaussian mechanism), the mean decrypts exactly within its bound,
and a missing or foreign dither is refused."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    LayoutMismatchError,
    PackingConfig,
    ParameterError,
    UpdateEncryptor,
)
from crypto.dp.dither import dither, dither_total

PACKING = PackingConfig(bits=6, clip_range=1.0, max_clients=8, dither=True)
KEY = b"k" * 32


def test_dither_is_a_keyed_function_of_the_label() -> None:
    a = dither(KEY, 1, 2, 0, "n1", 0, 1000)
    assert np.array_equal(a, dither(KEY, 1, 2, 0, "n1", 0, 1000))
    assert not np.array_equal(a, dither(KEY, 1, 3, 0, "n1", 0, 1000))
    assert not np.array_equal(a, dither(b"j" * 32, 1, 2, 0, "n1", 0, 1000))
    assert a.min() >= 0 and a.max() < 1 and abs(a.mean() - 0.5) < 0.05


@pytest.mark.parametrize("offset", [0.0, 0.25, 0.5])
def test_rounding_error_does_not_depend_on_the_value(secret_ctx, offset: float) -> None:
    """Values on the grid (offset 0) round exactly under stochastic rounding; dithered, every
    value gets the same uniform error: mean 0, std step/sqrt(12)."""
    enc = UpdateEncryptor(secret_ctx, PACKING)
    n = 20_000
    y = np.full(n, (10 + offset) * PACKING.step - PACKING.clip_range)
    enc.encrypt(y, dither=dither(KEY, 1, 1, 0, "a", 0, n))
    err = -enc.last_residual / PACKING.step
    assert err.min() >= -0.5 - 1e-9 and err.max() <= 0.5 + 1e-9
    assert abs(err.mean()) < 0.01 and err.std() == pytest.approx(1 / np.sqrt(12), rel=0.03)


def test_dithered_mean_decrypts_within_half_a_step_per_client(secret_ctx, public_bytes, rng) -> None:
    enc, agg = UpdateEncryptor(secret_ctx, PACKING), CkksAggregator(public_bytes, PACKING)
    xs, labels = rng.uniform(-1, 1, (8, 5000)), [(f"n{i}", 0) for i in range(8)]
    for x, (node, kind) in zip(xs, labels):
        agg.add(enc.encrypt(x, dither=dither(KEY, 7, 3, 1, node, kind, 5000)))
    dec = AggregateDecryptor(secret_ctx, PACKING)
    mean = dec.decrypt(agg.result(), dither_total=dither_total(KEY, 7, 3, 1, labels, 5000)).mean
    assert np.abs(mean - xs.mean(axis=0)).max() <= 0.5 * PACKING.step + 1e-9
    wrong = dec.decrypt(agg.result(), dither_total=dither_total(KEY, 7, 4, 1, labels, 5000)).mean
    assert np.abs(wrong - xs.mean(axis=0)).max() > 0.5 * PACKING.step  # another round's dithers do not fit


def test_missing_or_foreign_dither_is_refused(secret_ctx, public_bytes) -> None:
    enc = UpdateEncryptor(secret_ctx, PACKING)
    with pytest.raises(ParameterError):
        enc.encrypt(np.zeros(100))
    with pytest.raises(LayoutMismatchError):
        enc.encrypt(np.zeros(100), dither=np.full(100, 1.0))
    with pytest.raises(LayoutMismatchError):
        enc.encrypt(np.zeros(100), dither=np.zeros(99))
    with pytest.raises(ParameterError):
        UpdateEncryptor(secret_ctx, PackingConfig()).encrypt(np.zeros(100), dither=np.zeros(100))
    agg = CkksAggregator(public_bytes, PACKING)
    agg.add(enc.encrypt(np.zeros(100), dither=np.zeros(100)))
    with pytest.raises(ParameterError):
        AggregateDecryptor(secret_ctx, PACKING).decrypt(agg.result())
