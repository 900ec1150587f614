"""Error feedback: what quantization and saturation leave out of one update is carried into the
next, so the error of the running sum stays below one step instead of growing with rounds."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import (
    AggregateDecryptor,
    CkksAggregator,
    LayoutMismatchError,
    NonFiniteUpdateError,
    PackingConfig,
    UpdateEncryptor,
)

PACKING = PackingConfig(bits=4, clip_range=0.2, max_clients=8)


def test_residual_is_what_the_ciphertext_does_not_carry(secret_ctx, public_bytes, rng) -> None:
    enc = UpdateEncryptor(secret_ctx, PACKING, rng=rng)
    x = rng.uniform(-0.3, 0.3, 5000)  # some values beyond the range: saturated
    blob = enc.encrypt(x)
    agg = CkksAggregator(public_bytes, PACKING)
    agg.add(blob)
    sent = AggregateDecryptor(secret_ctx, PACKING).decrypt(agg.result()).mean
    assert np.allclose(x - sent, enc.last_residual, atol=1e-9)
    inside = np.abs(x) <= PACKING.clip_range
    assert np.abs(enc.last_residual[inside]).max() < PACKING.step
    assert enc.last_report.saturated == int((~inside).sum())


def test_running_sum_error_stays_within_one_step_over_rounds(secret_ctx, public_bytes, rng) -> None:
    enc, dec = UpdateEncryptor(secret_ctx, PACKING, rng=rng), AggregateDecryptor(secret_ctx, PACKING)
    carry, true_sum, sent_sum, plain_err = np.zeros(3000), np.zeros(3000), np.zeros(3000), []
    for _ in range(8):
        x = rng.normal(0.0, 0.05, 3000)
        agg = CkksAggregator(public_bytes, PACKING)
        agg.add(enc.encrypt(x, carry=carry))
        carry = enc.last_residual
        true_sum += x
        sent_sum += dec.decrypt(agg.result()).mean
        plain_err.append(np.abs(sent_sum - true_sum).max())
    # sum of what was sent = sum of what was meant - the last residual (telescoping)
    assert np.allclose(true_sum - sent_sum, carry, atol=1e-9)
    assert np.abs(carry).max() < PACKING.step + 1e-12  # no saturation with this seed: the residual is a rounding
    assert plain_err[-1] < PACKING.step


@pytest.mark.parametrize("carry,error", [(np.zeros(10), LayoutMismatchError),
                                         (np.full(100, np.nan), NonFiniteUpdateError)])
def test_bad_carry_is_refused(secret_ctx, carry, error) -> None:
    enc = UpdateEncryptor(secret_ctx, PACKING)
    with pytest.raises(error):
        enc.encrypt(np.zeros(100), carry=carry)
