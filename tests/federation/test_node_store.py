"""The node's error-feedback residual (saved privately, read back, zeros when absent or foreign), and
local files that fail loudly, naming the file (issue 20)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from crypto import write_secret_file
from federation.node_store import NodeStore, ProvisioningError


def test_residual_round_trips_privately(tmp_path) -> None:
    store = NodeStore(tmp_path, "n1")
    assert not np.any(store.load_residual(10))  # none yet: zeros
    r = np.linspace(-1e-3, 1e-3, 10)
    store.save_residual(r)
    assert (tmp_path / "residual.npy").stat().st_mode & 0o077 == 0
    np.testing.assert_allclose(store.load_residual(10), r, rtol=1e-6)  # float32 on disk
    assert not np.any(store.load_residual(11))  # another model size: not carried
    store.save_residual(np.full(10, np.nan))
    assert not np.any(store.load_residual(10))  # a non-finite residual is not carried either


def test_a_torn_or_foreign_residual_file_is_not_carried(tmp_path) -> None:
    store = NodeStore(tmp_path, "n1")
    store.save_residual(np.ones(10))
    path = tmp_path / "residual.npy"
    path.write_bytes(path.read_bytes()[:40])  # torn
    assert not np.any(store.load_residual(10))
    path.write_bytes(b"not a residual")
    assert not np.any(store.load_residual(10))


def test_a_round_is_answered_once_and_its_reply_is_kept(tmp_path) -> None:
    """Issue 20: one reply per (round, kind), kept 0600; a repeat gets it back, byte for byte."""
    import pytest

    from federation.node_store import RepeatedRequest

    store = NodeStore(tmp_path, "n1")
    with store.answer_once(1, 0) as slot:
        assert slot.stored is None
        slot.keep(b"train reply of round 1")
    with store.answer_once(1, 0) as slot:
        assert slot.stored == b"train reply of round 1"
        with pytest.raises(RepeatedRequest):
            slot.keep(b"a second one")
    assert (tmp_path / "answer-1-0.bin").stat().st_mode & 0o077 == 0
    with store.answer_once(1, 1) as slot:  # the noise request of the same round is its own answer
        assert slot.stored is None
        slot.keep(b"noise reply of round 1")
    with pytest.raises(RuntimeError, match="crashed"), store.answer_once(3, 0):
        raise RuntimeError("crashed before keeping")  # nothing left the node: the retry is answered
    with store.answer_once(3, 0) as slot:
        assert slot.stored is None
        slot.keep(b"train reply of round 3")
    # bounded: replies of rounds before the newest two are dropped, and their rounds stay closed
    assert sorted(p.name for p in tmp_path.glob("answer-*")) == ["answer-3-0.bin"]
    for rnd, kind in ((1, 0), (1, 1), (2, 0)):
        with pytest.raises(RepeatedRequest, match="answered round 3"), store.answer_once(rnd, kind):
            pass


def test_a_kept_reply_that_does_not_read_back_is_a_refusal_not_a_second_answer(tmp_path) -> None:
    import pytest

    from federation.node_store import RepeatedRequest

    store = NodeStore(tmp_path, "n1")
    with store.answer_once(5, 0) as slot:
        slot.keep(b"reply")
    path = tmp_path / "answer-5-0.bin"
    path.write_bytes(b"torn")
    with pytest.raises(RepeatedRequest), store.answer_once(5, 0):
        pass
    path.unlink()
    with store.answer_once(5, 0) as slot:  # gone (e.g. removed by hand): the round is answered again
        assert slot.stored is None
# --- issue 20: local secrets and records fail loudly, naming the file ----------------------------


def test_a_cache_key_of_the_wrong_length_is_refused_naming_the_file(tmp_path) -> None:
    store = NodeStore(tmp_path, "n1")
    write_secret_file(tmp_path / "kv-cache.key", b"k" * 31)
    with pytest.raises(ProvisioningError, match=rf"{re.escape(str(tmp_path / 'kv-cache.key'))}: .*31 bytes.*32"):
        store.cache_key()


def test_a_flipped_bit_in_the_cache_key_is_named(tmp_path) -> None:
    store = NodeStore(tmp_path, "n1")
    key = store.cache_key()
    assert store.cache_key() == key and len(key) == 32
    path = tmp_path / "kv-cache.key"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x04
    path.write_bytes(bytes(raw))
    with pytest.raises(Exception, match=rf"{re.escape(str(path))}: key check failed: the file changed"):
        store.cache_key()


def test_a_flipped_bit_in_a_stored_ckks_context_is_named(tmp_path) -> None:
    from crypto import Dealer
    from federation import node_store

    store = NodeStore(tmp_path, "n1")
    ctx = Dealer("fedkv-4096").context
    store.save_context(ctx, 0)
    node_store._CONTEXTS.clear()  # a fresh process
    path = tmp_path / "ckks-0.ctx"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ProvisioningError, match=rf"{re.escape(str(path))}: key check failed"):
        store.context(0)


DAMAGED_RECORDS = {
    "truncated": b'{"epoch": 1, "key-id": "0011',
    "not JSON": b"\x00\xffnot json",
    "empty": b"",
    "a list": b"[1, 2, 3]",
    "wrong types": b'{"epoch": "one", "key-id": 7}',
    "missing fields": b"{}",
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_RECORDS))
def test_a_damaged_held_json_is_a_specific_error_naming_it(tmp_path, damage) -> None:
    store = NodeStore(tmp_path, "n1")
    path = tmp_path / "held.json"
    path.write_bytes(DAMAGED_RECORDS[damage])
    with pytest.raises(ProvisioningError, match=re.escape(str(path))):
        store.held()


PINS = {
    "truncated": b'{"version": 2, "num-partitions": 3, "members": {"100": {"partit',
    "not JSON": b"\x00\xffnot json",
    "empty": b"",
    "a list": b"[]",
    "wrong types": json.dumps({"100": "sign-key"}).encode(),
    "a member of wrong types": json.dumps({"version": 2, "num-partitions": 3,
                                           "members": {"100": {"partition": "0", "sign": 5, "kx": None}}}).encode(),
}


@pytest.mark.parametrize("damage", sorted(PINS))
def test_a_damaged_pins_json_is_a_specific_error_naming_it(tmp_path, damage) -> None:
    from crypto import NodeKeys
    from federation.node_store import Peer

    store = NodeStore(tmp_path, "n1")
    path = tmp_path / "pins.json"
    path.write_bytes(PINS[damage])
    peer = NodeKeys.generate("100").public
    with pytest.raises(ProvisioningError, match=re.escape(str(path))):
        store.pin_members([Peer("100", 0, peer.sign_public, peer.kx_public)], 3)


MEMBERS = {
    "truncated": b'{"version": 1, "partitions": {"0": {"sig',
    "not JSON": b"\x00\xffnot json",
    "a list": b"[]",
    "a key of the wrong size": json.dumps({"version": 1, "partitions": {"0": {"sign": "ab", "kx": "cd"}}}).encode(),
}


@pytest.mark.parametrize("damage", sorted(MEMBERS))
def test_a_damaged_members_json_is_a_specific_error_naming_it(tmp_path, damage) -> None:
    """The member set pinned across runs (federation.enrollment) fails like pins.json: named,
    nothing trusted."""
    from crypto import NodeKeys
    from federation.enrollment import Enrollment
    from federation.node_store import Peer

    enrollment = Enrollment.of(tmp_path, {"partition-id": 0, "num-partitions": 3})
    store = NodeStore(tmp_path / "run-1" / "node-n1", "n1", None, enrollment)
    path = enrollment.path / "members.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(MEMBERS[damage])
    peer = NodeKeys.generate("100").public
    with pytest.raises(ProvisioningError, match=re.escape(str(path))):
        store.pin_members([Peer("100", 0, peer.sign_public, peer.kx_public)], 3)
    assert not (store.root / "pins.json").exists()
