"""KVCache.open / flush / close over a real SegmentStore (issue 10 item 6): a restart finds
the K/V blocks, tensors and model version; old versions are dropped on disk; a corrupt
directory is rebuilt with a warning."""

import logging
import os

import pytest
import torch

from cache import KVCache
from tests.cache.conftest import feed, small_config

KEY = bytes(range(32))


def config(**kw):
    return small_config(block_size=8, pool_bytes=64 << 10, warm_bytes=32 << 10, **kw)


def cached_prompt(kv, prompt, seed=0):
    s = kv.open_session()
    ks, _ = feed(kv, s, prompt, seed=seed)
    kv.close_session(s)
    return ks


def test_a_restart_finds_blocks_tensors_and_version(tmp_path):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    kv.set_version(3)
    ks = cached_prompt(kv, list(range(16)))
    kv.put_tensor("param/w", torch.arange(6.0), version=3)
    kv.close()
    kv2 = KVCache.open(tmp_path, config(), key=KEY)
    assert kv2.version == 3 and kv2.found_on_disk == 2
    assert torch.equal(kv2.get_tensor("param/w"), torch.arange(6.0))
    s = kv2.open_session()
    assert kv2.match_prefix(s, list(range(16)) + [0]) == 16
    assert torch.equal(kv2.read(s, 1)[0], ks[1])  # bit-exact after the round trip
    kv2.close()


def test_nothing_readable_without_the_key(tmp_path):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    cached_prompt(kv, list(range(16)))
    kv.put_tensor("grad/u", torch.ones(4))
    kv.close()
    blob = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert torch.ones(4).numpy().tobytes() not in blob  # encrypted at rest


def test_a_new_model_version_drops_old_kv_on_disk(tmp_path):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    cached_prompt(kv, list(range(16)))
    kv.flush()
    kv.bump_version()
    kv.close()
    kv2 = KVCache.open(tmp_path, config(), key=KEY)
    assert kv2.found_on_disk == 0 and kv2.version == 1
    s = kv2.open_session()
    assert kv2.match_prefix(s, list(range(16)) + [0]) == 0


def test_a_corrupt_directory_is_rebuilt_with_a_warning(tmp_path, caplog):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    cached_prompt(kv, list(range(16)))
    kv.close()
    manifests = [p for p in tmp_path.rglob("*") if p.is_file() and "manifest" in p.name]
    assert manifests
    manifests[0].write_bytes(manifests[0].read_bytes()[: len(manifests[0].read_bytes()) // 2])
    with caplog.at_level(logging.WARNING, logger="fedkv.cache"):
        kv2 = KVCache.open(tmp_path, config(), key=KEY)
    assert "rebuilding it empty" in caplog.text
    assert kv2.found_on_disk == 0
    cached_prompt(kv2, list(range(8)))  # and it works
    kv2.close()


def test_a_wrong_key_is_refused_and_wipes_nothing(tmp_path):
    """The record map is sealed: another key cannot list it, and the cache must not take that
    for corruption (rebuilding would destroy the node's parameters and K/V)."""
    from cache.segments import WrongKeyError

    kv = KVCache.open(tmp_path, config(), key=KEY)
    cached_prompt(kv, list(range(8)))
    kv.put_tensor("param/w", torch.ones(2))
    kv.close()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(WrongKeyError, match="another key"):
        KVCache.open(tmp_path, config(), key=bytes(32))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    kv2 = KVCache.open(tmp_path, config(), key=KEY)
    assert kv2.found_on_disk == 1 and torch.equal(kv2.get_tensor("param/w"), torch.ones(2))
    kv2.release()


def test_a_flipped_byte_in_a_block_is_dropped_and_recomputed(tmp_path):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    cached_prompt(kv, list(range(8)))
    kv.close()
    seg = max((p for p in tmp_path.rglob("seg-*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(seg.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the first block's record
    seg.write_bytes(bytes(data))
    kv2 = KVCache.open(tmp_path, config(), key=KEY)
    s = kv2.open_session()
    assert kv2.match_prefix(s, list(range(8)) + [0]) == 0  # not served: recompute instead
    assert kv2.stats()["cold_corrupt_blocks"] == 1


def test_token_ids_are_not_in_the_plaintext_manifest(tmp_path):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    cached_prompt(kv, [1234567] * 8)
    kv.close()
    manifest = next(tmp_path.rglob("manifest.json")).read_text()
    assert "1234567" not in manifest and "tokens" not in manifest


def test_a_full_disk_degrades_to_memory_only_and_loses_nothing_committed(tmp_path, caplog):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    ks = cached_prompt(kv, list(range(16)))
    kv.close()  # committed: 2 blocks
    kv = KVCache.open(tmp_path, config(), key=KEY, max_bytes=1)  # a disk with no room left
    with caplog.at_level(logging.WARNING, logger="fedkv.cache"):
        for i in range(6):
            cached_prompt(kv, list(range(1000 + 8 * i, 1008 + 8 * i)), seed=i)
        kv.put_tensor("param/w", torch.ones(3))
        kv.flush()  # the disk is "full": a warning, and the cache keeps working in memory
    assert "failed" in caplog.text
    s = kv.open_session()
    assert kv.match_prefix(s, list(range(1000, 1008)) + [0]) == 8  # still served from memory
    kv.close()
    kv2 = KVCache.open(tmp_path, config(), key=KEY)  # what was committed before is intact
    s = kv2.open_session()
    assert kv2.match_prefix(s, list(range(16)) + [0]) == 16
    assert torch.equal(kv2.read(s, 0)[0], ks[0])


def test_repeated_flushes_do_not_grow_the_directory_without_bound(tmp_path):
    kv = KVCache.open(tmp_path, config(), key=KEY)
    sizes = []
    for i in range(12):
        kv.put_tensor("param/w", torch.randn(20_000), version=None)  # 80 KB rewritten each time
        kv.flush()
        sizes.append(sum(p.stat().st_size for p in tmp_path.glob("seg-*")))
    assert max(sizes[4:]) < 3.5 * 80_000  # compacted: bounded by ~2x the live bytes
    kv.close()
    kv2 = KVCache.open(tmp_path, config(), key=KEY)
    assert kv2.get_tensor("param/w").numel() == 20_000
