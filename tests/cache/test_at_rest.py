"""Issue 20, deliverable 2: an at-rest cache that hides what it stores.

Each test is an attack by a local reader (or user) who has the node's cache directory but not
its key: confirming a guessed prompt from the record ids, reading or locking files that
group/other can reach, stalling the node on a lock, and an old-format directory misread."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cache import CacheError, KVCache
from cache.coherence import Mode
from cache.coherence_file import FileDirectory
from cache.prefix import ROOT, block_hash
from tests.cache.conftest import feed, small_config

KEY = bytes(range(32))
BLOCK = 8
SYSTEM = [9001, 17, 4242, 5, 77, 123, 31337, 8]  # a shared system prompt: one block


def config(**kw):
    return small_config(block_size=BLOCK, pool_bytes=64 << 10, warm_bytes=32 << 10, **kw)


def cache_prompt(kv: KVCache, prompt: list[int]) -> None:
    s = kv.open_session()
    feed(kv, s, prompt)
    kv.close_session(s)


def chained_ids(prompt: list[int], versions=range(4)) -> list[bytes]:
    """The unkeyed content addresses of every full block of ``prompt`` (the in-memory prefix
    hashes) under each plausible model version: what a reader without the key can compute."""
    out = []
    for v in versions:
        parent = ROOT
        for i in range(len(prompt) // BLOCK):
            parent = block_hash(parent, prompt[i * BLOCK:(i + 1) * BLOCK], v)
            out.append(parent)
    return out


def every_byte(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


def seen(blob: bytes, ids: list[bytes]) -> bool:
    """The reader's observation for a guess: does any candidate id occur, raw or in hex (either
    case), in any file?"""
    low = blob.lower()
    return any(i in blob or i.hex().encode() in low for i in ids)


def populated_node_dir(tmp_path: Path, prompts: list[list[int]]) -> Path:
    """A node's cache directory as another process would leave it: blocks hot, warm and cold,
    tensors, the model version, a coherence directory with a serving agent."""
    d = tmp_path / "kv-cache"
    kv = KVCache.open(d, config(), key=KEY)
    kv.set_version(2)
    for p in prompts:
        cache_prompt(kv, p)
    kv.put_tensor("param/w", torch.arange(6.0), version=2)
    kv.flush()
    kv.offload("cold")  # every block through the cold tier as well
    kv.flush()
    coh = FileDirectory(d / "coherence", Mode.STRONG, timeout_s=1.0)
    agent = coh.join("server")
    agent.acquire_read("param")
    kv.close()
    return d


# ------------------------------------------------------------------ (1) confirming a guess


def test_a_guessed_stored_prompt_looks_like_an_absent_one(tmp_path):
    stored = SYSTEM + [3, 1, 4, 1, 5, 9, 2, 6]
    absent = SYSTEM[:-1] + [99] + [2, 7, 1, 8, 2, 8, 1, 8]
    d = populated_node_dir(tmp_path, [stored])
    kv = KVCache.open(d, config(), key=KEY)  # the blocks really are there (with the key)
    s = kv.open_session()
    assert kv.found_on_disk == 2 and kv.match_prefix(s, stored + [0]) == 16
    kv.release()
    blob = every_byte(d)
    assert seen(blob, chained_ids(stored)) is False
    assert seen(blob, chained_ids(stored)) == seen(blob, chained_ids(absent))


def test_an_unknown_digit_inside_a_block_cannot_be_brute_forced(tmp_path):
    secret = 7
    template = SYSTEM + [50, 51, 52, None, 54, 55, 56, 57]
    fill = lambda digit: [digit if t is None else t for t in template]  # noqa: E731
    d = populated_node_dir(tmp_path, [fill(secret)])
    blob = every_byte(d)
    hits = [digit for digit in range(10) if seen(blob, chained_ids(fill(digit)))]
    assert hits == []  # before: [7], the digit read back from the record ids


# ------------------------------------------------------------------ (2) owner-only modes


def modes(d: Path) -> dict[str, str]:
    out = {".": oct(d.stat().st_mode & 0o777)}
    for p in d.rglob("*"):
        out[str(p.relative_to(d))] = oct(p.stat().st_mode & 0o777)
    return out


def assert_owner_only(d: Path) -> None:
    bad = {n: m for n, m in modes(d).items()
           if m != (oct(0o700) if (d / n).is_dir() else oct(0o600))}
    assert bad == {}, f"not owner-only (dirs 0700, files 0600): {bad}"


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask-022", "umask-000"])
def test_the_directory_and_every_file_are_owner_only(tmp_path, umask):
    old = os.umask(umask)
    try:
        d = tmp_path / "kv-cache"
        kv = KVCache.open(d, config(), key=KEY)
        coh = FileDirectory(d / "coherence", Mode.STRONG, timeout_s=1.0)
        coh.join("server").acquire_read("param")
        cache_prompt(kv, SYSTEM * 2)
        kv.offload("cold")  # a write: segment records staged
        assert_owner_only(d)
        kv.put_tensor("param/w", torch.ones(3))
        kv.flush()  # manifest, tensors
        assert_owner_only(d)
        kv.close()
        assert_owner_only(d)
    finally:
        os.umask(old)


# ------------------------------------------------------------------ (3) reachable directories


def test_opening_a_cache_directory_others_can_reach_is_refused(tmp_path):
    d = tmp_path / "kv-cache"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(CacheError) as ei:
        KVCache.open(d, config(), key=KEY)
    msg = str(ei.value)
    assert str(d) in msg and "755" in msg and "chmod 700" in msg
    assert type(ei.value).__name__ == "UnsafePermissionsError"
    assert os.listdir(d) == []  # refused before anything was created in it
    d.chmod(0o700)
    KVCache.open(d, config(), key=KEY).close()
    d.chmod(0o750)  # group only is refused too
    with pytest.raises(CacheError, match="chmod 700"):
        KVCache.open(d, config(), key=KEY)


def test_opening_a_coherence_directory_others_can_reach_is_refused(tmp_path):
    c = tmp_path / "coherence"
    c.mkdir()
    c.chmod(0o777)
    with pytest.raises(CacheError) as ei:
        FileDirectory(c, Mode.STRONG, timeout_s=1.0)
    assert str(c) in str(ei.value) and "777" in str(ei.value) and "chmod 700" in str(ei.value)
    assert os.listdir(c) == []


# ------------------------------------------------------------------ (4) a lock held elsewhere

_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


class LockHolder:
    """Another process holding ``flock`` on ``path`` until the test ends."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def __enter__(self) -> "LockHolder":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.timeout(60)
def test_a_held_cache_lock_fails_open_and_attach_within_the_timeout(tmp_path):
    d = tmp_path / "kv-cache"
    kv = KVCache.open(d, config(lock_timeout_s=0.5), key=KEY)
    cache_prompt(kv, SYSTEM * 2)
    kv.close()  # released: another process takes the directory's lock
    with LockHolder(d / "LOCK"):
        for attempt in (lambda: KVCache.open(d, config(lock_timeout_s=0.5), key=KEY),
                        lambda: kv.attach(d, key=KEY)):  # what a node's persist() does first
            t0 = time.monotonic()
            with pytest.raises(CacheError) as ei:
                attempt()
            took = time.monotonic() - t0
            assert 0.4 < took < 5, took
            msg = str(ei.value)
            assert str(d / "LOCK") in msg and "another process" in msg and "0.5" in msg
    kv.attach(d, key=KEY)  # free again
    kv.close()


@pytest.mark.timeout(20)
def test_a_held_coherence_lock_fails_within_the_timeout_instead_of_hanging(tmp_path):
    c = tmp_path / "coherence"
    FileDirectory(c, Mode.STRONG, timeout_s=0.5)
    with LockHolder(c / "coherence.lock"):
        t0 = time.monotonic()
        with pytest.raises(CacheError) as ei:
            FileDirectory(c, Mode.STRONG, timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        assert str(c / "coherence.lock") in str(ei.value) and "another process" in str(ei.value)


# ------------------------------------------------------------------ (5) the old format


def write_old_format_store(d: Path, key: bytes) -> bytes:
    """A version-1 directory as the code before issue 20 wrote it: record keys (the unkeyed
    chained hashes) in the clear in the segment headers and in the plaintext manifest."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    d.mkdir(mode=0o700)
    rid = block_hash(ROOT, SYSTEM, 0)
    payload = b"old payload"
    nonce = os.urandom(12)
    body = AESGCM(key).encrypt(nonce, payload, b"fedkv-seg-v1\0" + (1).to_bytes(8, "little") + rid)
    header = struct.pack("<4sBBBBIQ12s", b"FKVR", 1, 1, 2, 0, len(rid), len(body), nonce)
    csum = int.from_bytes(hashlib.blake2b(header + rid + body, digest_size=8).digest(), "big")
    rec = header + rid + body + struct.pack("<Q", csum)
    (d / "seg-000001.bin").write_bytes(rec)
    m = {"format": "fedkv-segments", "version": 1, "checksum": "blake2b_64", "encrypted": True,
         "generation": 1, "next_segment": 2, "segments": {"1": len(rec)},
         "records": {rid.hex(): {"seg": 1, "off": 0, "len": len(rec), "sum": f"{csum:016x}",
                                 "meta": {"kind": "kv", "version": 0, "format": "fp32"}}}}
    canon = lambda o: json.dumps(o, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    m["manifest_sha256"] = hashlib.sha256(canon(m)).hexdigest()
    (d / "manifest.json").write_bytes(canon(m))
    return rid


def test_an_old_format_directory_is_rebuilt_empty_with_a_warning(tmp_path, caplog):
    d = tmp_path / "kv-cache"
    rid = write_old_format_store(d, KEY)
    with caplog.at_level(logging.WARNING, logger="fedkv.cache"):
        kv = KVCache.open(d, config(), key=KEY)
    assert "rebuilding it empty" in caplog.text and "version 1" in caplog.text
    assert kv.found_on_disk == 0 and len(kv.store) == 0
    kv.close()
    assert not seen(every_byte(d), [rid])  # the old ids are gone with the old files
    assert_owner_only(d)
