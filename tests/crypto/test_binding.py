"""Reading ciphertext coefficients for the aggregate MAC: the fast reader of SEAL's bytes must
give exactly what SEAL holds, and fall back (never misread) on layouts it does not parse."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import CkksAggregator, PackingConfig, UpdateEncryptor, make_secret_context
from crypto import binding
from crypto.ckks import _parse_for, _Plan, _SealOps
from crypto.context import seal_save


def _loaded(ctx, packing: PackingConfig, blob: bytes) -> list:
    plan = _Plan(ctx.params, packing)
    env = _parse_for(ctx, packing, plan, blob)
    return _SealOps(ctx).load_checked(env.ciphertexts, plan.scale)


@pytest.mark.parametrize("preset", ["fedkv-2048", "fedkv-4096", "fedkv-8192"])
def test_fast_coefficients_equal_seals_own_for_updates_and_aggregates(preset: str) -> None:
    ctx = make_secret_context(preset)
    packing = PackingConfig(clip_range=0.5, max_clients=8)
    enc = UpdateEncryptor(ctx, packing, rng=np.random.default_rng(0))
    blob = enc.encrypt(np.random.default_rng(1).uniform(-0.5, 0.5, 20_000))
    agg = CkksAggregator(ctx.public_bytes(), packing)
    agg.add(blob)
    agg.add(blob)
    for data in (blob, agg.result()):  # seeded (one stored polynomial) and full ciphertexts
        cts = _loaded(ctx, packing, data)
        slow = np.concatenate([binding._slow_coefficients(ct) for ct in cts])
        assert np.array_equal(binding.coefficients(cts), slow)
        if ctx.params.q0_bits == 60:  # uniform 60-bit words do not compress: the fast path ran
            assert all(binding._seal_body(seal_save(ct)) is not None for ct in cts)
        # (a 54-bit prime leaves 10 bits per word that zstd compresses: the slow path, still exact)


@pytest.mark.parametrize("blob", [b"", b"\x5e\xa1" + b"\0" * 10, b"junk" * 8,
                                  b"\x5e\xa1\x10\x04\x03\x01" + b"\0" * 30,  # zlib: not read here
                                  b"\x5e\xa1\x10\x04\x03\x02\0\0" + b"\0" * 8 + b"\x28\xb5\x2f\xfd\x00"])
def test_unreadable_layouts_are_refused_by_the_fast_reader(blob: bytes) -> None:
    assert binding._seal_body(blob) is None


def test_a_compressed_zstd_block_is_refused() -> None:
    # frame header: single segment, 1-byte content size; then a compressed block (type 2)
    frame = bytes([0x20, 8]) + (1 | (2 << 1) | (8 << 3)).to_bytes(3, "little") + b"\0" * 8
    assert binding._zstd_raw_frame(memoryview(frame)) is None
    raw = bytes([0x20, 8]) + (1 | (0 << 1) | (8 << 3)).to_bytes(3, "little") + b"ABCDEFGH"
    assert binding._zstd_raw_frame(memoryview(raw)) == b"ABCDEFGH"
