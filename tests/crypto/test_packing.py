"""Pure-integer half of the packing: exact at the headroom limit, unbiased quantization."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto import PackingConfig, ParameterError
from crypto.packing import pack_fields, saturate, stochastic_quantize, unpack_fields


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 16),
    max_clients=st.integers(1, 64),
    n=st.integers(0, 50),
    clients=st.data(),
)
def test_sum_of_packed_decodes_to_sum_of_fields(bits: int, max_clients: int, n: int, clients: st.DataObject) -> None:
    cfg = PackingConfig(bits=bits, max_clients=max_clients)
    k = cfg.fields_per_part(40)
    if k < 1:
        return
    n_clients = clients.draw(st.integers(1, max_clients))
    rng = np.random.default_rng(clients.draw(st.integers(0, 2**32 - 1)))
    # worst case half the time: every client at the top level
    top = clients.draw(st.booleans())
    qs = [np.full(n, cfg.levels) if top else rng.integers(0, cfg.levels + 1, n) for _ in range(n_clients)]
    packed = sum(pack_fields(q, cfg.field_bits, k) for q in qs)
    assert np.all(packed < 2**40)  # fits one slot part exactly
    np.testing.assert_array_equal(unpack_fields(packed, cfg.field_bits, k, n), sum(qs) if n else np.zeros(0))


def test_default_config_layout() -> None:
    cfg = PackingConfig()
    assert (cfg.bits, cfg.max_clients, cfg.field_bits, cfg.fields_per_part(40)) == (8, 32, 13, 3)
    assert cfg.max_clients * cfg.levels < 2**cfg.field_bits  # headroom holds the worst-case sum
    assert PackingConfig(mode="none").fields_per_part(40) == 1


def test_stochastic_rounding_is_unbiased_and_within_one_step(rng: np.random.Generator) -> None:
    cfg = PackingConfig(bits=4, clip_range=1.0)
    y = np.full(200_000, 0.123)
    q = stochastic_quantize(y, cfg.clip_range, cfg.levels, rng)
    decoded = q * cfg.step - cfg.clip_range
    assert np.all(np.abs(decoded - y) < cfg.step)
    assert abs(decoded.mean() - 0.123) < 5 * cfg.step / np.sqrt(y.size)  # unbiased
    assert set(np.unique(q)) <= {int(np.floor((0.123 + 1) / cfg.step)), int(np.ceil((0.123 + 1) / cfg.step))}


def test_saturate_counts() -> None:
    y, n = saturate(np.array([-3.0, -1.0, 0.5, 1.0, 2.0]), 1.0)
    assert n == 2 and y.tolist() == [-1.0, -1.0, 0.5, 1.0, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [{"mode": "fancy"}, {"bits": 0}, {"bits": 30}, {"clip_range": 0.0}, {"clip_range": float("inf")},
     {"max_clients": 0}, {"max_weight": -1.0}, {"on_saturation": "ignore"}],
)
def test_bad_config_rejected(kwargs: dict) -> None:
    with pytest.raises(ParameterError):
        PackingConfig(**kwargs)


def test_fingerprint_tracks_encoding_not_policy() -> None:
    assert PackingConfig().fingerprint() == PackingConfig(on_saturation="raise").fingerprint()
    assert PackingConfig().fingerprint() != PackingConfig(bits=7).fingerprint()
    assert PackingConfig().fingerprint() != PackingConfig(mode="none").fingerprint()
