"""SegmentStore: round trips, corruption detection, crash safety (kill -9), disk-full handling."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import segments
from cache.segments import manifest as seg_manifest
from cache.segments import record as seg_record
from cache.errors import CacheError
from cache.segments import (
    CorruptBlockError,
    CorruptManifestError,
    OldFormatError,
    SegmentStore,
    StoreError,
    StoreFullError,
    UnknownRecordError,
    WrongKeyError,
)
from tests.cache.segment_writer import payload_for

KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))
HEADER = 32
TRAILER = 8
WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "segment_writer.py")


def manifest_records(directory, key=None) -> dict[bytes, dict]:
    """The committed records by key (an encrypted store's record map is sealed: needs the key)."""
    return {bytes.fromhex(k): v for k, v in segments.read_manifest(directory, key)["records"].items()}


def seg_path(directory, seg: int) -> str:
    return os.path.join(directory, f"seg-{seg:06d}.bin")


def seg_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("seg-"))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def fill(store: SegmentStore, n: int, prefix: str = "k", size: int = 300) -> dict[bytes, bytes]:
    data = {}
    for i in range(n):
        k = f"{prefix}{i:04d}".encode()
        p = payload_for(k)[:size] or b"x"
        store.put(k, p, {"i": i, "last_access": float(i)})
        data[k] = p
    return data


@pytest.fixture(params=[None, KEY], ids=["plain", "aes-gcm"])
def key(request):
    return request.param


# ------------------------------------------------------------------ round trips


def test_round_trip(tmp_path, key):
    payloads = {b"empty": b"", b"small": b"hello world", b"big": os.urandom(200_000),
                bytes(range(256)): b"\x00" * 10, b"view": memoryview(b"from a memoryview")}
    with SegmentStore(tmp_path, key=key, segment_bytes=64 << 10) as s:
        for i, (k, p) in enumerate(payloads.items()):
            s.put(k, p, {"i": i, "name": k.hex()[:8], "last_access": i / 3})
        assert len(s) == 0  # staged, not yet visible
        s.commit()
        assert len(s) == len(payloads) and set(s.keys()) == set(payloads)
        for i, (k, p) in enumerate(payloads.items()):
            assert k in s
            assert s.get(k) == bytes(p)
            assert s.meta(k) == {"i": i, "name": k.hex()[:8], "last_access": i / 3}
        st_ = s.stats()
        assert st_["records"] == 5 and st_["commits"] == 1 and st_["corrupt_records"] == 0
        assert st_["encrypted"] == (key is not None)
        assert st_["segments"] >= 2  # the 200 KB record does not fit a 64 KB segment with others
    with SegmentStore.open(tmp_path, key=key) as s:
        assert {k: s.get(k) for k in s.keys()} == {k: bytes(p) for k, p in payloads.items()}
    raw = b"".join(open(os.path.join(tmp_path, n), "rb").read() for n in seg_files(tmp_path))
    assert (b"hello world" in raw) == (key is None)  # encrypted: no plaintext on disk
    # nor any record key (segment headers carry HMAC ids), nor the map (the manifest is sealed)
    everything = raw + open(os.path.join(tmp_path, "manifest.json"), "rb").read()
    long_key = bytes(range(256))
    assert (long_key in everything) == (key is None)
    assert (long_key.hex().encode() in everything) == (key is None)
    assert (b'"last_access"' in everything) == (key is None)


def test_an_encrypted_manifest_tampered_under_its_checksum_is_corrupt_not_a_wrong_key(tmp_path):
    with SegmentStore(tmp_path, key=KEY) as s:
        fill(s, 3)
        s.commit()
    path = os.path.join(tmp_path, "manifest.json")
    m = json.load(open(path))
    m.pop("manifest_sha256")
    sealed = bytearray(base64.b64decode(m["sealed"]))
    sealed[5] ^= 1
    m["sealed"] = base64.b64encode(bytes(sealed)).decode()
    m["manifest_sha256"] = hashlib.sha256(seg_manifest.canonical(m)).hexdigest()
    open(path, "wb").write(seg_manifest.canonical(m))
    with pytest.raises(CorruptManifestError, match="fails authentication"):
        SegmentStore(tmp_path, key=KEY)


@pytest.mark.parametrize("version, error", [(1, OldFormatError), (3, StoreError)])
def test_other_manifest_versions(tmp_path, version, error):
    """An older format is corrupt for a cache (rebuilt, never misread); a newer one is refused
    untouched (an older fedkv must not wipe what a newer one wrote)."""
    with SegmentStore(tmp_path) as s:
        fill(s, 2)
        s.commit()
    path = os.path.join(tmp_path, "manifest.json")
    m = json.load(open(path))
    m.pop("manifest_sha256")
    m["version"] = version
    m["manifest_sha256"] = hashlib.sha256(seg_manifest.canonical(m)).hexdigest()
    open(path, "wb").write(seg_manifest.canonical(m))
    with pytest.raises(error, match=f"version {version}") as ei:
        SegmentStore(tmp_path)
    assert isinstance(ei.value, CorruptManifestError) == (version < 2)


def test_wrong_key_is_refused_at_open_wipes_nothing_and_leaks_no_key(tmp_path):
    """The record map is sealed: another key cannot even list it. A public key check tells a
    wrong key (WrongKeyError, nothing touched) from a tampered manifest (corrupt: rebuilt)."""
    with SegmentStore(tmp_path, key=KEY) as s:
        s.put(b"a", b"secret payload", {})
        s.put(b"b", b"other", {})
        s.commit()
    before = {n: open(os.path.join(tmp_path, n), "rb").read() for n in os.listdir(tmp_path)}
    with pytest.raises(WrongKeyError) as ei:
        SegmentStore(tmp_path, key=OTHER_KEY)
    assert not isinstance(ei.value, CorruptManifestError)  # a cache does not rebuild it
    msg = str(ei.value)
    for k in (KEY, OTHER_KEY):
        assert k.hex() not in msg and k.hex()[:8] not in msg and repr(k) not in msg
    assert b"secret" not in msg.encode()
    assert {n: open(os.path.join(tmp_path, n), "rb").read() for n in os.listdir(tmp_path)} == before
    with SegmentStore(tmp_path, key=KEY) as s:
        assert s.get(b"a") == b"secret payload"
    with pytest.raises(StoreError, match="encrypted"):
        SegmentStore(tmp_path)  # no key for an encrypted store
    with pytest.raises(ValueError):
        SegmentStore(tmp_path / "x", key=b"short")


def test_plain_store_refuses_a_key(tmp_path):
    SegmentStore(tmp_path).close()
    with pytest.raises(StoreError, match="without encryption"):
        SegmentStore(tmp_path, key=KEY)


def test_errors_hierarchy():
    assert issubclass(StoreError, CacheError)
    for cls in (CorruptBlockError, CorruptManifestError, StoreFullError, UnknownRecordError):
        assert issubclass(cls, StoreError)
    assert issubclass(StoreFullError, OSError) and issubclass(UnknownRecordError, KeyError)
    e = StoreFullError("budget")
    assert e.errno == errno.ENOSPC and str(e) == "budget"


def test_meta_and_key_validation(tmp_path):
    with SegmentStore(tmp_path) as s:
        with pytest.raises(ValueError):
            s.put(b"k", b"", {"x": float("nan")})
        with pytest.raises(TypeError):
            s.put(b"k", b"", {"x": [1]})
        with pytest.raises(TypeError):
            s.put(b"k", b"", {1: 1})
        with pytest.raises(ValueError):
            s.put(b"", b"", {})
        with pytest.raises(UnknownRecordError):
            s.get(b"nope")
        with pytest.raises(UnknownRecordError):
            s.delete(b"nope")
        assert s.stats()["staged_puts"] == 0


def test_lock_refuses_a_second_store(tmp_path):
    s = SegmentStore(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="in use") as ei:
        SegmentStore(tmp_path, lock_timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 3  # waited, within the bound
    assert os.path.join(tmp_path, "LOCK") in str(ei.value) and "0.2 s" in str(ei.value)
    with pytest.raises(StoreError, match="in use"):
        SegmentStore.wipe(tmp_path, lock_timeout_s=0)
    s.close()
    SegmentStore(tmp_path).close()
    with pytest.raises(StoreError, match="closed"):
        s.get(b"a")


# ------------------------------------------------------------------ corruption


@pytest.mark.parametrize("where", ["magic", "key_len", "nonce_or_len", "key", "payload", "checksum"])
def test_flipped_byte_is_detected(tmp_path, key, where):
    with SegmentStore(tmp_path, key=key) as s:
        data = fill(s, 3)
        s.commit()
    victim = b"k0001"
    r = manifest_records(tmp_path, key)[victim]
    id_len = len(victim) if key is None else 32  # an encrypted record carries HMAC(id key, key)
    off = r["off"] + {
        "magic": 1, "key_len": 8, "nonce_or_len": 22, "key": HEADER + 2,
        "payload": HEADER + id_len + 17, "checksum": r["len"] - 3}[where]
    flip(seg_path(tmp_path, r["seg"]), off)
    with SegmentStore(tmp_path, key=key) as s:
        with pytest.raises(CorruptBlockError) as ei:
            s.get(victim)
        assert ei.value.key == victim and "k0001".encode().hex() in str(ei.value)
        for k in (b"k0000", b"k0002"):
            assert s.get(k) == data[k]
        with pytest.raises(CorruptBlockError):
            s.get(victim)  # counted once per record
        assert s.stats()["corrupt_records"] == 1
        assert s.verify() == [victim]


def test_record_under_another_key_is_detected(tmp_path, key):
    """A manifest pointing key A at key B's record (valid manifest checksum) is caught."""
    with SegmentStore(tmp_path, key=key) as s:
        fill(s, 2)
        s.commit()
    a, b = b"k0000".hex(), b"k0001".hex()

    def swap(m):
        m["records"][a] = dict(m["records"][b], meta=m["records"][a]["meta"])

    _rewrite_manifest(tmp_path, swap, key)
    with SegmentStore(tmp_path, key=key) as s:
        with pytest.raises(CorruptBlockError, match="another key"):
            s.get(b"k0000")
        assert s.get(b"k0001") == payload_for(b"k0001")[:300]


def _rewrite_manifest(directory, edit, key=None) -> None:
    """Edit the committed record map and write it back valid (re-sealed with ``key``): what
    someone holding the key could do; the record checks must still catch it."""
    m = segments.read_manifest(directory, key)
    edit(m)
    for field in ("format", "version", "encrypted"):
        m.pop(field, None)
    data = seg_manifest.encode_manifest(m, seg_record.Keys(key) if key is not None else None)
    open(os.path.join(directory, "manifest.json"), "wb").write(data)


def test_encrypted_record_moved_to_another_segment_fails_its_tag(tmp_path):
    """The segment id is GCM associated data: an intact record copied into another segment
    (its checksum still right, the manifest re-signed) does not authenticate there."""
    with SegmentStore(tmp_path, key=KEY) as s:
        s.put(b"a", b"A" * 64, {})
        s.commit()
    shutil.copyfile(seg_path(tmp_path, 1), seg_path(tmp_path, 7))

    def move(m):
        m["segments"]["7"] = m["segments"]["1"]
        m["records"][b"a".hex()]["seg"] = 7

    _rewrite_manifest(tmp_path, move, KEY)
    with SegmentStore(tmp_path, key=KEY) as s:
        with pytest.raises(CorruptBlockError, match="authentication failed"):
            s.get(b"a")


def test_truncated_segment_is_detected_on_open_and_on_get(tmp_path, key):
    with SegmentStore(tmp_path, key=key) as s:
        data = fill(s, 4)
        s.commit()
    recs = manifest_records(tmp_path, key)
    last = recs[b"k0003"]
    os.truncate(seg_path(tmp_path, last["seg"]), last["off"] + last["len"] // 2)
    with SegmentStore(tmp_path, key=key) as s:
        st_ = s.stats()
        assert st_["truncated_records"] == 1 and st_["corrupt_records"] == 1
        with pytest.raises(CorruptBlockError, match="truncated"):
            s.get(b"k0003")
        for k in (b"k0000", b"k0001", b"k0002"):
            assert s.get(k) == data[k]
        # Cut while open (after the segment was mapped): an error, not a SIGBUS.
        r2 = recs[b"k0002"]
        os.truncate(seg_path(tmp_path, r2["seg"]), r2["off"] + 5)
        with pytest.raises(CorruptBlockError, match="truncated"):
            s.get(b"k0002")
        assert s.get(b"k0000") == data[b"k0000"]
        os.unlink(seg_path(tmp_path, r2["seg"]))
    with SegmentStore(tmp_path, key=key) as s:
        assert sorted(s.verify()) == sorted(data)
        assert s.stats()["truncated_records"] == 4


def _cut_half(p):
    os.truncate(p, os.path.getsize(p) // 2)


def _empty(p):
    open(p, "wb").close()


def _edit_digit(p):
    raw = open(p, "rb").read()
    i = raw.index(b'"off":') + 6  # a value edit that keeps the JSON valid
    open(p, "wb").write(raw[:i] + (b"7" if raw[i:i + 1] != b"7" else b"8") + raw[i + 1:])


def _garbage(p):
    open(p, "wb").write(os.urandom(100))


def _drop_checksum(p):
    m = json.load(open(p))
    del m["manifest_sha256"]
    open(p, "w").write(json.dumps(m))


def _delete(p):
    os.unlink(p)


@pytest.mark.parametrize("damage", [_cut_half, _empty, _edit_digit, _garbage, _drop_checksum,
                                    _delete])
def test_corrupt_manifest_raises_then_wipe_rebuilds(tmp_path, damage):
    with SegmentStore(tmp_path) as s:
        fill(s, 5)
        s.commit()
    damage(os.path.join(tmp_path, "manifest.json"))
    with pytest.raises(CorruptManifestError) as ei:
        SegmentStore.open(tmp_path)
    assert "manifest.json" in str(ei.value) and "SegmentStore.wipe(" in str(ei.value)
    (tmp_path / "mine.txt").write_text("not the store's")
    SegmentStore.wipe(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["LOCK", "mine.txt"]
    with SegmentStore.open(tmp_path) as s:
        assert len(s) == 0 and s.keys() == []
        s.put(b"new", b"data", {})
        s.commit()
    with SegmentStore.open(tmp_path) as s:
        assert s.get(b"new") == b"data"


# ------------------------------------------------------------------ commit semantics


def test_uncommitted_puts_are_invisible_after_reopen(tmp_path, key):
    with SegmentStore(tmp_path, key=key) as s:
        s.put(b"a", b"A", {})
        s.put(b"b", b"B", {})
        s.commit()
        committed_size = os.path.getsize(seg_path(tmp_path, 1))
        s.put(b"c", b"C" * 1000, {})
        s.put(b"a", b"A2", {})
        s.delete(b"b")
        s.update_meta(b"a", {"last_access": 5})
        assert s.get(b"a") == b"A" and s.get(b"b") == b"B" and b"c" not in s
        assert s.stats()["staged_puts"] == 2 and s.stats()["staged_deletes"] == 1
        assert os.path.getsize(seg_path(tmp_path, 1)) > committed_size  # bytes past the manifest
    with SegmentStore(tmp_path, key=key) as s:  # closed without commit = crashed
        assert sorted(s.keys()) == [b"a", b"b"]
        assert s.get(b"a") == b"A" and s.get(b"b") == b"B" and s.meta(b"a") == {}
        assert os.path.getsize(seg_path(tmp_path, 1)) == committed_size  # tail truncated away
        s.put(b"c", b"C", {})
        s.delete(b"b")
        s.commit()
    with SegmentStore(tmp_path, key=key) as s:
        assert sorted(s.keys()) == [b"a", b"c"] and s.get(b"c") == b"C"


def test_read_staged_sees_this_process_writes_but_a_restart_does_not(tmp_path, key):
    with SegmentStore(tmp_path, key=key, read_staged=True) as s:
        s.put(b"a", b"A", {"last_access": 1})
        s.commit()
        s.put(b"b", b"B", {"last_access": 2})
        s.update_meta(b"a", {"last_access": 3})
        assert b"b" in s and s.get(b"b") == b"B" and len(s) == 2
        assert s.keys_hottest_first() == [b"a", b"b"]
        s.delete(b"a")
        assert b"a" not in s and s.keys() == [b"b"]
        with pytest.raises(UnknownRecordError):
            s.get(b"a")
    with SegmentStore(tmp_path, key=key, read_staged=True) as s:
        assert s.keys() == [b"a"] and s.get(b"a") == b"A" and s.meta(b"a") == {"last_access": 1}


def test_put_then_delete_before_commit(tmp_path):
    with SegmentStore(tmp_path) as s:
        s.put(b"a", b"A", {})
        s.delete(b"a")
        s.commit()
        assert len(s) == 0


def test_orphan_segments_and_temp_manifest_are_removed(tmp_path):
    with SegmentStore(tmp_path) as s:
        s.put(b"a", b"A", {})
        s.commit()
    open(seg_path(tmp_path, 99), "wb").write(b"junk")
    open(os.path.join(tmp_path, "manifest.json.tmp"), "wb").write(b"{half")
    with SegmentStore(tmp_path) as s:
        assert s.get(b"a") == b"A"
        assert sorted(os.listdir(tmp_path)) == ["LOCK", "manifest.json", "seg-000001.bin"]


def test_keys_hottest_first_and_update_meta(tmp_path):
    with SegmentStore(tmp_path) as s:
        s.put(b"cold", b"", {"last_access": 1.0})
        s.put(b"none", b"", {})
        s.put(b"hot", b"", {"last_access": 9})
        s.put(b"warm", b"", {"last_access": 5.5})
        s.commit()
        assert s.keys_hottest_first() == [b"hot", b"warm", b"cold", b"none"]
        s.update_meta(b"cold", {"last_access": 100})
        assert s.keys_hottest_first()[0] == b"hot"  # not before commit
        s.commit()
    with SegmentStore(tmp_path) as s:
        assert s.keys_hottest_first() == [b"cold", b"hot", b"warm", b"none"]
        assert s.meta(b"cold") == {"last_access": 100}


def test_drop_where(tmp_path, key):
    with SegmentStore(tmp_path, key=key) as s:
        for i in range(12):
            s.put(f"k{i}".encode(), bytes([i]) * 50, {"model_version": i % 4, "kind": "kv"})
        s.commit()
        s.put(b"staged", b"x", {"model_version": 0})
        assert s.drop_where(lambda m: m["model_version"] < 2) == 7
        assert len(s) == 12  # visible at commit
        s.commit()
        assert sorted(s.keys()) == sorted(f"k{i}".encode() for i in range(12) if i % 4 >= 2)
        assert s.drop_where(lambda m: False) == 0
    with SegmentStore(tmp_path, key=key) as s:
        assert len(s) == 6 and all(s.meta(k)["model_version"] >= 2 for k in s.keys())


def test_compact_keeps_live_records_and_reclaims_space(tmp_path, key):
    with SegmentStore(tmp_path, key=key, segment_bytes=4096) as s:
        data = fill(s, 60, size=400)
        s.commit()
        before = s.stats()
        for k in list(data)[::2]:
            s.delete(k)
            del data[k]
        s.put(b"staged", b"kept by compact", {"last_access": 1e9})
        data[b"staged"] = b"kept by compact"
        s.commit()
        seg_bytes = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in seg_files(tmp_path))
        assert seg_bytes > before["live_bytes"]  # deleting frees no segment bytes yet
        s.put(b"late", b"staged then compacted", {})
        data[b"late"] = b"staged then compacted"
        old_files = set(seg_files(tmp_path))
        s.compact()
        after = s.stats()
        assert after["bytes_on_disk"] < 0.6 * before["bytes_on_disk"]
        assert after["segments"] < before["segments"] and after["staged_puts"] == 0
        assert not old_files & set(seg_files(tmp_path))  # every old segment deleted
        assert len(seg_files(tmp_path)) == after["segments"]
        assert {k: s.get(k) for k in s.keys()} == data
        assert s.meta(b"k0001") == {"i": 1, "last_access": 1.0}
        assert s.keys_hottest_first()[0] == b"staged"
        s.put(b"after", b"compaction", {})
        s.commit()
        data[b"after"] = b"compaction"
    with SegmentStore(tmp_path, key=key) as s:
        assert {k: s.get(k) for k in s.keys()} == data and s.verify() == []


def test_compact_drops_corrupt_records(tmp_path):
    with SegmentStore(tmp_path) as s:
        fill(s, 3)
        s.commit()
    r = manifest_records(tmp_path)[b"k0001"]
    flip(seg_path(tmp_path, r["seg"]), r["off"] + HEADER + 8)
    with SegmentStore(tmp_path) as s:
        s.compact()
        assert sorted(s.keys()) == [b"k0000", b"k0002"]
        assert s.stats()["compact_dropped"] == 1 and s.stats()["corrupt_records"] == 0


# ------------------------------------------------------------------ a full disk


def test_max_bytes_raises_store_full_and_recovers(tmp_path, key):
    s = SegmentStore(tmp_path, key=key, max_bytes=40_000, segment_bytes=8192)
    data = {}
    with pytest.raises(StoreFullError) as ei:
        for i in range(1000):
            k = f"k{i:04d}".encode()
            s.put(k, os.urandom(1000), {})
            data[k] = None
            if i % 5 == 4:
                s.commit()
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOSPC
    assert "max_bytes" in str(ei.value)
    s.commit()  # what was staged before the refusal still commits within the budget
    assert s.stats()["bytes_on_disk"] <= 40_000
    committed = {k: s.get(k) for k in s.keys()}
    assert set(committed) == set(data) and len(committed) > 20
    with pytest.raises(StoreFullError):
        s.put(b"more", os.urandom(1000), {})
    for k in list(committed)[: len(committed) // 2]:
        s.delete(k)
        del committed[k]
    s.compact()
    assert s.stats()["bytes_on_disk"] < 25_000
    s.put(b"more", b"fits again", {})
    s.commit()
    committed[b"more"] = b"fits again"
    s.close()
    with SegmentStore(tmp_path, key=key, max_bytes=40_000) as s:
        assert {k: s.get(k) for k in s.keys()} == committed


def _enospc_after(real_write, n_bytes_ok: int):
    """An os.write that writes ``n_bytes_ok`` bytes in total, then fails with ENOSPC."""
    left = [n_bytes_ok]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(memoryview(data)[: left[0]]))
        left[0] -= n
        return n

    return write


def test_enospc_on_put_truncates_the_partial_record(tmp_path, key, monkeypatch):
    with SegmentStore(tmp_path, key=key) as s:
        s.put(b"a", b"A" * 100, {})
        s.commit()
        s.put(b"b", b"B" * 100, {})
        size = os.path.getsize(seg_path(tmp_path, 1))
        with monkeypatch.context() as m:
            m.setattr(os, "write", _enospc_after(os.write, 50))  # half a record, then ENOSPC
            with pytest.raises(StoreFullError) as ei:
                s.put(b"c", b"C" * 5000, {})
        assert ei.value.errno == errno.ENOSPC and isinstance(ei.value.__cause__, OSError)
        assert os.path.getsize(seg_path(tmp_path, 1)) == size  # no torn record left behind
        s.put(b"d", b"D" * 100, {})
        s.commit()
        assert sorted(s.keys()) == [b"a", b"b", b"d"] and s.get(b"d") == b"D" * 100
    with SegmentStore(tmp_path, key=key) as s:
        assert sorted(s.keys()) == [b"a", b"b", b"d"] and s.verify() == []


def test_enospc_on_commit_keeps_the_old_manifest(tmp_path, key, monkeypatch):
    with SegmentStore(tmp_path, key=key) as s:
        s.put(b"a", b"A", {})
        s.commit()
        manifest = open(os.path.join(tmp_path, "manifest.json"), "rb").read()
        s.put(b"b", b"B", {})
        with monkeypatch.context() as m:
            m.setattr(os, "write", _enospc_after(os.write, 10))
            with pytest.raises(StoreFullError):
                s.commit()
        assert open(os.path.join(tmp_path, "manifest.json"), "rb").read() == manifest
        assert not os.path.exists(os.path.join(tmp_path, "manifest.json.tmp"))
        assert s.keys() == [b"a"] and s.stats()["staged_puts"] == 1
        s.commit()  # space is back: the staged put was kept
        assert sorted(s.keys()) == [b"a", b"b"]
    with SegmentStore(tmp_path, key=key) as s:
        assert s.get(b"b") == b"B"


def test_enospc_on_fsync_drops_staged_puts(tmp_path, monkeypatch):
    with SegmentStore(tmp_path) as s:
        s.put(b"a", b"A", {})
        s.commit()
        s.put(b"b", b"B", {})
        s.update_meta(b"a", {"last_access": 7})  # of durable bytes: survives the failure

        def bad_fsync(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(os, "fsync", bad_fsync)
            with pytest.raises(StoreFullError, match="dropped"):
                s.commit()
        assert s.keys() == [b"a"] and s.stats()["staged_puts"] == 1  # the meta update
        s.put(b"b", b"B again", {})
        s.commit()
        assert s.get(b"b") == b"B again" and s.meta(b"a") == {"last_access": 7}
    with SegmentStore(tmp_path) as s:
        assert sorted(s.keys()) == [b"a", b"b"] and s.verify() == []


def test_enospc_during_compact_leaves_the_store_intact(tmp_path, key, monkeypatch):
    with SegmentStore(tmp_path, key=key, segment_bytes=2048) as s:
        data = fill(s, 20)
        s.commit()
        for k in list(data)[:10]:
            s.delete(k)
            del data[k]
        s.commit()
        files = seg_files(tmp_path)
        with monkeypatch.context() as m:
            m.setattr(os, "write", _enospc_after(os.write, 1500))
            with pytest.raises(StoreFullError):
                s.compact()
        assert seg_files(tmp_path) == files  # the half-written new segments are gone
        assert {k: s.get(k) for k in s.keys()} == data
        s.compact()
        assert {k: s.get(k) for k in s.keys()} == data
    with SegmentStore(tmp_path, key=key) as s:
        assert {k: s.get(k) for k in s.keys()} == data


# ------------------------------------------------------------------ kill -9


def _apply(state: set, txn: tuple[list, list]) -> set:
    puts, dels = txn
    return (state | set(puts)) - set(dels)


def test_kill_9_never_loses_a_commit_nor_shows_a_torn_one(tmp_path):
    """SIGKILL a committing child at random moments, 25 times on one directory.

    After each kill the reopened store must equal the state after the last transaction the child
    confirmed (``OK``) or after the one it was committing, every record must verify and equal its
    deterministic payload, and nothing the manifest does not list may remain on disk.
    """
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    state: set[bytes] = set()
    confirmed_total = 0
    deadline = time.monotonic() + 25
    kills = in_commit = landed = 0
    while kills < 25 and time.monotonic() < deadline:
        proc = subprocess.Popen([sys.executable, WRITER, str(tmp_path), KEY.hex(), str(kills)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        try:
            reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
            reader.start()
            t0 = time.monotonic()
            while "READY\n" not in lines and proc.poll() is None and time.monotonic() - t0 < 10:
                time.sleep(0.002)
            assert "READY\n" in lines, f"writer did not start: {proc.stderr.read()}"
            time.sleep(rng.uniform(0.0, 0.25))
        finally:
            proc.kill()  # by pid, always
            proc.wait()
        reader.join(5)
        assert proc.returncode == -9, proc.stderr.read()
        proc.stderr.close()
        kills += 1
        pending = None
        for line in lines[1:]:
            if line.startswith("BEGIN"):
                assert pending is None
                _, _, p, _, d = (line.rstrip("\n") + " ").split(" ")[:5]
                pending = ([k.encode() for k in p.split(",") if k],
                           [k.encode() for k in d.split(",") if k])
            elif line == "OK\n":
                state = _apply(state, pending)
                pending = None
                confirmed_total += 1
        candidates = [state] + ([_apply(state, pending)] if pending else [])
        in_commit += pending is not None
        with SegmentStore.open(tmp_path, key=KEY) as s:
            got = set(s.keys())
            assert got in candidates, (
                f"seed {seed} kill {kills}: missing {sorted(state - got)[:5]}, "
                f"extra {sorted(got - candidates[-1])[:5]}")
            for k in got:  # every manifest key reads back whole, never torn
                assert s.get(k) == payload_for(k), f"seed {seed}: {k!r}"
            st_ = s.stats()
            assert st_["corrupt_records"] == 0 and st_["truncated_records"] == 0
            assert len(seg_files(tmp_path)) == st_["segments"]
            assert not os.path.exists(os.path.join(tmp_path, "manifest.json.tmp"))
        landed += pending is not None and got == candidates[-1] != state
        state = got
    print(f"kill -9: seed {seed}, {kills} kills, {confirmed_total} confirmed commits, "
          f"{in_commit} kills inside commit/compact ({landed} of them had already landed)")
    assert kills >= 20
    assert confirmed_total >= 20, "the child should have committed along the way"


# ------------------------------------------------------------------ model-based property


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.binary(max_size=300)),
        st.tuples(st.just("delete"), st.integers(0, 7), st.just(b"")),
        st.tuples(st.just("commit"), st.just(0), st.just(b"")),
        st.tuples(st.just("reopen"), st.just(0), st.just(b"")),
        st.tuples(st.just("compact"), st.just(0), st.just(b"")),
        st.tuples(st.just("touch"), st.integers(0, 7), st.just(b"")),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, encrypted=st.booleans(), read_staged=st.booleans())
def test_random_operations_match_a_dict_model(ops, encrypted, read_staged):
    """Reads match the committed dict (or, with read_staged, the pending one); a reopen (= crash)
    falls back to the committed dict."""
    key = KEY if encrypted else None
    with tempfile.TemporaryDirectory() as d:
        s = SegmentStore(d, key=key, segment_bytes=512, read_staged=read_staged)
        committed: dict[bytes, tuple[bytes, dict]] = {}
        pending = dict(committed)
        visible = committed
        try:
            for step, (op, n, payload) in enumerate(ops):
                k = f"key{n}".encode()
                if op == "put":
                    s.put(k, payload, {"step": step})
                    pending[k] = (payload, {"step": step})
                elif op == "delete":
                    if k in pending:
                        s.delete(k)
                        del pending[k]
                    else:
                        with pytest.raises(UnknownRecordError):
                            s.delete(k)
                elif op == "touch" and k in pending:
                    s.update_meta(k, {"last_access": step})
                    pending[k] = (pending[k][0], {**pending[k][1], "last_access": step})
                elif op in ("commit", "compact"):
                    s.commit() if op == "commit" else s.compact()
                    committed = dict(pending)
                elif op == "reopen":
                    s.close()
                    s = SegmentStore.open(d, key=key, segment_bytes=512, read_staged=read_staged)
                    pending = dict(committed)
                visible = pending if read_staged else committed
                assert sorted(s.keys()) == sorted(visible)
                assert len(s) == len(visible)
                assert (k in s) == (k in visible)
            for k, (p, m) in visible.items():
                assert s.get(k) == p and s.meta(k) == m
            s.close()
            s = SegmentStore.open(d, key=key)
            assert {k: (s.get(k), s.meta(k)) for k in s.keys()} == committed
            assert s.stats()["corrupt_records"] == 0
        finally:
            s.close()
