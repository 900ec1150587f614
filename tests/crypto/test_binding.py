"""Reading ciphertext coefficients for the aggregate MAC: the fast reader of SEAL's bytes must
give exactly what SEAL holds, and fall back (never misread) on layouts it does not parse."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import CkksAggregator, PackingConfig, UpdateEncryptor, make_secret_context
from crypto import binding
from crypto.header_check import parse_for
from crypto.seal_ops import SealOps
from crypto.slot_plan import SlotPlan
from crypto.seal_io import seal_save


def _loaded(ctx, packing: PackingConfig, blob: bytes) -> list:
    plan = SlotPlan(ctx.params, packing)
    env = parse_for(ctx, packing, plan, blob)
    return SealOps(ctx).load_checked(env.ciphertexts, plan.scale)


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


# --- the MAC itself (issue 20): pads bound to the ciphertext they tag ---------------------------

from crypto.binding import CONTRIBUTION_NOISE, CONTRIBUTION_UPDATE, MANIFEST_MAGIC, AggregateMac, Manifest, ManifestEntry  # noqa: E402
from crypto.errors import NotACiphertextError  # noqa: E402

RUN, RND, EPOCH = 7, 3, 0


@pytest.fixture(scope="module")
def mac() -> AggregateMac:
    ctx = make_secret_context("fedkv-2048")  # the 54-bit q0: the weaker of the two bounds
    from crypto import last_modulus

    return AggregateMac(ctx.mac_key, last_modulus(ctx))


def _summand(mac: AggregateMac, rng: np.random.Generator, node: str, n: int = 512, kind: int = CONTRIBUTION_UPDATE):
    c = rng.integers(0, mac.q, n, dtype=np.uint64)
    digest = binding.payload_digest(c.tobytes())  # stands in for the payload the coefficients come from
    return c, ManifestEntry(node, kind, digest, mac.tag(c, RUN, RND, EPOCH, node, kind, digest))


def _total(q: int, *vectors: np.ndarray) -> np.ndarray:
    return np.array([sum(int(v[i]) for v in vectors) % q for i in range(vectors[0].shape[0])], dtype=np.uint64)


def _affine(q: int, h: np.ndarray, c1: np.ndarray, c2: np.ndarray, k: int) -> np.ndarray:
    return np.array([(int(a) + k * (int(x) - int(y))) % q for a, x, y in zip(h, c1, c2)], dtype=np.uint64)


def _affine_tag(t1: bytes, t2: bytes, k: int, q: int) -> bytes:
    out = b""
    for w in range(binding.WORDS):
        a, b = (int.from_bytes(t[8 * w : 8 * w + 8], "big") for t in (t1, t2))
        out += ((b + k * (a - b)) % q).to_bytes(8, "big")
    return out


def _forgery(mac: AggregateMac, k: int, digest_of: str = "c2") -> bool:
    """Node a tagged c1 and c2 in one round; the honest sum is c2 + c_b. Does the node accept
    H + k(c1 - c2) under the tag t2 + k(t1 - t2)?"""
    rng = np.random.default_rng()
    c1, e1 = _summand(mac, rng, "a")
    c2, e2 = _summand(mac, rng, "a")
    cb, eb = _summand(mac, rng, "b")
    honest = Manifest(RUN, RND, EPOCH, (e2, eb))
    assert mac.check(_total(mac.q, c2, cb), honest)  # control: the honest sum passes
    digest = {"c1": e1.digest, "c2": e2.digest}[digest_of]
    forged = Manifest(RUN, RND, EPOCH, (ManifestEntry("a", CONTRIBUTION_UPDATE, digest, _affine_tag(e1.tag, e2.tag, k, mac.q)), eb))
    return mac.check(_affine(mac.q, _total(mac.q, c2, cb), c1, c2, k), forged)


@pytest.mark.parametrize("k", [2, 3, 2**8, 2**48, "random"])
@pytest.mark.parametrize("digest_of", ["c1", "c2"])
def test_the_affine_forgery_from_two_tags_of_one_round_is_refused(mac, k, digest_of) -> None:
    import secrets

    k = secrets.randbelow(mac.q - 4) + 4 if k == "random" else k
    assert not _forgery(mac, k, digest_of), k


def test_without_the_digest_in_the_pad_the_same_forgery_passes(mac, monkeypatch) -> None:
    """Why the pad's label holds H(c): the construction before issue 20 accepts the forgery."""
    real = AggregateMac._pad
    monkeypatch.setattr(AggregateMac, "_pad", lambda self, run, rnd, ep, node, kind, digest, w:
                        real(self, run, rnd, ep, node, kind, b"\0" * 32, w))
    assert _forgery(mac, 2**48)


def test_an_invented_digest_or_kind_or_round_is_refused(mac) -> None:
    rng = np.random.default_rng()
    (ca, ea), (cb, eb) = _summand(mac, rng, "a"), _summand(mac, rng, "b")
    total = _total(mac.q, ca, cb)
    assert mac.check(total, Manifest(RUN, RND, EPOCH, (ea, eb)))
    for bad in (ManifestEntry("a", CONTRIBUTION_UPDATE, bytes(32), ea.tag), ManifestEntry("a", CONTRIBUTION_NOISE, ea.digest, ea.tag),
                ManifestEntry("c", CONTRIBUTION_UPDATE, ea.digest, ea.tag)):
        assert not mac.check(total, Manifest(RUN, RND, EPOCH, (bad, eb)))
    assert not mac.check(total, Manifest(RUN, RND + 1, EPOCH, (ea, eb)))
    assert not mac.check(total, Manifest(RUN, RND, EPOCH, (ea,)))  # a summand left out


def test_tagging_one_ciphertext_again_gives_the_same_tag(mac) -> None:
    c, e = _summand(mac, np.random.default_rng(), "a")
    assert mac.tag(c, RUN, RND, EPOCH, "a", CONTRIBUTION_UPDATE, e.digest) == e.tag
    with pytest.raises(ValueError):
        mac.tag(c, RUN, RND, EPOCH, "a", CONTRIBUTION_UPDATE, e.digest[:16])


def test_manifest_round_trips_and_parses_strictly(mac) -> None:
    rng = np.random.default_rng()
    m = Manifest(RUN, RND, EPOCH, (_summand(mac, rng, "100")[1], _summand(mac, rng, "101", kind=CONTRIBUTION_NOISE)[1]))
    data = m.to_bytes()
    assert data[:4] == MANIFEST_MAGIC == b"FKM\x02" and Manifest.from_bytes(data) == m
    nid = 28 + 3  # first entry's node id
    bad = [data[:-1], data + b"\0", b"FKM\x01" + data[4:], data[:28],
           data[:28] + b"\0\0" + data[30:],  # empty node id
           data[:30] + b"\x07" + data[31:],  # unknown kind
           data[:nid] + b"\xff\xfe\xfd" + data[nid + 3:],  # not UTF-8
           data[:nid + 3 + 32] + b"\0\x08" + data[nid + 3 + 34:]]  # a one-word tag
    for blob in bad:
        with pytest.raises(NotACiphertextError):
            Manifest.from_bytes(blob)
