"""The server's header check before aggregation (issue 20): every public field of a summand is
pinned to the round's encoding, and a tag must have the MAC's format."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from crypto import PackingConfig, UpdateEncryptor, last_modulus, tag_problem, update_header_problem
from crypto.binding import WORDS
from crypto.errors import NotACiphertextError
from crypto.wire import ENVELOPE_AGGREGATE, pack_envelope, parse_envelope

DIM = 500


@pytest.fixture(scope="module")
def update(secret_ctx) -> bytes:
    return UpdateEncryptor(secret_ctx, PackingConfig()).encrypt(np.zeros(DIM), 1.0)


@pytest.mark.parametrize("field, change", [
    ("kind", {"kind": ENVELOPE_AGGREGATE}),
    ("mode", {"mode": 0}),
    ("key_id", {"key_id": b"\x07" * 16}),
    ("packing_fp", {"packing_fp": b"\x07" * 8}),
    ("layout_fp", {"layout_fp": b"\x01" * 8}),
    ("n_values", {"n_values": DIM + 1}),
    ("n_updates", {"n_updates": 2}),
])
def test_each_envelope_field_is_checked_against_the_round(secret_ctx, public_bytes, update, field, change) -> None:
    from crypto import load_context

    public = load_context(public_bytes)
    assert update_header_problem(update, public, PackingConfig(), DIM, 1) is None
    env = parse_envelope(update, max_ciphertext_bytes=1 << 30)
    crafted = pack_envelope(dataclasses.replace(env, **change))
    found = update_header_problem(crafted, public, PackingConfig(), DIM, 1)
    assert found is not None and found[0] == field, found


def test_the_ciphertext_count_and_a_malformed_envelope(secret_ctx, update) -> None:
    env = parse_envelope(update, max_ciphertext_bytes=1 << 30)
    two = pack_envelope(dataclasses.replace(env, ciphertexts=env.ciphertexts * 2))
    assert update_header_problem(two, secret_ctx, PackingConfig(), DIM, 1)[0] == "n_ciphertexts"
    with pytest.raises(NotACiphertextError):
        update_header_problem(update[:-3], secret_ctx, PackingConfig(), DIM, 1)


def test_a_tag_must_have_the_macs_format(secret_ctx) -> None:
    q = last_modulus(secret_ctx)
    good = b"".join(int(q - 1).to_bytes(8, "big") for _ in range(WORDS))
    assert tag_problem(good, q) is None
    assert "bytes" in tag_problem(good + b"\x00" * 8, q) and "bytes" in tag_problem(good[:8], q)
    assert "reduced" in tag_problem(int(q).to_bytes(8, "big") + good[8:], q)
