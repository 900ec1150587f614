"""The node's error-feedback residual: saved privately, read back, zeros when absent or foreign."""

from __future__ import annotations

import numpy as np

from federation.node_store import NodeStore


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
