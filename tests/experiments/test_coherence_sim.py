"""experiments.coherence_sim: the protocol's state machine (``tests/cache/coherence_machine.py``)
drives agents through the in-process directory in both modes; unit tests pin each transition,
the error paths and a threaded smoke test."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import settings

from cache.coherence import AgentGoneError, CoherenceConfigError, CoherenceTimeout, Mode, NotOwnerError, State
from experiments.coherence_sim import Directory
from tests.cache.coherence_machine import KEYS, CoherenceMachine, check_directory


class DirectoryMachine(CoherenceMachine):
    def make_directory(self) -> Directory:
        return Directory(self.mode, batch=2, timeout_s=1.0)

    def crash(self, agent) -> None:
        self.d.crash(agent)


class RelaxedMachine(DirectoryMachine):
    mode = Mode.RELAXED


for _machine in (DirectoryMachine, RelaxedMachine):
    _machine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestStrongMachine = DirectoryMachine.TestCase
TestRelaxedMachine = RelaxedMachine.TestCase


# --------------------------------------------------------------------------- unit tests


def test_strong_write_waits_for_every_holder_ack():
    d = Directory(Mode.STRONG, timeout_s=1.0)
    t, s1, s2 = d.join("trainer"), d.join("s1"), d.join("s2")
    assert s1.acquire_read("param") == 0 and s1.holds("param") is State.EXCLUSIVE
    assert s2.acquire_read("param") == 0 and s1.holds("param") is State.SHARED
    assert t.try_write("param") is None and t.holds("param") is State.PENDING
    assert s1.holds("param") is State.INVALID  # delivered: stale from now on, before the ACK
    assert d.entry("param").waiting_on == {s1.id, s2.id}
    assert s1.poll() == ["param"]
    assert t.try_write("param") is None and d.entry("param").waiting_on == {s2.id}
    assert s2.poll() == ["param"]
    assert t.try_write("param") == 1 and t.holds("param") is State.MODIFIED
    assert s1.try_read("param") is None  # downgrade pending until the trainer releases
    t.release("param")
    assert s1.try_read("param") == 1 and d.entry("param").state is State.SHARED
    s = d.stats()
    assert (s["invalidations_sent"], s["acks_received"], s["pendings_open"]) == (2, 2, 0)


def test_relaxed_writer_does_not_wait_and_readers_see_the_batch_late():
    d = Directory(Mode.RELAXED, batch=2, timeout_s=1.0)
    w, r = d.join("writer"), d.join("reader")
    assert r.acquire_read("k") == 0
    assert w.acquire_write("k") == 1  # no wait: invalidation queued
    w.release("k")
    assert d.stats()["invalidations_queued"] == 1 and d.stats()["invalidations_sent"] == 0
    assert r.acquire_read("k") == 0 and r.holds("k") is State.SHARED  # stale copy, allowed
    assert r.poll() == []
    w.sync()
    assert r.holds("k") is State.INVALID and d.stats()["batches_sent"] == 1
    assert r.poll() == ["k"] and r.acquire_read("k") == 1


def test_relaxed_batch_is_sent_every_batch_writes():
    d = Directory(Mode.RELAXED, batch=2, timeout_s=1.0)
    w, r = d.join("writer"), d.join("reader")
    for key in ("a", "b"):
        r.acquire_read(key)
    w.acquire_write("a")
    assert d.stats()["batches_sent"] == 0
    w.acquire_write("b")
    assert d.stats()["batches_sent"] == 1 and sorted(r.poll()) == ["a", "b"]


def test_a_late_relaxed_invalidation_does_not_drop_a_newer_copy():
    d = Directory(Mode.RELAXED, batch=8, timeout_s=1.0)
    w, r = d.join("writer"), d.join("reader")
    r.acquire_read("k")
    w.acquire_write("k")
    w.release("k")
    r.poll()
    r._copies.pop("k")  # as if evicted locally: it reads again and gets version 1
    assert r.acquire_read("k") == 1
    w.sync()  # delivers the (k, 1) invalidation queued before
    assert r.poll() == [] and r.holds("k") is State.SHARED and d.entry("k").holders[r.id] == 1


@pytest.mark.parametrize("how", ["leave", "crash"])
def test_leave_or_crash_resolves_a_pending_write(how):
    d = Directory(Mode.STRONG, timeout_s=1.0)
    t, s = d.join("trainer"), d.join("server")
    s.acquire_read("param")
    assert t.try_write("param") is None
    s.leave() if how == "leave" else d.crash(s)
    assert t.try_write("param") == 1
    st_ = d.stats()
    assert st_["invalidations_discarded"] == 1 and st_["crashes" if how == "crash" else "leaves"] == 1
    for call in (s.poll, lambda: s.acquire_read("x"), lambda: s.holds("x"), s.leave):
        with pytest.raises(AgentGoneError, match="has left"):
            call()


def test_leaving_delivers_queued_relaxed_invalidations():
    d = Directory(Mode.RELAXED, batch=100, timeout_s=1.0)
    w, r = d.join("writer"), d.join("reader")
    r.acquire_read("k")
    w.acquire_write("k")
    w.leave()
    assert r.poll() == ["k"] and d.entry("k").state is State.INVALID


def test_timeout_withdraws_the_pending_and_names_the_silent_agent():
    d = Directory(Mode.STRONG, timeout_s=0.05)
    t, s = d.join("trainer"), d.join("server")
    s.acquire_read("param")
    with pytest.raises(CoherenceTimeout, match=rf"waiting on agent\(s\) \[{s.id}\]"):
        t.acquire_write("param")
    assert d.entry("param").pending_requester is None and d.stats()["timeouts"] == 1
    s.poll()  # the late ACK: its copy is dropped (safe), the trainer's retry is granted
    assert t.acquire_write("param") == 1


def test_a_reader_times_out_on_an_owner_that_never_releases():
    d = Directory(Mode.STRONG, timeout_s=0.05)
    t, s = d.join("trainer"), d.join("server")
    t.acquire_write("param")
    with pytest.raises(CoherenceTimeout, match="read of 'param'"):
        s.acquire_read("param")
    assert d.stats()["pendings_open"] == 0


def test_owner_may_write_again_while_a_read_waits_on_it():
    d = Directory(Mode.STRONG, timeout_s=1.0)
    t, s = d.join("trainer"), d.join("server")
    t.acquire_write("k")
    assert s.try_read("k") is None
    assert t.acquire_write("k") == 2  # no self-deadlock on the downgrade it owes
    t.release("k")
    assert s.try_read("k") == 2


def test_a_write_waits_for_the_owner_release_then_invalidates_it():
    d = Directory(Mode.STRONG, timeout_s=1.0)
    a, b = d.join("a"), d.join("b")
    a.acquire_write("k")
    assert b.try_write("k") is None
    a.release("k")
    assert a.holds("k") is State.INVALID and b.try_write("k") == 2
    check_directory(d, {a.id, b.id}, Mode.STRONG)


def test_bad_input_is_a_named_error_and_changes_nothing():
    with pytest.raises(CoherenceConfigError, match="mode"):
        Directory(3)
    with pytest.raises(CoherenceConfigError, match="batch"):
        Directory(Mode.RELAXED, batch=0)
    with pytest.raises(CoherenceConfigError, match="timeout_s"):
        Directory(timeout_s=0)
    d = Directory()
    with pytest.raises(CoherenceConfigError, match="agent name"):
        d.join("")
    a = d.join("a")
    with pytest.raises(CoherenceConfigError, match="key"):
        a.acquire_read("")
    with pytest.raises(NotOwnerError, match="does not hold"):
        a.release("k")
    a.acquire_read("k")
    with pytest.raises(NotOwnerError, match="state E"):
        a.release("k")
    assert d.entry("k").holders == {a.id: 0} and d.stats()["pendings_open"] == 0
    with pytest.raises(CoherenceConfigError, match="interval_s"):
        a.start_polling(0)


def test_poller_acks_for_an_idle_agent_and_calls_back():
    d = Directory(Mode.STRONG, timeout_s=5.0)
    t, s = d.join("trainer"), d.join("server")
    s.acquire_read("param")
    seen: list[list[str]] = []
    poller = s.start_polling(0.001, on_invalidate=seen.append)
    try:
        assert t.acquire_write("param") == 1
    finally:
        poller.stop()
    assert seen == [["param"]] and poller.polls > 0


def test_poller_surfaces_a_callback_error_on_stop():
    d = Directory(Mode.STRONG, timeout_s=5.0)
    t, s = d.join("trainer"), d.join("server")
    s.acquire_read("k")

    def boom(keys: list[str]) -> None:
        raise RuntimeError("reload failed")

    poller = s.start_polling(0.001, on_invalidate=boom)
    t.acquire_write("k")
    with pytest.raises(RuntimeError, match="reload failed"):
        poller.stop()


def test_threads_never_read_a_version_older_than_the_last_completed_write():
    """Four threads, strong mode: each op starts from the last completed version of the key
    and must see it or a newer one; every strong write completes (none times out)."""
    d = Directory(Mode.STRONG, timeout_s=10.0)
    store = {k: 0 for k in KEYS}          # the data: key -> version written
    completed = dict.fromkeys(KEYS, 0)
    stale: list[tuple] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        agent = d.join(f"t{seed}")
        try:
            for i in range(300):
                key = KEYS[(i * (seed + 1)) % len(KEYS)]
                floor = completed[key]
                if (i + seed) % 5 == 0:
                    v = agent.acquire_write(key)
                    completed[key] = max(completed[key], v)
                    store[key] = v
                    agent.release(key)
                else:
                    v = agent.acquire_read(key)
                    if store[key] < floor or v < floor:
                        stale.append((key, v, store[key], floor))
        except BaseException as exc:
            errors.append(exc)
        finally:
            agent.leave()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and not stale
    s = d.stats()
    assert s["writes"] == sum(completed.values()) and s["timeouts"] == 0
    assert s["invalidations_sent"] == s["acks_received"] + s["invalidations_discarded"]
    assert s["pendings_open"] == 0 and s["agents"] == 0


def test_serving_thread_with_a_poller_never_returns_a_token_older_than_a_completed_write():
    """Model-version coherence with a ``start_polling`` thread ACKing for the server: the server
    checks ``holds("param")`` after computing each token and before returning it, so every
    write newer than a returned token's version completed after that check."""
    d = Directory(Mode.STRONG, timeout_s=10.0)
    trainer, server = d.join("trainer"), d.join("server")
    params = {0: 0.0}                      # version -> parameters (here one number)
    completed: dict[int, float] = {}       # version -> time its strong write completed
    returned: list[tuple[int, float]] = []  # (version, time of the check before returning)
    reloads: list[list[str]] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            v = server.acquire_read("param")
            token = params[v] * 2          # computed with parameters of version v
            checked = time.monotonic()
            if server.holds("param") is State.INVALID:
                continue                   # invalidated meanwhile: recompute, don't return
            assert token == v * 2
            returned.append((v, checked))

    poller = server.start_polling(0.0005, on_invalidate=reloads.append)
    th = threading.Thread(target=serve)
    th.start()
    try:
        for _ in range(30):
            v = trainer.acquire_write("param")
            completed[v] = time.monotonic()
            params[v] = float(v)
            trainer.release("param")
            time.sleep(0.001)
    finally:
        stop.set()
        th.join(10)
        poller.stop()
    assert len(completed) == 30 and returned and reloads
    for v, checked in returned:
        assert all(completed[w] > checked for w in completed if w > v), (v, checked)
