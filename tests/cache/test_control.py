"""The live-control file protocol (cache/control.py) between an engine and a reader, in one
process: snapshots, change requests and their answers, bad files, the polling boundary; the
engine's plane (cache/live.py): file work on a timer thread, changes applied by operations."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid

import pytest

from cache import KVCache
from cache.control import (
    LIVE_DIR, STATS_FILE, ChangeRejectedError, CorruptLiveFileError, LiveControl,
    NoLiveEngineError, Request, read_snapshot, request_change, write_json_atomic,
)

from tests.cache.conftest import feed, small_config
from tests.hang_guard import HANG_GUARD_S

KEY = bytes(range(32))


@pytest.fixture
def kv(tmp_path):
    kv = KVCache.open(tmp_path, small_config(warm_bytes=1 << 20), key=KEY)
    yield kv
    kv.close()


def _ops_until(kv: KVCache, done: threading.Event, limit: int = 20000) -> None:
    """Run cheap operations (each one an operation boundary) until ``done``."""
    for i in range(limit):
        if done.wait(0.002):
            return
        sid = kv.open_session()
        kv.match_prefix(sid, [1, 2, 3, 4, 5])
        kv.close_session(sid)


def _change_while_operating(kv: KVCache, tmp_path, key: str, value) -> dict:
    out: dict = {}
    done = threading.Event()

    def ask() -> None:
        try:
            out["answer"] = request_change(tmp_path, key, value, timeout_s=10)
        except Exception as e:  # noqa: BLE001 -- handed to the test thread
            out["error"] = e
        done.set()

    t = threading.Thread(target=ask)
    t.start()
    _ops_until(kv, done)
    t.join()
    if "error" in out:
        raise out["error"]
    return out["answer"]


def test_open_publishes_a_private_snapshot_without_key_material(kv, tmp_path):
    snap = read_snapshot(tmp_path)
    assert snap.pid == os.getpid() and snap.attached and snap.live
    assert snap.stats["tunables"] == kv.tunables()
    path = tmp_path / LIVE_DIR / STATS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    raw = path.read_bytes()
    assert KEY not in raw and KEY.hex().encode() not in raw


def test_flush_publishes_the_current_figures(kv, tmp_path):
    sid = kv.open_session()
    feed(kv, sid, list(range(9)))
    kv.flush()
    assert read_snapshot(tmp_path).stats["latency"]["reserve"]["samples"] == 1


def test_a_change_is_applied_at_an_operation_boundary_and_answered(kv, tmp_path):
    answer = _change_while_operating(kv, tmp_path, "evict_batch", 24)
    assert (answer["status"], answer["old"], answer["new"]) == ("applied", 16, 24)
    assert answer["pid"] == os.getpid() and kv.config.evict_batch == 24
    assert not [n for n in os.listdir(tmp_path / LIVE_DIR) if n.startswith(("set-", "ack-"))]


def test_the_engine_validates_a_request_again(kv, tmp_path):
    with pytest.raises(ChangeRejectedError, match="coherence_protocol"):
        _change_while_operating(kv, tmp_path, "coherence_protocol", 7)
    assert kv.config.coherence_protocol == 2


def test_a_garbage_request_is_logged_answered_and_dropped(kv, tmp_path, caplog):
    rid = uuid.uuid4().hex
    req = tmp_path / LIVE_DIR / f"set-{rid}.json"
    for garbage in (b"\xff\xfe", b"[1, 2]", b'{"value": 3}'):
        req.write_bytes(garbage)
        with caplog.at_level(logging.WARNING, logger="fedkv.cache"):
            kv.live.tick()  # as the timer thread does (one tick at a time: it may have been first)
        assert not kv.live.inbox
        assert not req.exists() and "ignored" in caplog.text
        ack = json.loads((tmp_path / LIVE_DIR / f"ack-{rid}.json").read_text())
        assert ack["status"] == "unreadable"
    assert kv.tunables()["evict_batch"] == 16


def test_a_snapshot_that_is_garbage_is_a_clear_error(tmp_path):
    live = tmp_path / LIVE_DIR
    live.mkdir()
    for garbage, why in ((b"\x00\x01", "not valid JSON"), (b"[]", "not a JSON object"),
                         (b'{"pid": 3}', "not an engine snapshot")):
        (live / STATS_FILE).write_bytes(garbage)
        with pytest.raises(CorruptLiveFileError, match=why):
            read_snapshot(tmp_path)


def test_no_snapshot_means_no_live_engine(tmp_path):
    with pytest.raises(NoLiveEngineError, match="does not exist"):
        read_snapshot(tmp_path)


def test_after_close_the_directory_has_no_live_engine(tmp_path):
    kv = KVCache.open(tmp_path, small_config())
    kv.close()
    snap = read_snapshot(tmp_path)
    assert not snap.attached and not snap.live
    with pytest.raises(NoLiveEngineError, match="closed or released"):
        request_change(tmp_path, "evict_batch", 8, timeout_s=0.1)


def test_release_and_attach_leave_and_rejoin(tmp_path):
    kv = KVCache.open(tmp_path, small_config())
    kv.release()
    assert kv.live is None and not read_snapshot(tmp_path).attached
    kv.attach(tmp_path)
    assert kv.live is not None and read_snapshot(tmp_path).live
    kv.close()


def test_operations_never_read_the_directory_and_apply_requests_at_the_poll_deadline(
        kv, monkeypatch):
    kv.live.stop()  # the timer thread's file work is out of the way: only operations run
    reads = []
    monkeypatch.setattr(kv.live.control, "take_requests", lambda: reads.append(1) or [])
    kv.live.inbox.append(Request("0" * 32, "evict_batch", 24))
    sid = kv.open_session()
    kv._boundary_ns = 1 << 62  # far away: no operation looks
    feed(kv, sid, [1, 2, 3])
    assert kv.config.evict_batch == 16 and len(kv.live.inbox) == 1
    kv._boundary_ns = 0  # due: the next operation applies it, once, and sets the next deadline
    feed(kv, sid, [4])
    assert kv.config.evict_batch == 24 and not kv.live.inbox and kv._boundary_ns > 0
    (req, answer), = kv.live.answered  # answered by the timer thread (here: stop/close)
    assert answer == {"status": "applied", "key": "evict_batch", "old": 16, "new": 24}
    assert reads == []


def test_a_failing_live_control_never_fails_an_operation(kv, monkeypatch, caplog):
    def broken():
        raise RuntimeError("disk on fire")

    kv.live.stop()
    monkeypatch.setattr(kv.live, "apply_pending", broken)
    kv.live.inbox.append(Request("0" * 32, "evict_batch", 24))
    kv._boundary_ns = 0
    sid = kv.open_session()
    with caplog.at_level(logging.ERROR, logger="fedkv.cache"):
        feed(kv, sid, [1, 2, 3])
    assert kv.length(sid) == 3 and "live control failed" in caplog.text


def test_the_timer_publishes_without_operations(kv, tmp_path):
    before = json.loads((tmp_path / LIVE_DIR / STATS_FILE).read_text())["written_at"]
    kv.live.next_publish_ns = 0  # due now: the timer thread's next tick (POLL_S) publishes
    deadline = time.monotonic() + HANG_GUARD_S
    while json.loads((tmp_path / LIVE_DIR / STATS_FILE).read_text())["written_at"] == before:
        assert time.monotonic() < deadline, "no timed snapshot"
        time.sleep(0.02)


def test_a_snapshot_that_cannot_be_written_is_logged(tmp_path, monkeypatch, caplog):
    live = LiveControl(tmp_path)

    def full(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("cache.control.write_json_atomic", full)
    with caplog.at_level(logging.WARNING, logger="fedkv.cache"):
        live.publish({"x": 1})
    assert "not written" in caplog.text


def test_atomic_write_leaves_no_temporary_file_on_failure(tmp_path):
    with pytest.raises(TypeError):
        write_json_atomic(str(tmp_path / "x.json"), {"bad": object()})
    assert os.listdir(tmp_path) == []


def test_an_expensive_snapshot_spaces_the_next_ones_out(kv, monkeypatch):
    from time import perf_counter_ns, sleep

    from cache.control import PUBLISH_S
    from cache.live import PUBLISH_COST_FACTOR

    kv.live.stop()
    start = perf_counter_ns()
    kv.live.publish(start)
    assert kv.live.next_publish_ns - start >= PUBLISH_S * 1e9  # a cheap one: the floor
    real = kv.stats
    monkeypatch.setattr(kv, "stats", lambda: (sleep(0.02), real())[1])
    start = perf_counter_ns()
    kv.live.publish(start)
    assert kv.live.next_publish_ns - start >= PUBLISH_COST_FACTOR * 0.02e9
