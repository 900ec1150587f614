"""A node's cache lives across Flower messages (issue 10 item 7): two processes built on the
same cache directory see the same parameters, version and K/V blocks; a corrupted directory
falls back to a clean rebuild with a clear log line."""

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from node.cache_node import CacheNode, NodeSpec
from tests.hang_guard import HANG_GUARD_S

KEY = bytes(range(32))
SPEC = dict(partition_id=0, num_partitions=3, task="lm")
PROMPT = b"You are a helpful cache node. " * 2  # 60 bytes: 3 full blocks
REPO = Path(__file__).resolve().parents[2]

CHILD = """
import hashlib, json, sys, torch
torch.set_num_threads(1)
from node.cache_node import CacheNode, NodeSpec
node = CacheNode(NodeSpec(**json.loads(sys.argv[2])), cache_dir=sys.argv[1], cache_key=bytes(range(32)))
found = node.kv_blocks_on_disk
s = node.create_session(system_prompt=json.loads(sys.argv[3]).encode("latin-1"))
node.send(s, b"hi", max_new_tokens=2)
st = node.cache.stats()
print(json.dumps({"version": node.version, "found": found,
                  "params": hashlib.sha256(node.flat_params().tobytes()).hexdigest(),
                  "prefix_hit_blocks": st["prefix_hit_blocks"], "tier_hits": st["tier_hits"]}))
"""


def run_child(cache_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_dir), json.dumps(SPEC), json.dumps(PROMPT.decode("latin-1"))],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_message(cache_dir: Path) -> CacheNode:
    torch.set_num_threads(1)
    node = CacheNode(NodeSpec(**SPEC), cache_dir=cache_dir, cache_key=KEY)
    delta = np.random.default_rng(0).normal(0, 0.01, node.layout.size).astype(np.float32)
    node.apply_mean_update(delta, node.version + 1)  # a write-back: version 1
    s = node.create_session(system_prompt=PROMPT)
    node.send(s, b"hello", max_new_tokens=4)
    node.close(s)
    node.persist()
    return node


def test_a_second_process_sees_the_same_params_version_and_kv_blocks(tmp_path):
    node = first_message(tmp_path)
    got = run_child(tmp_path)
    assert got["version"] == node.version == 1
    assert got["params"] == hashlib.sha256(node.flat_params().tobytes()).hexdigest()
    assert got["found"] >= len(PROMPT) // 16 - 1  # the system prompt's full blocks
    assert got["prefix_hit_blocks"] >= len(PROMPT) // 16 - 1  # served from disk, not recomputed
    assert got["tier_hits"]["warm"] + got["tier_hits"]["cold"] >= 1


def test_a_write_back_invalidates_kv_on_disk(tmp_path):
    node = first_message(tmp_path)
    node.apply_mean_update(np.zeros(node.layout.size, np.float32), node.version + 1)
    node.persist()
    got = run_child(tmp_path)
    assert got["version"] == 2 and got["found"] == 0 and got["prefix_hit_blocks"] == 0


def test_a_corrupted_cache_directory_is_rebuilt_cleanly(tmp_path, caplog):
    first_message(tmp_path)
    for manifest in tmp_path.rglob("manifest*"):
        manifest.write_bytes(b"{not json")
    with caplog.at_level(logging.WARNING, logger="fedkv.cache"):
        node = CacheNode(NodeSpec(**SPEC), cache_dir=tmp_path, cache_key=KEY)
    assert "rebuilding it empty" in caplog.text
    assert node.version == 0 and node.kv_blocks_on_disk == 0
    s = node.create_session(system_prompt=PROMPT)
    assert node.send(s, b"hi", max_new_tokens=2)


def test_a_commit_that_fails_raises_and_keeps_the_previous_parameters(tmp_path, monkeypatch):
    """The cache directory is the node's only stored copy of its parameters: a commit that
    cannot be made (disk full) must fail the message, not log and carry on, and the directory
    keeps the previous commit."""
    import errno

    import pytest

    from cache.segments import SegmentStore

    spec = NodeSpec(partition_id=0, num_partitions=3, task="digits")
    node = CacheNode(spec, cache_dir=tmp_path / "c", cache_key=KEY)
    node.persist()
    before = node.flat_params()
    node.apply_mean_update(np.full(node.layout.size, 0.01), 1)

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SegmentStore, "commit", full)
    with pytest.raises(OSError):
        node.persist()
    node.release()
    monkeypatch.undo()
    again = CacheNode(spec, cache_dir=tmp_path / "c", cache_key=KEY)
    assert again.version == 0
    np.testing.assert_array_equal(again.flat_params(), before)
